"""Indexer top-k (k = 2048) on short rows at small batch: the register select vs the split select vs one program
per row vs torch.topk, each timed as CUDA-graph replays (how decode runs it). GPU only.

    python3 benchmarks/bench_topk_short.py --json topk_short_h100.json \
        --commit $(git rev-parse --short HEAD)

For batch 1..64 x width 2048..16384 it times, per call (a graph holding `--inner` calls back to back, replayed
`--replays` times; the median replay over `--inner`; inputs stay in L2, as the indexer's logits do in a decode step;
random normal logits, every position visible, so at width 2048 = k every kernel takes the whole row):
- register: `topk_slots(method="register")`, one launch, the row held in registers (widths up to
  REGISTER_MAX_BLOCK), at its default (RADIX_BITS, num_warps) and tiles (`register_tiles_for`); with --variants
  (default on), also every RADIX_BITS in (2, 8) x num_warps in (4, 8, 16, 32) that gives 4 to 64 keys a thread;
- register one block: where the default tiles are two (a HEAD and a TAIL tile), the same select over one
  power-of-two block (`register_tiles=(P, 0)`, what served such widths before the tail tile): old vs new side by
  side;
- split: `topk_slots(method="split")` at the default programs per row (`split_chunks`; 1 past few rows);
- rows: `topk_slots(method="rows")`, one program per row re-reading the row each pass;
- torch: `torch_topk_slots`; and what `fastest_topk_slots` (the served op) picks by default.
Every path's positions are checked against torch's on the first call. Prints a Markdown table and the values of
REGISTER_MAX_WIDTH and REGISTER_RADIX_BITS these numbers suggest; --json writes everything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Powers of two, and widths just past one (a 4096 context plus decode tokens: 4160), which the register select holds
# in two tiles (`topk.register_tiles_for`).
WIDTHS = (2048, 2100, 4096, 4160, 5120, 8192, 8300, 10240, 16384)
TOPK = 2048


def graph_us(fn, inner: int, replays: int) -> float:
    """Median microseconds per call of `fn`, `inner` calls captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture, as torch.cuda.graph wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
    del graph
    return statistics.median(times)


