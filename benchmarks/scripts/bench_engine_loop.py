"""Issue 16 on the GPU: host time in the engine loop, overlapped scheduling on and off.

Part 1, per setting (overlap on / off), one engine, same process:
  end-to-end decode inter-token latency through `LLM.generate` at batch 1 and 32 (context ~1k), next to the
  CUDA-graph replay time of that same decode step (the graph's static buffers still hold the last real
  batch). ITL through generate = (time of generate with 1 + M tokens - time with 1 token) / M on fresh
  prompts (prefix caching off), so prefill and start-up cancel out.
Part 2: `minidsa bench` (the default workload, offline) in a fresh process per setting (overlap on / off x mixed
  steps on / off, after one unrecorded warm-up run: Triton JIT), ITL p50 / p99,
  output tok/s, TTFT. With --mixed-budgets B1,B2,...: instead one run per mixed prefill budget
  (`--max-mixed-prefill-tokens B`, overlap and mixed steps on), the sweep that picks that default.

    python benchmarks/scripts/bench_engine_loop.py --out /tmp/out [--model bench-dsv32] [--skip-bench] [--bench-args ...]
        [--mixed-budgets 256,512,1024,2048,8192]
    (--allow-cpu: a smoke run of the script on the tiny model without a GPU; its figures mean nothing)
    --tensor-parallel-size N / --distributed-executor-backend mp: the same through the tensor-parallel path
    (rank 0 broadcasts each step plan; at N = 1 a process group of one), to compare with a plain run.

Writes engine_loop.json and engine_loop.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1, (n, length), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate_s(llm, prompts, max_tokens: int, temperature: float = 0.0) -> float:
    from minidsa import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=temperature,
                            seed=0 if temperature else None)
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return time.perf_counter() - start


def _start_decoding(engine, prompts, params) -> list[str]:
    """Add the requests (prefix cache off) and step until every one is decoding; their ids."""
    ids = [engine.add_request(p, params, use_prefix_cache=False) for p in prompts]
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 3:  # every request decoding; overlap's step in flight is a decode step too
        for o in engine.step():
            got[o.request_id] += len(o.new_token_ids)
    return ids


def _abort_all(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid, report=False)
    while engine.has_unfinished():
        engine.step()


def _steady_itl_ms(llm, prompts, decode_tokens: int, temperature: float = 0.0, profile: bool = False
                   ) -> tuple[float, dict]:
    """Inter-token latency of the engine loop in steady decode: the requests are added, stepped until every one
    is decoding (prefill and mixed steps done), then `decode_tokens` steps of `Engine.step` (what LLM.generate
    and the server loop call) are timed: their time per token of a request. Under
    --profile the timed steps run inside torch.profiler (their GPU idle time and kernel table)."""
    from minidsa import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=4 * decode_tokens + 512, ignore_eos=True, detokenize=False,
                            temperature=temperature, seed=0 if temperature else None)
    ids = _start_decoding(engine, prompts, params)
    prof = None
    if profile and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    try:
        _sync()
        start = time.perf_counter()
        tokens = 0
        for _ in range(decode_tokens):  # a step() may deliver 0 or 2 tokens of a request: count them all
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - start
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    stats = _idle_and_kernels(prof, decode_tokens) if prof is not None else {}
    _abort_all(engine, ids)
    return elapsed / (tokens / len(ids)) * 1e3, stats


def mixed_step_profile(llm, prompts, prompt_len: int, vocab: int, steps: int = 6) -> dict:
    """Steady decode of `prompts`, then one new request of `prompt_len` tokens arrives: the wall time of each
    `Engine.step` around it (the mixed step carries its prefill beside the decode rows), the GPU kernels and
    idle time of those steps (torch.profiler) and the host's cProfile. Prints the tables; returns the times."""
    import cProfile
    import io
    import pstats

    from minidsa import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=512, ignore_eos=True, detokenize=False)
    ids = _start_decoding(engine, prompts, params)
    for _ in range(4):
        engine.step()
    _sync()
    from torch.profiler import ProfilerActivity, profile as torch_profile

    times = []
    host = cProfile.Profile()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            if i == 1:
                ids.append(engine.add_request(_prompts(1, prompt_len, vocab, 99)[0], params, use_prefix_cache=False))
            start = time.perf_counter()
            host.enable()
            engine.step()
            host.disable()
            times.append((time.perf_counter() - start) * 1e3)
        _sync()
    stats = _idle_and_kernels(prof, steps)
    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"mixed step profile: {len(prompts)} decoding, a {prompt_len}-token prompt added before step 1; "
          f"step wall times (ms) {[round(t, 2) for t in times]}", flush=True)
    print(json.dumps(stats, indent=1), flush=True)
    print(buf.getvalue(), flush=True)
    _abort_all(engine, ids)
    return {"step_ms": times, "decoding": len(prompts), "prompt_len": prompt_len}


