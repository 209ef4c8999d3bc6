"""Issue 48: where a decode step's time goes under tensor parallelism, kernel by kernel and collective by collective.

The decode suite (`minidsa bench-decode --profile`) drives one runner in one process; under TP the step has to be
measured through the engine. This script builds an `Engine` from engine flags (e.g. `--model bench-dsv32:16 --tp 4
--kv-cache-dtype fp8`), and for each batch B of `--batches`:

1. puts B requests of `--prompt-len` random tokens into steady decode (every one decoding);
2. times `--steps` engine steps unprofiled: step wall ms, ITL, tok/s, and the GPU time of each forward kind (CUDA
   events around rank 0's runner forwards, as benchmarks/scripts/bench_speculative.py does);
3. profiles `--steps` more steps with `torch.profiler` on rank 0 (CUDA activities: the kernels, NCCL's and those
   inside CUDA-graph replays included) and groups the kernels into categories (GEMM, FP8 GEMM, MoE, attention,
   indexer, collectives, norms / rope / quant, sampling, memcpy, other): count and us per step, share of the kernel
   time; the top-20 kernels; kernel time (sum), busy time (the union of the kernels' intervals) and the gap (the
   profiled step's wall time minus busy time: the device idle, waiting for the host or for other ranks).

Rank 0's view is the default (its kernels include every collective: a collective's time there includes the wait for
the slowest rank). `--all-ranks` profiles every rank: the script starts itself once per rank as a torchrun-style
launch (RANK / WORLD_SIZE set: every rank builds its Engine, ranks > 0 `follow()` rank 0's plans), rank 0 sends a
start / stop marker between plans over the engine's plan channel, and each rank > 0 writes its own tables; no engine
module changes (not run on GPUs yet; the default spawn launch is what `minidsa serve` uses).

On CPU (`--allow-cpu`, a smoke run over gloo: `--model tiny --device cpu --dtype float32 --tp 2`) the rows are the
CPU ops of the engine's thread by self time (no kernels): the figures mean nothing, the shape of the output is
what is checked (tests/test_profile_tp.py).

    PYTHONPATH=. python3 benchmarks/scripts/profile_tp.py --out /tmp/prof --batches 1 16 \\
        --model bench-dsv32:16 --tp 4 --kv-cache-dtype fp8

Writes profile_tp.json and profile_tp.md under --out (with device, date, commit from MINIDSA_COMMIT, command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculative import ForwardTimer, _prompts, _sync  # noqa: E402

# Category -> name patterns (lower-cased kernel / op names; first match wins, so the order matters: MoE's and the
# indexer's own kernels before the generic GEMM / quant patterns, collectives first of all).
CATEGORIES: list[tuple[str, str]] = [
    ("collectives", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|c10d|gloo|wait_tensor"
                    r"|minidsa::all_reduce"),
    ("MoE", r"_expert_gemm|_silu_mul_kernel|_combine_rows|_align_kernel|_quant_scatter|^_count_kernel|^_offsets_kernel"
            r"|^_place_kernel|_route_kernel|m_grouped|grouped_gemm|moe|router"),
    ("indexer", r"_paged_logits|_ragged_logits|_mask_logits|_mask_invisible|_quant_index_q|_norm_rope_store_index_k"
                r"|topk|top_k|_split_hist|_split_count|_split_write|mqa_logits|clean_logits|indexer"),
    ("attention", r"_sparse_mla|sparse_mla|_combine_kernel|flash|fmla|mla|_head_matmul|_absorb_by|attn|attention"
                  r"|get_mla_metadata"),
    ("sampling", r"_race_kernel|_token_mask|sampl|argmax|multinomial|exponential|gumbel|penalt|softmax|log_softmax"),
    ("FP8 GEMM", r"_w8a8_gemm|fp8_gemm|e4m3|fp8|scaled_mm|deep_gemm|sm90_fp8"),
    ("GEMM", r"nvjet|gemm|gemv|sgemm|cublas|cutlass|splitkreduce|dot_kernel|xmma|aten::(mm|addmm|bmm|matmul|linear"
             r"|baddbmm|einsum)$"),
    ("norms / rope / quant", r"norm|rope|rotary|quant|swiglu|silu|act_"),
    ("memcpy", r"memcpy|memset|copy|fillfunctor|aten::(copy_|clone|to|_to_copy|fill_|zero_|cat|index_put_|scatter_)$"),
]
CATEGORY_NAMES = [c for c, _ in CATEGORIES] + ["other"]
_COMPILED = [(c, re.compile(p)) for c, p in CATEGORIES]


def category(name: str) -> str:
    low = name.lower()
    for cat, rx in _COMPILED:
        if rx.search(low):
            return cat
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarise(events, steps: int, wall_ms: float, on_cuda: bool, thread: int | None = None) -> dict:
    """Per-step tables from a profile's events: kernels (CUDA) or the ops of one thread by self time (CPU)."""
    rows: dict[str, list[float]] = {}
    intervals: list[tuple[float, float]] = []
    if on_cuda:
        for ev in events:
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.time_range.elapsed_us()  # a kernel's (or memcpy's) own interval on the device
            r = rows.setdefault(ev.name, [0, 0.0])
            r[0] += 1
            r[1] += us
            intervals.append((ev.time_range.start, ev.time_range.start + us))
    else:
        cpu = [ev for ev in events if ev.device_type == torch.autograd.DeviceType.CPU]
        if thread is None or not any(ev.thread == thread for ev in cpu):  # the busiest thread
            busy: dict[int, float] = {}
            for ev in cpu:
                busy[ev.thread] = busy.get(ev.thread, 0.0) + ev.self_cpu_time_total
            thread = max(busy, key=busy.get) if busy else None
        for ev in cpu:
            if ev.thread != thread:
                continue
            r = rows.setdefault(ev.name, [0, 0.0])
            r[0] += 1
            r[1] += ev.self_cpu_time_total
            intervals.append((ev.time_range.start, ev.time_range.end))
    kernel_us = sum(r[1] for r in rows.values()) / steps
    busy_us = _union_us(intervals) / steps
    step_us = 1e3 * wall_ms
    cats = {c: {"count_per_step": 0.0, "us_per_step": 0.0, "share": 0.0, "kernels": 0} for c in CATEGORY_NAMES}
    for name, (n, us) in rows.items():
        c = cats[category(name)]
        c["count_per_step"] += n / steps
        c["us_per_step"] += us / steps
        c["kernels"] += 1
    for c in cats.values():
        c["share"] = c["us_per_step"] / kernel_us if kernel_us else 0.0
        c["share_of_step"] = c["us_per_step"] / step_us if step_us else 0.0
    top = sorted(rows.items(), key=lambda kv: -kv[1][1])
    return {
        "what": "CUDA kernels" if on_cuda else "CPU ops of the engine's thread, self time",
        "steps": steps, "step_ms": wall_ms, "kernel_ms": kernel_us / 1e3, "busy_ms": busy_us / 1e3,
        "kernels_per_step": sum(r[0] for r in rows.values()) / steps,
        "gap_ms": (step_us - busy_us) / 1e3, "gap_vs_kernel_sum_ms": (step_us - kernel_us) / 1e3,
        "categories": cats,
        "top": [{"name": n[:160], "category": category(n), "per_step": c / steps, "us_per_step": t / steps,
                 "share": (t / steps) / kernel_us if kernel_us else 0.0,
                 "share_of_step": (t / steps) / step_us if step_us else 0.0} for n, (c, t) in top[:20]],
        "all": [{"name": n[:160], "category": category(n), "per_step": c / steps, "us_per_step": t / steps}
                for n, (c, t) in top],
    }