def case(batch: int, width: int, seed: int):
    """Random logits, req_to_token rows wider than the logits (as the engine's are), token rows in reverse."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, width, device="cuda", generator=g)
    r2t = torch.randperm(batch * (width + 64), device="cuda", generator=g).view(batch, width + 64).to(torch.int32)
    rows = torch.arange(batch - 1, -1, -1, device="cuda")
    return logits, r2t, rows


def same_sets(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(a.sort(1).values, b.sort(1).values) for a, b in zip(got, want))


def register_variants(block: int) -> list[tuple[int, int]]:
    return [(bits, warps) for bits in (2, 8) for warps in (4, 8, 16, 32) if 4 <= block // (32 * warps) <= 64]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--commit", default="unknown", help="the commit measured (recorded in the output)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--inner", type=int, default=20, help="calls per graph")
    ap.add_argument("--replays", type=int, default=50, help="graph replays; the median is reported")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="time the register select at its default config only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_topk_short.py times CUDA kernels and needs a CUDA GPU: torch.cuda.is_available() is False. "
              "Nothing was timed.", file=sys.stderr)
        return 2

    import triton

    from minidsa.kernels import few_rows, num_sms
    from minidsa.kernels import topk

    dev = torch.device("cuda")
    meta = {
        "device": torch.cuda.get_device_name(dev), "sms": num_sms(dev), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": args.commit,
        "k": TOPK, "inner": args.inner, "replays": args.replays,
        "few_rows_max": num_sms(dev) // 8, "REGISTER_MAX_WIDTH": topk.REGISTER_MAX_WIDTH,
        "REGISTER_MAX_BLOCK": topk.REGISTER_MAX_BLOCK, "REGISTER_RADIX_BITS": topk.REGISTER_RADIX_BITS,
    }
    print(f"# top-k k={TOPK}: {meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['date']}, commit {meta['commit']}", flush=True)
    rows_out: list[dict] = []

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows_out}, f, indent=1)

    for width in args.widths:
        block = max(256, triton.next_power_of_2(width))
        for batch in args.batches:
            logits, r2t, rows = case(batch, width, seed=batch * 100003 + width)
            want = topk.torch_topk_slots(logits, TOPK, r2t, rows)
            row: dict = {"batch": batch, "width": width, "few_rows": few_rows(batch, dev),
                         "split_chunks": topk.split_chunks(batch, width, dev), "us": {}, "errors": {}}
            kwargs = {"split": dict(method="split"), "rows": dict(method="rows")}
            if block <= topk.REGISTER_MAX_BLOCK:
                head, tail = topk.register_tiles_for(width, TOPK)
                row["register_default"] = [topk.REGISTER_RADIX_BITS, topk.register_warps(head + tail)]
                row["register_tiles"] = [head, tail]
                kwargs["register"] = dict(method="register")
                if tail:
                    kwargs["register one block"] = dict(method="register", register_tiles=(block, 0))
                for bits, warps in register_variants(block) if args.variants else []:
                    kwargs[f"register b{bits} w{warps}"] = dict(method="register", register_config=(bits, warps))
            paths = {name: (lambda kw=kw: topk.topk_slots(logits, TOPK, r2t, rows, **kw))
                     for name, kw in kwargs.items()}
            paths["torch"] = lambda: topk.torch_topk_slots(logits, TOPK, r2t, rows)
            paths["served"] = lambda: topk.fastest_topk_slots(logits, TOPK, r2t, rows)
            for name, fn in paths.items():
                try:
                    if not same_sets(fn(), want):
                        row["errors"][name] = "positions differ from torch.topk's"
                    row["us"][name] = graph_us(fn, args.inner, args.replays)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch: recorded, not fatal
                    row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            if not topk.triton_wins(batch, width, dev):
                row["served_picks"] = "torch"
            elif topk.register_select_wins(batch, width, dev):
                row["served_picks"] = "register"
            else:
                row["served_picks"] = "split" if row["split_chunks"] > 1 else "rows"
            variants = {n: t for n, t in row["us"].items() if n.startswith("register b")}
            if variants:
                row["register_best"] = min(variants, key=variants.get)
            rows_out.append(row)
            print(f"B={batch} W={width}: " + ", ".join(f"{n} {t:.1f}" for n, t in row["us"].items())
                  + (f"  ERRORS {row['errors']}" if row["errors"] else ""), flush=True)
            save()

    print()
    print(markdown(rows_out, meta))
    suggestion = suggest(rows_out)
    meta["suggest"] = suggestion
    print(f"\nsuggested: REGISTER_MAX_WIDTH = {suggestion['REGISTER_MAX_WIDTH']} "
          f"(largest width where the register select beats the split one at every few-rows batch, "
          f"and every narrower width does too); REGISTER_RADIX_BITS = {suggestion['REGISTER_RADIX_BITS']} "
          f"(mean over the few-rows shapes it takes, best warps each)")
    save()
    errors = [(r["batch"], r["width"], r["errors"]) for r in rows_out if r["errors"]]
    if errors:
        print(f"\n{len(errors)} shapes with errors: {errors}", file=sys.stderr)
    return 1 if any("differ" in e for *_, errs in errors for e in errs.values()) else 0


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Top-k k={meta['k']}, us per call in CUDA graphs (median of {meta['replays']} replays of "
             f"{meta['inner']} calls), {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}, commit {meta['commit']}.", "",
             "| batch | width | register (tiles) | register one block | best register (bits, warps) "
             "| split (programs/row) | rows | torch.topk | served (picks) | split / register |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]

    def us(r: dict, name: str) -> str:
        return f"{r['us'][name]:.1f}" if name in r["us"] else ("error" if name in r["errors"] else "-")

    for r in rows:
        best = r.get("register_best")
        best_s = f"{r['us'][best]:.1f} ({best.removeprefix('register ')})" if best else "-"
        ratio = (f"{r['us']['split'] / r['us']['register']:.2f}x" if "register" in r["us"] and "split" in r["us"]
                 else "-")
        tiles = "+".join(str(t) for t in r.get("register_tiles", []) if t)
        lines.append(f"| {r['batch']} | {r['width']} | {us(r, 'register')} ({tiles or '-'}) "
                     f"| {us(r, 'register one block')} | {best_s} | {us(r, 'split')} "
                     f"({r['split_chunks']}) | {us(r, 'rows')} | {us(r, 'torch')} | {us(r, 'served')} "
                     f"({r['served_picks']}) | {ratio} |")
    return "\n".join(lines)


def suggest(rows: list[dict]) -> dict:
    """REGISTER_MAX_WIDTH: the largest width W such that at every width <= W, at every few-rows batch, the register
    select (default config) beat the split one; 0 if it never did. REGISTER_RADIX_BITS: lowest mean time over those
    shapes, each bits at its best warps."""
    max_width = 0
    for width in sorted({r["width"] for r in rows}):
        few = [r for r in rows if r["width"] == width and r["few_rows"]]
        if not few or not all("register" in r["us"] and r["us"]["register"] < r["us"].get("split", float("inf"))
                              for r in few):
            break
        max_width = width
    shapes = [r for r in rows if r["few_rows"] and "register" in r["us"] and (not max_width or r["width"] <= max_width)]
    means = {}
    for bits in (2, 8):
        per_shape = [min((t for n, t in r["us"].items() if n.startswith(f"register b{bits} ")), default=None)
                     for r in shapes]
        if per_shape and None not in per_shape:
            means[bits] = statistics.fmean(per_shape)
    return {"REGISTER_MAX_WIDTH": max_width, "REGISTER_RADIX_BITS": min(means, key=means.get) if means else None,
            "mean_us_by_radix_bits": means}


if __name__ == "__main__":
    sys.exit(main())