def _idle_and_kernels(prof, steps: int) -> dict:
    """GPU idle fraction of a profiled window and the GPU time per step by kernel (the top 25)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start]
    if not kernels:
        return {}
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    gaps, end = [], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            gaps.append(s - end)
        end = max(end, e)
    wall = end - spans[0][0]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], [0.0, 0])
        by_name[e.name[:90]][0] += e.time_range.end - e.time_range.start
        by_name[e.name[:90]][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"wall_ms_per_step": wall / 1e3 / steps, "idle_us_per_step": sum(gaps) / steps,
            "gpu_busy_us_per_step": (wall - sum(gaps)) / steps, "idle_frac": sum(gaps) / wall,
            "kernels_per_step": {n: [round(t / steps, 1), c / steps] for n, (t, c) in top}}


def _replay_ms(graphs, bs: int, context: int, iters: int = 50) -> tuple[float, float]:
    """Replay time of the decode graph the last steps used (its static buffers hold that batch): back to back
    (`iters` replays between two events, the best of 3: the GPU never waits, the floor of a decode step) and
    the median of single replays each followed by a sync (the GPU idles between them); nan without graphs."""
    if graphs is None:
        return float("nan"), float("nan")
    from minidsa.common.plan import StepKind

    bucket = graphs.bucket_for(StepKind.DECODE, bs)
    st = graphs.static[(StepKind.DECODE, bucket, graphs.ctx_bucket_for(context + 1))]

    def timed(n: int) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            st.graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / n

    singles = sorted(timed(1) for _ in range(iters))
    return min(timed(iters) for _ in range(3)), singles[len(singles) // 2]


def measure_itl(model: str, overlap: bool, batches: list[int], context: int, decode_tokens: int,
                max_bs: int, compile: bool = True, parallel: dict | None = None, profile: bool = False,
                temperature: float = 0.0, mixed_step: int = 0) -> list[dict]:
    from minidsa import LLM

    # --mixed-step: one request more than the largest batch must find a free slot
    llm = LLM(model=model, progress=False, overlap_schedule=overlap, enable_prefix_caching=False,
              max_running_requests=max(batches) + (1 if mixed_step else 0), cuda_graph_max_bs=max_bs,
              enable_compile=compile,
              **(parallel or {}))
    vocab = llm.engine.vocab_size
    rows = []
    seed = 0
    for bs in batches:
        _generate_s(llm, _prompts(bs, context, vocab, seed := seed + 1), 4, temperature)  # warm-up at this size
        t1 = min(_generate_s(llm, _prompts(bs, context, vocab, seed := seed + 1), 1, temperature) for _ in range(2))
        tn = min(_generate_s(llm, _prompts(bs, context, vocab, seed := seed + 1), 1 + decode_tokens, temperature)
                 for _ in range(2))
        itl_ms = (tn - t1) / decode_tokens * 1e3
        steady_ms, stats = _steady_itl_ms(llm, _prompts(bs, context, vocab, seed := seed + 1), decode_tokens,
                                          temperature, profile)
        replay_ms, single_ms = _replay_ms(llm.engine.runner.graphs, bs, context + decode_tokens)
        rows.append({"overlap": overlap, "batch": bs, "context": context, "temperature": temperature,
                     "sampler": os.environ.get("MINIDSA_SAMPLE", "default"), "itl_generate_ms": itl_ms,
                     "itl_steady_ms": steady_ms, "graph_replay_ms": replay_ms, "graph_replay_single_ms": single_ms,
                     "ratio": itl_ms / replay_ms,
                     "steady_ratio": steady_ms / replay_ms, **({"steady_profile": stats} if stats else {})})
        print(f"overlap={overlap} bs={bs}: ITL through generate {itl_ms:.3f} ms, steady decode {steady_ms:.3f} ms, "
              f"graph replay {replay_ms:.3f} ms (single, synced: {single_ms:.3f}), "
              f"ratios {itl_ms / replay_ms:.3f} / {steady_ms / replay_ms:.3f}",
              flush=True)
        if stats:
            print(json.dumps(stats, indent=1), flush=True)
        if mixed_step and torch.cuda.is_available():
            rows[-1]["mixed_step"] = mixed_step_profile(llm, _prompts(bs, context, vocab, seed := seed + 1),
                                                        mixed_step, vocab)
    llm.close()  # tensor-parallel ranks stop
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def run_bench(model: str, overlap: bool, out: str, extra: list[str], mixed: bool = True,
              mixed_budget: int | None = None) -> dict:
    """One `minidsa bench` process; `mixed_budget` sets --max-mixed-prefill-tokens (None: the engine default or
    what `extra` says)."""
    path = os.path.join(out, "engine_loop_bench.json")
    cmd = [sys.executable, "-m", "minidsa", "bench", "--model", model, "--no-progress", "--json", path, *extra]
    if not overlap:
        cmd.append("--disable-overlap-schedule")
    if not mixed:
        cmd.append("--disable-mixed-chunk")
    if mixed_budget is not None:  # after `extra`: the last occurrence of a flag wins
        cmd += ["--max-mixed-prefill-tokens", str(mixed_budget)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        full = json.load(f)
    r = full["results"]
    os.remove(path)  # summarised below: few files come back from the GPU machine
    # The budget the engine ran with, as it resolved it (the engine default when no flag set it)
    budget = full["engine_config"].get("max_mixed_prefill_tokens")
    return {"overlap": overlap, "mixed": mixed, "max_mixed_prefill_tokens": budget if mixed else None,
            "output_tokens_per_s": r["output_tokens_per_s"],
            "itl_p50_ms": r["itl_s"]["p50"] * 1e3, "itl_p99_ms": r["itl_s"]["p99"] * 1e3,
            "ttft_p50_ms": r["ttft_s"]["p50"] * 1e3, "ttft_p99_ms": r["ttft_s"]["p99"] * 1e3,
            "duration_s": r["duration_s"], "num_requests": r["num_requests"]}


class JitWatch:
    """What compiles while it watches: Triton kernels (their JIT hooks: name, constexprs, seconds), DeepGEMM
    kernels (new entries in its JIT cache folder), Dynamo frames. `take()` returns a summary since the last call.
    Diagnostics for a benchmark: the engine does not depend on it."""

    def __init__(self):
        import triton

        self.events: list[tuple[str, str, float]] = []
        self._started: dict[tuple, float] = {}
        knobs = getattr(triton, "knobs", None)
        self.ok = knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook")
        if self.ok:
            knobs.runtime.jit_cache_hook = self._before
            knobs.runtime.jit_post_compile_hook = self._after
        self.dg_dir = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
        self._dg_seen = self._dg_entries()
        self._frames = self._dynamo_frames()

    @staticmethod
    def _name(kw: dict) -> str:
        fn = kw.get("fn")
        return str(getattr(fn, "name", fn))

    def _before(self, **kw):  # keyword names as Triton's JITFunction._call_hook passes them
        self._started[(self._name(kw), str(kw.get("key")))] = time.perf_counter()
        return None  # compile as usual

    def _after(self, **kw):
        name = self._name(kw)
        began = self._started.pop((name, str(kw.get("key"))), None)
        constants = (kw.get("compile") or {}).get("constants") or {}
        consts = {k[0] if isinstance(k, tuple) else k: v for k, v in constants.items()
                  if isinstance(v, (int, bool, str))}
        self.events.append((name, f"{str(consts)[:160]} key {str(kw.get('key'))[:400]}",
                            time.perf_counter() - began if began else float("nan")))
        return None

    def _dg_entries(self) -> set[str]:
        out = set()
        for root, dirs, _files in os.walk(self.dg_dir):
            out.update(os.path.join(root, d) for d in dirs if d.startswith("kernel"))
        return out

    @staticmethod
    def _dynamo_frames() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def take(self) -> dict:
        events, self.events = self.events, []
        dg = self._dg_entries()
        new_dg, self._dg_seen = sorted(dg - self._dg_seen), dg
        frames = self._dynamo_frames()
        new_frames, self._frames = frames - self._frames, frames
        by_name: dict[str, list] = {}
        for name, _consts, secs in events:
            by_name.setdefault(name, [0, 0.0])
            by_name[name][0] += 1
            by_name[name][1] += secs if secs == secs else 0.0
        return {"triton_compiles": len(events), "triton_compile_s": round(sum(v[1] for v in by_name.values()), 1),
                "triton_by_kernel": {k: [v[0], round(v[1], 1)] for k, v in
                                     sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]},
                "triton_examples": [list(e) for e in events[:40]],
                "deepgemm_new_kernels": len(new_dg), "deepgemm_examples": [os.path.basename(d) for d in new_dg[:20]],
                "dynamo_new_graphs": new_frames}


def bench_in_process(model: str, budgets: list[int] | None, extra: list[str], out: str, runs_per_budget: int = 1
                     ) -> list[dict]:
    """`minidsa bench`'s workload on ONE engine (start-up and JIT paid once): the first run right after start-up
    (what is left to JIT after the start-up warm-up shows in its TTFT), then `runs_per_budget` runs per mixed
    prefill budget, set on the live scheduler between runs. Each row also fits the step cost: wall time of a
    step against its decode rows and prefill tokens (ms = a + b * rows + c * prefill tokens, least squares).
    Rows are written to `out`/engine_loop_inprocess.json as they come (a timed-out call keeps what ran)."""
    from minidsa.bench import offline as bench
    from minidsa.cli import build_parser, engine_config_from_args
    from minidsa.engine import Engine

    args = build_parser().parse_args(["bench", "--model", model, *extra])
    if args.log_level:  # e.g. --bench-args "--log-level INFO": the engine's start-up breakdown
        import logging

        logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(name)s: %(message)s")
    jit = JitWatch()
    start = time.perf_counter()
    engine = Engine(engine_config_from_args(args), progress=False)
    startup_s = time.perf_counter() - start
    print(f"start-up {startup_s:.1f} s, compiled then: {json.dumps(jit.take())}", flush=True)
    w = bench.make_workload(args.workload, args.num_requests, args.input_len, args.output_len, args.workload_seed,
                            args.shared_prefix_len, engine.runner.device.type == "cuda", engine.vocab_size,
                            engine.max_model_len)
    composition: list[tuple[int, int] | None] = []  # per engine step: (decode rows, prefill tokens) it scheduled
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        composition.append(None if batch is None else
                           (batch.num_decode, sum(batch.extend_lens) - batch.num_decode))
        return batch

    engine.scheduler.schedule = recording_schedule  # observe only: the same batches are returned
    rows: list[dict] = []
    default_budget = engine.scheduler.max_mixed_prefill_tokens
    plan = [("first after start-up", default_budget)] + [
        ("warm", b) for b in (budgets or [default_budget]) for _ in range(runs_per_budget)]
    for label, budget in plan:
        engine.scheduler.max_mixed_prefill_tokens = budget
        composition.clear()
        # The prompts again, as a fresh engine would see them: no prefix-cache hits from the runs before
        r = bench.run_workload(engine, w, progress=False, use_prefix_cache=False)
        engine.check_no_leaks()
        row = {"run": label, "max_mixed_prefill_tokens": budget, "startup_s": startup_s,
               "output_tokens_per_s": r["output_tokens_per_s"],
               "itl_p50_ms": r["itl_s"]["p50"] * 1e3, "itl_p90_ms": r["itl_s"]["p90"] * 1e3,
               "itl_p99_ms": r["itl_s"]["p99"] * 1e3,
               "ttft_p50_ms": r["ttft_s"]["p50"] * 1e3, "ttft_p99_ms": r["ttft_s"]["p99"] * 1e3,
               "duration_s": r["duration_s"], "num_requests": r["num_requests"], "num_steps": r["num_steps"],
               "step_cost": _fit_step_cost(r["timeline"], composition, overlap=engine.overlap),
               "slow_steps": _slow_steps(r["timeline"], composition), "compiled_during_run": jit.take(),
               # per engine.step: [ms, decode rows, prefill tokens] of the batch it launched ([ms, 0, 0]: none)
               "steps": [[round(ms, 2), *(c or (0, 0))] for ms, c in zip(_step_ms(r["timeline"]), composition)]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out, "engine_loop_inprocess.json"), "w") as f:
            json.dump({"model": model, "extra": extra, "rows": rows}, f, indent=2)
    engine.close()
    return rows


def _step_ms(timeline: list) -> list[float]:
    """Wall time of each engine.step of a run (ms), from `bench.run_workload`'s timeline."""
    return [(t - (timeline[i - 1][0] if i else 0.0)) * 1e3 for i, (t, _, _) in enumerate(timeline)]


