"""Issues 48 / 49 on one GPU: what one rank of a 4-GPU group computes in a decode step, without its peers.

A multi-GPU decode step is a rank's own kernels plus its collectives (and the waits for the slowest rank). This
script measures the first part on one GPU, so that what the kernels alone allow is known before any multi-GPU run:
it builds one rank's share of the model (`decode_suite.Bench(rank=...)`: the layers sharded exactly as rank 0 of
`--size` ranks builds them, its kernels chosen for its shapes) in this one process, with no process group:

- `one`: the whole model on one GPU (the baseline);
- `tp`: `--tp N`: 128 / N heads, each expert's and each dense MLP's intermediate split N ways, lm_head by vocabulary;
  the indexer, its top-k and the latent cache whole. Its all-reduces are skipped (no group: `TensorParallel`
  returns its input).
- `ep`: `--tp N --enable-expert-parallel`: as `tp`, but 256 / N whole experts per rank.
- `dp`: `--tp N --enable-dp-attention`: attention, indexer, dense layers, shared experts and lm_head whole over the
  rank's own B requests; its 256 / N experts over the N x B rows of every rank. The all-gather is stood in for by
  this rank's rows followed by N - 1 blocks of fresh random rows (other ranks' tokens choose other experts), the
  reduce-scatter by this rank's block (`RankAlone`).

For each, decode steps of B requests (per rank) at one context replay from CUDA graphs of the compiled model, FP8 KV
cache, DeepGEMM and FlashMLA where built; at two depths (`--depths 4 8`: 1 and 5 MoE layers), so that the
difference is the cost of MoE layers alone (embedding, the 3 dense layers and lm_head cancel out), and with
`--profile` the kernels of each depth by category (benchmarks/scripts/profile_tp.py's categories), their difference
per MoE layer.

What it does not measure: any collective, the wait for other ranks, or the host's plan / result traffic. A rank's
step on N GPUs takes at least this long; the issues' targets are ratios of the real step, which needs the N GPUs.

    PYTHONPATH=. python3 benchmarks/scripts/bench_rank_shapes.py --out /tmp/rank --size 4 --batches 1 16 64

Writes rank_shapes.json and rank_shapes.md under --out (device, date, MINIDSA_COMMIT, command), the JSON after each
build, so a call cut by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_tp import CATEGORY_NAMES, category, summarise  # noqa: E402

from minidsa.common.tensor_parallel import TensorParallel  # noqa: E402

MODES = ("one", "tp", "ep", "dp")
TOP_KERNELS = 14  # kernels listed per (mode, batch) on the page


@dataclasses.dataclass(frozen=True)
class RankAlone(TensorParallel):
    """Rank 0 of `size` ranks with no peers and no process group. All-reduces are skipped (`collectives` is False:
    the base class returns the input). Under DP attention the rows exchange is stood in for locally: the "gathered"
    rows are this rank's followed by `size - 1` blocks of fresh N(0, 1) rows, the scale of a normed hidden state, so
    that the experts see as many rows, choosing as many different experts, as a real rank does; the "reduce-scatter"
    keeps this rank's block."""

    def start_all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] + [torch.randn_like(x) for _ in range(self.size - 1)])

    def start_reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[: x.shape[0] // self.size].clone()

    @staticmethod
    def wait(started: torch.Tensor) -> torch.Tensor:
        return started


def rank_of(mode: str, size: int) -> TensorParallel | None:
    """The TensorParallel rank 0 of `size` ranks is built with in `mode` (None: one GPU, no parallelism)."""
    if mode == "one":
        return None
    return RankAlone(rank=0, size=size, expert_parallel=mode in ("ep", "dp"), dp_attention=mode == "dp")


def kernel_profile(replay, iters: int) -> dict:
    """us per replay by category (CUDA kernels, inside the graph replays: profile_tp's `summarise`), the kernel count,
    and each kernel name's us per replay (under "by_name")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    summary = summarise(prof.events(), iters, 0.0, on_cuda=True)
    out: dict = {c: v["us_per_step"] for c, v in summary["categories"].items()}
    out["kernels"] = summary["kernels_per_step"]
    out["by_name"] = {}
    for k in summary["all"]:  # names cut to 160 characters: ones that agree that far are summed
        out["by_name"][k["name"]] = out["by_name"].get(k["name"], 0.0) + k["us_per_step"]
    return out


def measure(mode: str, depth: int, args) -> dict:
    """One build (mode, depth): the graph decode step at each batch, its kernels by category with --profile."""
    from minidsa.bench import decode_suite as perf
    from minidsa.common.plan import StepKind

    t0 = time.perf_counter()
    batches = sorted(set(args.batches))
    bench = perf.Bench(f"{args.preset}:{depth}", max_context=args.context, max_batch_tokens=args.kv_tokens,
                       max_bs=max(batches + [8]), kv_cache_dtype=args.kv_cache_dtype,
                       rank=rank_of(mode, args.size))
    build_s = time.perf_counter() - t0
    out = {"mode": mode, "depth": depth, "build_s": build_s, "kernels_chosen": bench.runner.kernels.describe(),
           "rows": []}
    graphs = bench.graphs([perf.graph_shape(StepKind.DECODE)], batches, max_kv_len=args.context + 64)
    for bs in batches:
        rows, pages = bench.contexts(bs, args.context)
        batch = bench.decode_batch(rows, args.context)
        step_s = perf.time_cuda(lambda: graphs.replay(batch), iters=args.iters)
        row = {"bs": bs, "step_ms": step_s * 1e3}
        if args.profile:
            row["profile_us"] = kernel_profile(lambda: graphs.replay(batch), args.profile)
        out["rows"].append(row)
        bench.release(rows, pages)
    out["total_s"] = time.perf_counter() - t0
    graphs = bench = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def per_layer(builds: list[dict], depths: tuple[int, int]) -> dict:
    """mode -> bs -> the MoE layer's ms (the depths' step difference over their layer difference), the step at the
    deeper depth, and with profiles each category's us per MoE layer."""
    lo, hi = depths
    by = {(b["mode"], b["depth"]): {r["bs"]: r for r in b["rows"]} for b in builds}
    out: dict = {}
    for mode in dict.fromkeys(b["mode"] for b in builds):
        if (mode, lo) not in by or (mode, hi) not in by:
            continue
        rows_lo, rows_hi = by[mode, lo], by[mode, hi]
        out[mode] = {}
        for bs in sorted(set(rows_lo) & set(rows_hi)):
            a, b = rows_lo[bs], rows_hi[bs]
            entry = {"layer_ms": (b["step_ms"] - a["step_ms"]) / (hi - lo), "step_ms": b["step_ms"]}
            if "profile_us" in a and "profile_us" in b:
                pa, pb = a["profile_us"], b["profile_us"]
                entry["layer_us"] = {c: (pb[c] - pa[c]) / (hi - lo) for c in pb if c != "by_name"}
                if "by_name" in pb:
                    names_a, names_b = pa.get("by_name", {}), pb["by_name"]
                    entry["layer_kernels_us"] = {n: (names_b.get(n, 0.0) - names_a.get(n, 0.0)) / (hi - lo)
                                                 for n in set(names_a) | set(names_b)}
            out[mode][bs] = entry
    return out