class _Profile:
    """torch.profiler around a window of steps: CUDA activities on a GPU, CPU ops on the CPU."""

    def __init__(self, on_cuda: bool):
        from torch.profiler import ProfilerActivity, profile

        self.on_cuda = on_cuda
        self.prof = profile(activities=[ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU])

    def start(self) -> None:
        _sync()
        self.prof.start()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Wall seconds of the window (synchronised)."""
        _sync()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        return wall

    def summarise(self, steps: int, wall_s: float) -> dict:
        return summarise(self.prof.events(), steps, 1e3 * wall_s / steps, self.on_cuda, threading.get_native_id())


def _step_until(engine, got: dict, done) -> int:
    steps = 0
    while not done() and engine.has_unfinished():
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id] += len(o.new_token_ids)
        steps += 1
    return steps


def profile_batch(engine, timer: ForwardTimer, bs: int, args, on_cuda: bool, send=None) -> dict:
    """`send`: --all-ranks, rank 0's plan channel: ranks > 0 start / stop their profiles on its markers, which go
    between two plans (in order with them)."""
    from minidsa import SamplingParams

    # Room for the warm-up, both windows and speculation's extra tokens per step; never finishing inside a window.
    want = 2 * args.steps * (args.speculative_num_steps + 1) + 64
    max_tokens = max(8, min(want + 1024, engine.max_model_len - args.prompt_len - 1))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(p, params, use_prefix_cache=False)
           for p in _prompts(bs, args.prompt_len, engine.vocab_size, seed=bs)]
    got = dict.fromkeys(ids, 0)
    _step_until(engine, got, lambda: min(got.values()) >= 2)  # every request decoding
    count = [0]

    def window() -> bool:
        count[0] += 1
        return count[0] > args.steps

    # Unprofiled: wall per step, tokens, forward GPU time per kind.
    base = sum(got.values())
    timer.take()
    timer.on = True
    _sync()
    t0 = time.perf_counter()
    steps = _step_until(engine, got, window)
    _sync()
    wall = time.perf_counter() - t0
    timer.on = False
    gpu = timer.take()
    tokens = sum(got.values()) - base
    out = {"batch": bs, "steps": steps, "step_ms": 1e3 * wall / steps, "tok_per_s": tokens / wall,
           "itl_ms": 1e3 * wall / (tokens / bs) if tokens else None,
           "forward_gpu_ms_per_step": {k: v / steps for k, v in sorted(gpu.items())},
           "host_ms_per_step": 1e3 * wall / steps - sum(gpu.values()) / steps}
    # Profiled: the same number of steps again.
    count[0] = 0
    prof = _Profile(on_cuda)
    if send is not None:
        send({"profile_tp": "start", "batch": bs})
    prof.start()
    psteps = _step_until(engine, got, window)
    wall_s = prof.stop()
    if send is not None:
        send({"profile_tp": "stop", "batch": bs, "steps": psteps})
    out["profile"] = prof.summarise(psteps, wall_s)
    for rid in ids:
        engine.abort(rid, report=False)
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
    return out


def _follow_with_profiles(engine, on_cuda: bool) -> dict:
    """A rank > 0 under --all-ranks: follow rank 0's plans, profiling between its start and stop markers."""
    worker = engine.worker
    inner = worker.launch
    state: dict = {"prof": None, "plans": 0, "batches": {}}

    def launch(plan):
        if isinstance(plan, dict) and "profile_tp" in plan:
            if plan["profile_tp"] == "start":
                state["prof"], state["plans"] = _Profile(on_cuda), 0
                state["prof"].start()
            else:
                prof, state["prof"] = state["prof"], None
                wall = prof.stop()
                steps = plan.get("steps") or max(1, state["plans"])
                r = prof.summarise(steps, wall)
                r["plans_in_window"] = state["plans"]
                state["batches"][str(plan["batch"])] = r
            return None
        state["plans"] += 1
        return inner(plan)

    worker.launch = launch  # FollowerWorker.follow hands self.launch to serve_plans
    engine.follow()
    return state["batches"]