def _slow_steps(timeline: list, composition: list, over_ms: float = 100.0, keep: int = 40) -> list:
    """Steps whose engine.step took over `over_ms`: [index, seconds since start, ms, this call's batch (decode
    rows, prefill tokens), the previous call's batch] (under the overlap a call waits for the previous one)."""
    out = []
    for i, ms in enumerate(_step_ms(timeline)):
        if ms > over_ms:
            out.append([i, round(timeline[i][0], 2), round(ms, 1), composition[i] if i < len(composition) else None,
                        composition[i - 1] if 0 < i <= len(composition) else None])
    return out[:keep]


def _fit_step_cost(timeline: list, composition: list, overlap: bool) -> dict:
    """Least-squares fit of step wall time (ms) = a + b * decode rows + c * prefill tokens, and how the steps
    with prefill compare with those without. Under the overlap, step i's wall time is mostly the wait for the
    step launched by call i - 1, so the wall times are paired with the previous call's batch."""
    times = _step_ms(timeline)
    shift = 1 if overlap else 0
    pairs = [(composition[i - shift], times[i]) for i in range(shift, min(len(times), len(composition)))
             if composition[i - shift] is not None]
    pairs = pairs[2:]  # the first steps of a run carry its start (no steady state yet)
    if len(pairs) < 4:
        return {}
    x = torch.tensor([[1.0, rows, prefill] for (rows, prefill), _ in pairs], dtype=torch.float64)
    y = torch.tensor([ms for _, ms in pairs], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist()
    mixed = [ms for (rows, prefill), ms in pairs if prefill and rows]
    decode = [ms for (rows, prefill), ms in pairs if not prefill]
    median = lambda xs: float(torch.tensor(xs).median()) if xs else float("nan")  # noqa: E731
    prefill_tokens = sorted(prefill for (rows, prefill), _ in pairs if prefill and rows)
    return {"ms_fixed": coef[0], "ms_per_decode_row": coef[1], "us_per_prefill_token": coef[2] * 1e3,
            "decode_steps": len(decode), "decode_step_ms_median": median(decode),
            "mixed_steps": len(mixed), "mixed_step_ms_median": median(mixed),
            "mixed_prefill_tokens_median": prefill_tokens[len(prefill_tokens) // 2] if prefill_tokens else 0}


def to_markdown(result: dict) -> str:
    lines = [f"# Engine loop ({result['model']}, {result['device']}, tensor_parallel_size "
             f"{result['tensor_parallel_size']}, {result['distributed_executor_backend']})", "",
             "| overlap | batch | temperature (sampler) | ITL via generate (ms) | steady decode step (ms) | "
             "graph replay back to back (ms) | single replays (ms) | ratios to back to back (generate / steady) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["itl"]:
        lines.append(f"| {r['overlap']} | {r['batch']} | {r['temperature']} ({r['sampler']}) | "
                     f"{r['itl_generate_ms']:.3f} | {r['itl_steady_ms']:.3f} | {r['graph_replay_ms']:.3f} | "
                     f"{r['graph_replay_single_ms']:.3f} | "
                     f"{r['ratio']:.3f} / {r['steady_ratio']:.3f} |")
    if result.get("bench"):
        lines += ["", "| overlap | mixed | mixed prefill budget | output tok/s | ITL p50 (ms) | ITL p99 (ms) | "
                  "p99/p50 | TTFT p50 (ms) | TTFT p99 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["bench"]:
            budget = r.get("max_mixed_prefill_tokens")
            lines.append(f"| {r['overlap']} | {r.get('mixed', True)} | {'-' if budget is None else budget} | "
                         f"{r['output_tokens_per_s']:.0f} | "
                         f"{r['itl_p50_ms']:.2f} | "
                         f"{r['itl_p99_ms']:.2f} | {r['itl_p99_ms'] / r['itl_p50_ms']:.2f} | "
                         f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} |")
    if result.get("bench_in_process"):
        lines += ["", "One engine, in process:", "", "| run | mixed prefill budget | output tok/s | ITL p50 (ms) | "
                  "ITL p99 (ms) | p99/p50 | TTFT p50 (ms) | TTFT p99 (ms) | decode / mixed step median (ms) | "
                  "mixed steps | fit: ms fixed + per row + us per prefill token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["bench_in_process"]:
            c = r["step_cost"] or {}
            lines.append(f"| {r['run']} | {r['max_mixed_prefill_tokens']} | {r['output_tokens_per_s']:.0f} | "
                         f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_p99_ms'] / r['itl_p50_ms']:.2f} | "
                         f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                         f"{c.get('decode_step_ms_median', float('nan')):.2f} / "
                         f"{c.get('mixed_step_ms_median', float('nan')):.2f} | {c.get('mixed_steps', 0)} | "
                         f"{c.get('ms_fixed', float('nan')):.2f} + {c.get('ms_per_decode_row', float('nan')):.3f} + "
                         f"{c.get('us_per_prefill_token', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def _budgets(text: str) -> list[int]:
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts, e.g. 256,1024, got {text!r}")
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive token counts, got {text!r}")
    return budgets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench-dsv32", help="preset or checkpoint (default: bench-dsv32)")
    p.add_argument("--out", default=".", help="folder for engine_loop.json / engine_loop.md")
    p.add_argument("--batches", default="1,32", help="decode batch sizes for the ITL comparison")
    p.add_argument("--context", type=int, default=1024, help="prompt length of the ITL comparison")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed per ITL measurement")
    p.add_argument("--cuda-graph-max-bs", type=int, default=32, help="largest captured batch (start-up time)")
    p.add_argument("--skip-bench", action="store_true", help="only the ITL comparison")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of the ITL comparison's requests (0 = greedy, as `minidsa bench`; the server's default is 1)")
    p.add_argument("--overlap", choices=("both", "on", "off"), default="both", help="ITL settings to measure")
    p.add_argument("--skip-itl", action="store_true", help="only `minidsa bench` (after one warm-up run): overlap "
                   "on / off x mixed steps on / off, or the --mixed-budgets sweep")
    p.add_argument("--disable-compile", action="store_true",
                   help="graphs of the plain modules (start-up in seconds instead of minutes; host time is the same)")
    p.add_argument("--bench-args", default="", help="extra `minidsa bench` arguments, e.g. '--num-requests 128'")
    p.add_argument("--mixed-budgets", type=_budgets, default=None, metavar="B1,B2,...",
                   help="part 2 as a sweep: one `minidsa bench` per --max-mixed-prefill-tokens value (overlap and "
                        "mixed steps on) instead of the overlap / mixed on-off settings, e.g. 256,512,1024,2048,8192")
    p.add_argument("--in-process", action="store_true",
                   help="part 2 on one engine in this process (one start-up, one JIT): the first run after start-up, "
                        "then the --mixed-budgets (or the default budget) warm, with a fit of the step cost")
    p.add_argument("--runs-per-budget", type=int, default=1, help="with --in-process: warm runs of each budget")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (a smoke run of this script)")
    p.add_argument("--profile", action="store_true",
                   help="profile the timed steady decode steps (torch.profiler): GPU idle time and GPU time per "
                        "step by kernel")
    p.add_argument("--mixed-step", type=int, default=0, metavar="PROMPT_LEN",
                   help="after each ITL figure: profile the steps around one request of PROMPT_LEN tokens arriving "
                        "while the batch decodes (per-step wall time, kernels, host cProfile)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="ranks (GPUs) of the engine")
    p.add_argument("--distributed-executor-backend", choices=("auto", "mp", "uni"), default="auto",
                   help="mp: the tensor-parallel path even at --tp 1")
    args = p.parse_args(argv)
    parallel = {"tensor_parallel_size": args.tensor_parallel_size,
                "distributed_executor_backend": args.distributed_executor_backend}
    bench_parallel = ["--tensor-parallel-size", str(args.tensor_parallel_size),
                      "--distributed-executor-backend", args.distributed_executor_backend]
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("needs a CUDA GPU (--allow-cpu for a smoke run)")
        return 1
    os.makedirs(args.out, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"model": args.model, "device": device, "torch": torch.__version__, "compile": not args.disable_compile,
              **parallel, "itl": [], "bench": []}
    overlaps = {"both": (True, False), "on": (True,), "off": (False,)}[args.overlap]
    for overlap in (() if args.skip_itl else overlaps):
        result["itl"] += measure_itl(args.model, overlap, batches, args.context, args.decode_tokens,
                                     args.cuda_graph_max_bs, compile=not args.disable_compile, parallel=parallel,
                                     profile=args.profile, temperature=args.temperature,
                                     mixed_step=args.mixed_step)
    if not args.skip_bench and args.in_process:
        extra = bench_parallel + args.bench_args.split() + (["--disable-compile"] if args.disable_compile else [])
        result["bench_in_process"] = bench_in_process(args.model, args.mixed_budgets, extra, args.out,
                                                      args.runs_per_budget)
    elif not args.skip_bench:
        extra = bench_parallel + args.bench_args.split() + (["--disable-compile"] if args.disable_compile else [])
        # Triton compiles a kernel for each new shape class the first time it runs, and its disk cache keeps
        # it: the first run of a workload in a fresh machine pays that (seconds of TTFT), so one run whose
        # figures are dropped comes first, and every setting is then measured on equal terms. With a budget sweep
        # it runs the largest budget (its mixed steps cover the smaller budgets' shapes); DeepGEMM and compiled
        # mixed steps JIT per shape class too (a cold compiled run of 256 requests took minutes of TTFT).
        run_bench(args.model, True, args.out, extra,
                  mixed_budget=max(args.mixed_budgets) if args.mixed_budgets else None)
        if args.mixed_budgets:
            for budget in args.mixed_budgets:
                result["bench"].append(run_bench(args.model, True, args.out, extra, mixed_budget=budget))
        else:
            for overlap, mixed in ((True, True), (False, True), (True, False), (False, False)):
                result["bench"].append(run_bench(args.model, overlap, args.out, extra, mixed))
    with open(os.path.join(args.out, "engine_loop.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = to_markdown(result)
    with open(os.path.join(args.out, "engine_loop.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
