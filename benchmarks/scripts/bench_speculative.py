"""Issue 31 on the GPU: speculative decoding (MTP chain) against plain decoding, at simulated acceptance lengths.

One process, two engines in turn (plain, then speculative), the same engine arguments otherwise:
- steady decode at each batch size: B requests with `--prompt-len` tokens are prefilled, then the steps until each
  has `--decode-tokens` more are timed: output tok/s and the inter-token latency (a request's time per token);
- the speculative engine at each `--accept-lens` L: --speculative-simulate-accept-len's simulator is set to L on
  the live engine between runs (random MTP weights accept nothing; output is then not the model's). Under tensor
  parallelism (--tp N > 1) every rank runs its own speculator and simulator, and only rank 0's is in reach here: one
  speculative engine per L instead, started with --speculative-simulate-accept-len L (every rank draws the same);
- where the time goes, per round: GPU time of each forward kind (CUDA events around the runner's forward calls:
  each captured kind, or `uncaptured`), and the host time that is left of the round's wall time;
- with --bench: `minidsa bench`'s default workload on each engine (speculative at the last L).

    python benchmarks/scripts/bench_speculative.py --out /tmp/out [--model bench-dsv32] [--steps 3] [--batches 1 8 32 64]
        [--accept-lens 1 2 3.2 4] [--bench] [engine flags, e.g. --kv-cache-dtype fp8 --disable-deep-gemm]

Writes speculative.json and speculative.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _HostEvent:
    """A CUDA event's interface on the CPU (smoke runs): the host clock."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1e3 * (end.t - self.t)


class ForwardTimer:
    """GPU time per forward kind: CUDA events around the runner's forward / forward_mtp (wrapped on this runner)."""

    def __init__(self, runner):
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False
        self.event = (lambda: torch.cuda.Event(enable_timing=True)) if runner.device.type == "cuda" else _HostEvent
        for name in ("forward", "forward_mtp"):
            self._wrap(runner, name)

    def _wrap(self, runner, name: str) -> None:
        inner = getattr(runner, name)
        def timed(batch, *args, **kwargs):
            if not self.on:
                return inner(batch, *args, **kwargs)
            kind = f"{'' if runner.has_graph(batch) else 'uncaptured '}{batch.kind.name.lower()}"
            start, end = self.event(), self.event()
            start.record()
            out = inner(batch, *args, **kwargs)
            end.record()
            self.events.append((kind, start, end))
            return out

        setattr(runner, name, timed)

    def take(self) -> dict[str, float]:
        """Milliseconds per kind since the last take (synchronises)."""
        _sync()
        totals: dict[str, float] = defaultdict(float)
        for kind, s, e in self.events:
            totals[kind] += s.elapsed_time(e)
        self.events.clear()
        return dict(totals)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(vocab, 100000) - 1, (n, length), generator=g).tolist()


def steady_decode(engine, timer: ForwardTimer, bs: int, prompt_len: int, decode_tokens: int, seed: int) -> dict:
    """Prefill `bs` requests, then time the steps until each has `decode_tokens` more tokens."""
    from minidsa import SamplingParams

    # Room beyond the timed tokens: requests that start decoding while later ones still prefill (mixed steps) are
    # ahead when the window opens, and must not finish inside it (every request is aborted at the end).
    params = SamplingParams(max_tokens=decode_tokens + 1024, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(p, params, use_prefix_cache=False)
           for p in _prompts(bs, prompt_len, engine.vocab_size, seed)]
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 2:  # every request decoding
        for o in engine.step():
            got[o.request_id] += len(o.new_token_ids)
    base = dict(got)
    timer.take()
    timer.on = True
    _sync()
    start, steps = time.perf_counter(), 0
    while min(got[i] - base[i] for i in ids) < decode_tokens and engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += len(o.new_token_ids)
        steps += 1
    _sync()
    wall = time.perf_counter() - start
    timer.on = False
    gpu = timer.take()
    tokens = sum(got[i] - base[i] for i in ids)
    for rid in ids:
        engine.abort(rid, report=False)
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
    per_request = tokens / bs
    return {"batch": bs, "tokens": tokens, "seconds": wall, "steps": steps, "tok_per_s": tokens / wall,
            "itl_ms": 1e3 * wall / per_request, "step_ms": 1e3 * wall / steps,
            "gpu_ms_per_step": {k: v / steps for k, v in sorted(gpu.items())},
            "host_ms_per_step": 1e3 * wall / steps - sum(gpu.values()) / steps}


def greedy_outputs(engine, n: int, tokens: int, together: bool = True) -> list[list[int]]:
    """Greedy continuations of `n` fixed prompts (the model's own acceptance: no simulation), in one batch or one
    request at a time (`together=False`: other batch shapes, so other reduction orders in the kernels)."""
    from minidsa import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False)
    prompts = _prompts(n, 256, engine.vocab_size, 7)
    done: dict[str, list[int]] = {}
    ids: list[str] = []
    for group in ([prompts] if together else [[p] for p in prompts]):
        ids += [engine.add_request(p, params, use_prefix_cache=False) for p in group]
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
    return [done[i] for i in ids]