def _device_name(on_cuda: bool) -> str:
    if not on_cuda:
        return "cpu"
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name()}" if n > 1 else torch.cuda.get_device_name()


def run(args) -> dict:
    from minidsa.cli import engine_config_from_args
    from minidsa.engine.core import Engine

    config = engine_config_from_args(args)
    t0 = time.perf_counter()
    engine = Engine(config, progress=False)
    startup = time.perf_counter() - t0
    on_cuda = engine.worker.runner.device.type == "cuda"
    rank = int(os.environ.get("RANK", "0")) if args.all_ranks else 0
    if not engine.is_driver:
        batches = _follow_with_profiles(engine, on_cuda)
        path = os.path.join(args.out, f"profile_tp_rank{rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": rank, "batches": batches}, f, indent=2)
        return {}
    send = engine.worker.channel.send if args.all_ranks and config.tensor_parallel_size > 1 else None
    m = engine.metrics()
    result = {"device": _device_name(on_cuda), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "commit": os.environ.get("MINIDSA_COMMIT"), "command": "python3 benchmarks/scripts/profile_tp.py "
              + " ".join(sys.argv[1:]), "tp": config.tensor_parallel_size, "model": engine.model_name,
              "preset": args.model,
              "profiled": "CUDA kernels (rank 0)" if on_cuda else "CPU ops (rank 0's engine thread)",
              "startup_s": startup, "kv_total_tokens": m.kv_total_tokens, "kernels": None, "batches": []}
    with_describe = getattr(engine.worker.runner, "kernels", None)
    if with_describe is not None and hasattr(with_describe, "describe"):
        result["kernels"] = with_describe.describe()
    timer = ForwardTimer(engine.worker.runner)
    try:
        _warm(engine, timer, args)
        for bs in args.batches:
            r = profile_batch(engine, timer, bs, args, on_cuda, send)
            p = r["profile"]
            print(f"batch {bs}: step {r['step_ms']:.3f} ms (profiled {p['step_ms']:.3f}), kernels "
                  f"{p['kernel_ms']:.3f} ms, busy {p['busy_ms']:.3f} ms, gap {p['gap_ms']:.3f} ms, "
                  f"{p['kernels_per_step']:.0f} per step", flush=True)
            result["batches"].append(r)
    finally:
        engine.close()
    return result