def to_markdown(result: dict) -> str:
    size, depths = result["size"], result["depths"]
    layers = per_layer(result["builds"], tuple(depths))
    one = layers.get("one", {})
    lines = [f"# One rank of {size}, alone on one GPU: decode step at {result['preset']}:{depths[0]} and :{depths[1]}",
             "", f"{result['device']}, {result['date']}, commit {result['commit']}, context {result['context']}, "
             f"KV cache {result['kv_cache_dtype']}; `{result['command']}`", "",
             "Per MoE layer = (step at the deeper depth - step at the shallower) / the layers between them. No "
             "collective runs (see the script's docstring): a rank's real step takes at least this long.", "",
             "| mode | batch per rank | step ms (deeper) | ms per MoE layer | layer / one GPU's "
             "| tok/s per layer-equivalent / one GPU's (same total batch) |", "|---|---:|---:|---:|---:|---:|"]
    for mode, rows in layers.items():
        for bs, e in rows.items():
            base = one.get(bs)
            ratio = f"{e['layer_ms'] / base['layer_ms']:.2f}x" if base and mode != "one" else ""
            # tok/s per layer-equivalent: the group serves size x bs requests under dp, bs under tp / ep
            total = bs * (size if mode == "dp" else 1)
            per_tok = ""
            if mode != "one" and total in one:
                per_tok = f"{(total / e['layer_ms']) / (total / one[total]['layer_ms']):.2f}x"
            lines.append(f"| {mode} | {bs} | {e['step_ms']:.3f} | {e['layer_ms']:.4f} | {ratio} | {per_tok} |")
    prof = {(m, bs): e["layer_us"] for m, rows in layers.items() for bs, e in rows.items() if "layer_us" in e}
    if prof:
        keys = list(prof)
        lines += ["", "Kernels per MoE layer by category, us (profiled replays; the depths' difference):", "",
                  "| category | " + " | ".join(f"{m} b{bs}" for m, bs in keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for c in CATEGORY_NAMES + ["kernels"]:
            vals = [prof[k].get(c, 0.0) for k in keys]
            if any(abs(v) >= 0.5 for v in vals):
                lines.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    for mode, bs in prof:
        e = layers[mode][bs]
        kernels = e.get("layer_kernels_us")
        if kernels and (mode, bs) in (("one", 1), ("tp", 1), ("one", 16), ("tp", 16)):
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
            lines += ["", f"{mode}, batch {bs}: the kernels of one MoE layer, us (largest {len(top)})", "",
                      "| kernel | category | us |", "|---|---|---:|"]
            lines += [f"| `{n[:110]}` | {category(n)} | {us:.1f} |" for n, us in top]
    skipped = result.get("skipped")
    if skipped:
        lines += ["", "Not measured (the time budget): " + ", ".join(skipped)]
    return "\n".join(lines) + "\n"


def write(out_dir: str, result: dict) -> None:
    with open(os.path.join(out_dir, "rank_shapes.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "rank_shapes.md"), "w") as f:
        f.write(to_markdown(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="bench-dsv32")
    p.add_argument("--size", type=int, default=4, help="the ranks of the group whose rank 0 is built")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["one", "tp", "dp", "ep"])
    p.add_argument("--depths", type=int, nargs=2, default=[4, 8], help="two layer counts of the preset")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="requests per rank")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=200_000)
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile", type=int, default=10, metavar="ITERS", help="profiled replays per row (0: none)")
    p.add_argument("--budget-s", type=float, default=0, help="start no build past this many seconds (0: no limit)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
              "commit": os.environ.get("MINIDSA_COMMIT", "unknown"), "torch": torch.__version__,
              "command": "python3 benchmarks/scripts/bench_rank_shapes.py " + " ".join(argv or sys.argv[1:]),
              "preset": args.preset, "size": args.size, "depths": args.depths, "context": args.context,
              "kv_cache_dtype": args.kv_cache_dtype, "builds": [], "skipped": []}
    start = time.perf_counter()
    slowest = 0.0
    for mode in args.modes:
        for depth in args.depths:
            if args.budget_s and time.perf_counter() - start + slowest > args.budget_s:
                result["skipped"].append(f"{mode}:{depth}")
                continue
            t = time.perf_counter()
            build = measure(mode, depth, args)
            slowest = max(slowest, time.perf_counter() - t)
            result["builds"].append(build)
            print(f"bench_rank_shapes: {mode} depth {depth}: build {build['build_s']:.0f} s, "
                  + ", ".join(f"b{r['bs']} {r['step_ms']:.3f} ms" for r in build["rows"]), flush=True)
            write(args.out, result)
    write(args.out, result)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