def agreement(plain: list[list[int]], spec: list[list[int]]) -> dict:
    """How often bf16 speculation gives plain decoding's greedy tokens: identical outputs, and where they part."""
    first = [next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), len(p)) for p, q in zip(plain, spec)]
    n = len(plain[0]) if plain else 0
    return {"requests": len(plain), "tokens": n, "identical": sum(f == n for f in first),
            "mean_first_difference": sum(first) / max(1, len(first)),
            "token_agreement": sum(a == b for p, q in zip(plain, spec) for a, b in zip(p, q)) / max(1, n * len(plain))}


def run_engine(args, extra: dict, label: str, accept_lens: list[float | None], agreement: bool | None = None,
               live_simulator: bool = True, bench: bool | None = None) -> dict:
    """One engine: greedy agreement outputs (`agreement`, default --agreement), steady decode at each L of
    `accept_lens` (the live simulator set to L on rank 0's speculator when `live_simulator`), `minidsa bench`
    (`bench`, default --bench)."""
    from minidsa.bench.offline import run_bench
    from minidsa.cli import engine_config_from_args
    from minidsa.engine.core import Engine
    from minidsa.speculative.mtp import AcceptanceSimulator

    import dataclasses

    config = dataclasses.replace(engine_config_from_args(args), **extra)
    t0 = time.perf_counter()
    engine = Engine(config, progress=False)
    startup = time.perf_counter() - t0
    timer = ForwardTimer(engine.runner)
    out: dict = {"label": label, "startup_s": startup, "runs": []}
    agreement = args.agreement if agreement is None else agreement
    bench = args.bench if bench is None else bench
    if agreement:
        if engine.speculator is not None:
            engine.speculator.simulator = None  # the model's own acceptance
        out["greedy"] = greedy_outputs(engine, args.agreement, 64)
        out["greedy_alone"] = greedy_outputs(engine, args.agreement, 64, together=False)
    if args.agreement_only:
        accept_lens = []
    elif accept_lens:
        steady_decode(engine, timer, 2, 64, 8, seed=99)  # warm-up: first-call costs out of the numbers
    for L in accept_lens:
        if L is not None and live_simulator:
            engine.speculator.simulator = AcceptanceSimulator(L, engine.speculator.opts.num_steps, 0)
        for bs in args.batches:
            r = steady_decode(engine, timer, bs, args.prompt_len, args.decode_tokens, seed=bs)
            r["accept_len"] = L
            if engine.speculator is not None:
                st = engine.metrics()
                r["tokens_per_round_total"] = ((st.spec_accepted_tokens_total + st.spec_verify_steps_total)
                                               / max(1, st.spec_verify_steps_total))
            out["runs"].append(r)
            print(f"{label} L={L} bs={bs}: {r['tok_per_s']:.0f} tok/s, ITL {r['itl_ms']:.2f} ms, step "
                  f"{r['step_ms']:.2f} ms, GPU {r['gpu_ms_per_step']}, host {r['host_ms_per_step']:.2f} ms",
                  flush=True)
    if bench:
        res = run_bench(engine, progress=False)["results"]
        out["bench"] = {k: res[k] for k in ("output_tokens_per_s", "ttft_s", "itl_s", "duration_s", "speculative")}
        print(f"{label} minidsa bench: {res['output_tokens_per_s']:.0f} output tok/s, ITL p50 "
              f"{res['itl_s']['p50'] * 1e3:.2f} ms p99 {res['itl_s']['p99'] * 1e3:.2f} ms", flush=True)
    engine.close()
    del engine, timer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def table(plain: dict, spec: dict) -> list[str]:
    base = {r["batch"]: r for r in plain["runs"]}
    lines = ["| accept len L | batch | plain tok/s | MTP tok/s | ratio | plain ITL ms | MTP ITL ms | MTP round ms: "
             "GPU per kind, host |", "|---|---|---|---|---|---|---|---|"]
    for r in spec["runs"]:
        p = base[r["batch"]]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["gpu_ms_per_step"].items())
        lines.append(f"| {r['accept_len']} | {r['batch']} | {p['tok_per_s']:.0f} | {r['tok_per_s']:.0f} | "
                     f"{r['tok_per_s'] / p['tok_per_s']:.2f} | {p['itl_ms']:.2f} | {r['itl_ms']:.2f} | "
                     f"{r['step_ms']:.2f}: {kinds}; host {r['host_ms_per_step']:.2f} |")
    lines += ["", "Plain decode step: " + "; ".join(
        f"batch {p['batch']}: {p['step_ms']:.2f} ms (GPU " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                      p["gpu_ms_per_step"].items())
        + f"; host {p['host_ms_per_step']:.2f})" for p in plain["runs"])]
    if "bench" in plain and "bench" in spec:
        lines += ["", "| `minidsa bench` default workload | output tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 s |",
                  "|---|---|---|---|---|"]
        for e in (plain, spec):
            b = e["bench"]
            lines.append(f"| {e['label']} | {b['output_tokens_per_s']:.0f} | {b['itl_s']['p50'] * 1e3:.2f} | "
                         f"{b['itl_s']['p99'] * 1e3:.2f} | {b['ttft_s']['p50']:.2f} |")
    return lines