def _warm(engine, timer: ForwardTimer, args) -> None:
    """First-call costs out of the numbers: two short requests decoded for a few steps."""
    from minidsa import SamplingParams

    n = max(8, min(64, engine.max_model_len // 4))
    params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    for p in _prompts(2, n, engine.vocab_size, seed=99):
        engine.add_request(p, params, use_prefix_cache=False)
    while engine.has_unfinished():
        engine.step()
    timer.take()


def _cell(c: dict) -> str:
    return (f"{c['count_per_step']:.1f} | {c['us_per_step']:.1f} | {100 * c['share']:.1f}% | "
            f"{100 * c['share_of_step']:.1f}%")


def to_markdown(r: dict) -> str:
    lines = [f"# Decode step under tensor parallelism: {r['model']}, TP={r['tp']}", "",
             f"{r['device']}, {r['date']}, commit {r.get('commit') or '?'}; profiled: {r['profiled']}. Start-up "
             f"{r['startup_s']:.1f} s, KV capacity {r['kv_total_tokens']} tokens.", "", f"`{r['command']}`", ""]
    if r.get("kernels"):
        lines += [f"Kernels: {r['kernels']}", ""]
    lines += ["| batch | step ms | ITL ms | tok/s | forward GPU ms per step | host ms | profiled step ms | kernel ms "
              "| busy ms | gap ms | kernels per step |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b in r["batches"]:
        p = b["profile"]
        fwd = ", ".join(f"{k} {v:.3f}" for k, v in b["forward_gpu_ms_per_step"].items())
        itl = f"{b['itl_ms']:.3f}" if b.get("itl_ms") is not None else "-"
        lines.append(f"| {b['batch']} | {b['step_ms']:.3f} | {itl} | {b['tok_per_s']:.0f} | {fwd} | "
                     f"{b['host_ms_per_step']:.3f} | {p['step_ms']:.3f} | {p['kernel_ms']:.3f} | {p['busy_ms']:.3f} | "
                     f"{p['gap_ms']:.3f} | {p['kernels_per_step']:.0f} |")
    lines += ["", "Busy = the union of the kernels' intervals; gap = profiled step minus busy (the device idle). "
              "Profiling costs time: the unprofiled step is the figure to quote."]
    for b in r["batches"]:
        lines += category_table(b["profile"], f"Batch {b['batch']}, rank 0")
        for rank, per in sorted((r.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
            if str(b["batch"]) in per:
                lines += category_table(per[str(b["batch"])], f"Batch {b['batch']}, rank {rank}", top=False)
    return "\n".join(lines) + "\n"


def category_table(p: dict, title: str, top: bool = True) -> list[str]:
    lines = ["", f"## {title}: {p['kernel_ms']:.3f} ms of {p['what']} per step, busy {p['busy_ms']:.3f} ms, "
             f"step {p['step_ms']:.3f} ms, gap {p['gap_ms']:.3f} ms", "",
             "| category | per step | us per step | % of kernel time | % of step |", "|---|---:|---:|---:|---:|"]
    for name in CATEGORY_NAMES:
        c = p["categories"][name]
        if c["count_per_step"]:
            lines.append(f"| {name} | {_cell(c)} |")
    step_us = 1e3 * p["step_ms"]
    lines.append(f"| gap (step - busy: device idle) | | {1e3 * p['gap_ms']:.1f} | | "
                 f"{100 * p['gap_ms'] * 1e3 / step_us if step_us else 0:.1f}% |")
    if top:
        lines += ["", "| top kernels | category | per step | us per step | % of kernel time | % of step |",
                  "|---|---|---:|---:|---:|---:|"]
        lines += [f"| `{k['name'][:100]}` | {k['category']} | {k['per_step']:.1f} | {k['us_per_step']:.1f} | "
                  f"{100 * k['share']:.1f}% | {100 * k['share_of_step']:.1f}% |" for k in p["top"]]
    return lines


def write(out: str, result: dict) -> None:
    with open(os.path.join(out, "profile_tp.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, "profile_tp.md"), "w") as f:
        f.write(to_markdown(result))


def launch_all_ranks(argv: list[str], world: int, out: str) -> int:
    """--all-ranks: this script once per rank (RANK / WORLD_SIZE: the engine's torchrun launch), then the merge."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"profile_tp: ranks exited with {codes}", file=sys.stderr)
        return 1
    with open(os.path.join(out, "profile_tp.json")) as f:
        result = json.load(f)
    result["ranks"] = {}
    for rank in range(1, world):
        path = os.path.join(out, f"profile_tp_rank{rank}.json")
        with open(path) as f:
            result["ranks"][str(rank)] = json.load(f)["batches"]
        os.remove(path)
    write(out, result)
    print(f"profile_tp: {world} ranks merged into {out}/profile_tp.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    from minidsa.cli import add_engine_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=20, help="steps timed unprofiled, then as many profiled")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--all-ranks", action="store_true",
                   help="profile every rank (the script starts one process per rank; ranks > 0 follow rank 0)")
    p.add_argument("--allow-cpu", action="store_true", help="a smoke run without a GPU (the figures mean nothing)")
    add_engine_args(p)
    p.set_defaults(model="bench-dsv32")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.all_ranks and args.tensor_parallel_size > 1 and "RANK" not in os.environ:
        return launch_all_ranks(argv, args.tensor_parallel_size, args.out)
    result = run(args)
    if result:
        write(args.out, result)
        print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