FLOOR = "plain batched vs plain one at a time (the floor)"


def agreement_lines(n: int, rows: dict[str, dict]) -> list[str]:
    lines = ["", f"Greedy agreement ({n} prompts x 64 tokens, the model's own acceptance):", "",
             "| compared | identical | tokens agreeing | mean first difference at token |", "|---|---|---|---|"]
    for k, a in rows.items():
        lines.append(f"| {k} | {a['identical']} / {a['requests']} | {a['token_agreement']:.1%} | "
                     f"{a['mean_first_difference']:.1f} |")
    return lines


def _write(out: str, result: dict, lines: list[str]) -> None:
    with open(os.path.join(out, "speculative.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, "speculative.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def spec_engines_per_accept_len(args, label: str) -> dict:
    """--tp N > 1: each rank's speculator draws its own simulated acceptance, so L must be the same on every rank from
    the start: one engine per L (--speculative-simulate-accept-len L), and for --agreement one more without the
    simulator (the model's own acceptance). Merged into one result like run_engine's."""
    steps = {"speculative_num_steps": args.steps}
    spec: dict = {"label": label, "startup_s": None, "startups_s": {}, "runs": [], "engine_per_accept_len": True}
    if args.agreement:
        a = run_engine(args, {**steps, "speculative_simulate_accept_len": 0.0}, label, [], agreement=True, bench=False)
        spec["greedy"], spec["greedy_alone"] = a["greedy"], a["greedy_alone"]
        spec["startups_s"]["agreement"] = spec["startup_s"] = a["startup_s"]
    if not args.agreement_only:
        for i, L in enumerate(args.accept_lens):
            e = run_engine(args, {**steps, "speculative_simulate_accept_len": L}, label, [L], agreement=False,
                           live_simulator=False, bench=args.bench and i == len(args.accept_lens) - 1)
            spec["runs"] += e["runs"]
            spec["startups_s"][str(L)] = e["startup_s"]
            spec["startup_s"] = spec["startup_s"] or e["startup_s"]
            if "bench" in e:
                spec["bench"] = e["bench"]
    return spec


def main() -> int:
    from minidsa.cli import add_engine_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3, help="MTP draft steps (a chain: steps + 1 tokens verified)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--accept-lens", type=float, nargs="+", default=[1.0, 2.0, 3.2, 4.0])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--bench", action="store_true", help="also minidsa bench's default workload on both engines")
    p.add_argument("--allow-cpu", action="store_true", help="a smoke run without a GPU (the figures mean nothing)")
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="also N greedy prompts x 64 tokens on both engines with the model's own acceptance: how "
                        "often speculation gives plain decoding's tokens in this dtype; and, as the floor, how often "
                        "plain decoding agrees with itself run one request at a time")
    p.add_argument("--agreement-only", action="store_true", help="with --agreement: no timed runs")
    add_engine_args(p)
    p.set_defaults(model="bench-dsv32")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu for a smoke run)", file=sys.stderr)
        return 2
    plain = run_engine(args, {}, "plain", [None])
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("MINIDSA_COMMIT"), "args": sys.argv[1:],
              "plain": plain}
    if args.agreement:  # written now: a run cut short during the second engine's start-up keeps the floor
        result["agreement"] = {FLOOR: agreement(plain["greedy"], plain["greedy_alone"])}
        _write(args.out, result, agreement_lines(args.agreement, result["agreement"]))
    label = f"MTP {args.steps}/1/{args.steps + 1}"
    if args.tensor_parallel_size > 1:
        spec = spec_engines_per_accept_len(args, label)
    else:
        spec = run_engine(args, {"speculative_num_steps": args.steps,
                                 "speculative_simulate_accept_len": args.accept_lens[0]}, label, args.accept_lens)
    result["speculative"] = spec
    lines = table(plain, spec)
    if args.agreement:
        result["agreement"] = {
            "MTP vs plain, batched": agreement(plain["greedy"], spec["greedy"]),
            "MTP vs plain, one request at a time": agreement(plain["greedy_alone"], spec["greedy_alone"]),
            FLOOR: result["agreement"][FLOOR]}
        lines += agreement_lines(args.agreement, result["agreement"])
    _write(args.out, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
