"""Indexer top-k (k = 2048) on short rows at small batch: the register select vs the split select vs one program
per row vs torch.topk, each timed as CUDA-graph replays (how decode runs it). GPU only.

    python3 benchmarks/scripts/bench_topk_short.py --json topk_short_h100.json \
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

With --early-exit-ab it times only the register select's 2-bit search, old against new, in the same process:

    git show main:minidsa/kernels/topk.py > /tmp/topk_main.py   # optional: the tree before early exit
    python3 benchmarks/scripts/bench_topk_short.py --early-exit-ab --baseline-topk /tmp/topk_main.py \
        --json topk_early_exit_h100.json --commit $(git rev-parse --short HEAD)

at widths 4096, 4160, 8256, 16384, 16448 (`--widths`) x batches 1, 4, 32 (`--batches`) over three kinds of logits
(`logit_rows`): "indexer" (sums over heads of relu(q . k) * w of random bf16 vectors, fp32: nearly all distinct, as
served), "normal" (torch.randn) and "bf16 ties" (the indexer ones rounded to bf16: many keys equal the k-th). Paths:
- main: `--baseline-topk`'s `topk_slots(method="register")` (a topk.py loaded from that file), if given;
- unrolled: this tree's select with `register_early_exit=False` (all 16 steps unrolled, the tiles' counts in one
  reduction);
- early exit: this tree's default;
- served: `fastest_topk_slots` (what decode runs; the only path past REGISTER_MAX_BLOCK, e.g. at 16448).
Each is checked to give the same slots and positions as the others; "steps" is the mean number of search steps the
early-exit loop runs on those rows (from a model of the search in torch: the kernel does not report it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Powers of two, and widths just past one (a 4096 context plus decode tokens: 4160), which the register select holds
# in two tiles (`topk.register_tiles_for`).
WIDTHS = (2048, 2100, 4096, 4160, 5120, 8192, 8300, 10240, 16384)
TOPK = 2048
# --early-exit-ab: contexts 4096, 8192 and 16384 plus decode tokens (16448 is past the register select: served only).
EE_WIDTHS = (4096, 4160, 8256, 16384, 16448)
EE_BATCHES = (1, 4, 32)
EE_KINDS = ("indexer", "normal", "bf16 ties")


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
    ap.add_argument("--batches", type=int, nargs="+", help=f"default {BATCHES}; --early-exit-ab: {EE_BATCHES}")
    ap.add_argument("--widths", type=int, nargs="+", help=f"default {WIDTHS}; --early-exit-ab: {EE_WIDTHS}")
    ap.add_argument("--inner", type=int, default=20, help="calls per graph")
    ap.add_argument("--replays", type=int, default=50, help="graph replays; the median is reported")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="time the register select at its default config only")
    ap.add_argument("--early-exit-ab", action="store_true",
                    help="time the register select's search old vs new only (default widths and batches: EE_*)")
    ap.add_argument("--baseline-topk", metavar="PATH",
                    help="with --early-exit-ab: a topk.py (e.g. main's) whose register select is timed as 'main'")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_topk_short.py times CUDA kernels and needs a CUDA GPU: torch.cuda.is_available() is False. "
              "Nothing was timed.", file=sys.stderr)
        return 2
    if args.early_exit_ab:
        return early_exit_ab(args)

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

    for width in args.widths or WIDTHS:
        block = max(256, triton.next_power_of_2(width))
        for batch in args.batches or BATCHES:
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


def logit_rows(kind: str, batch: int, width: int, seed: int) -> torch.Tensor:
    """[batch, width] fp32 logits of one kind (see the module docstring), every position visible."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "normal":
        return torch.randn(batch, width, device="cuda", generator=g)
    heads, dim = 32, 128  # the indexer's: relu(q_h . k_s) * w_h summed over heads, bf16 operands, fp32 sums
    q = torch.randn(batch, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(width, dim, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(batch, heads, 1, device="cuda", generator=g) * heads ** -0.5
    logits = (torch.relu(torch.matmul(q.float(), k.float().T)) * w).sum(1)
    return logits.to(torch.bfloat16).float() if kind == "bf16 ties" else logits


def search_steps(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the steps the register select's early-exit 2-bit search runs (a model of its loop in torch: the
    largest T with count(key >= T) >= k, two bits a step from the top, stopping once count(key >= T's bits so far)
    is k); 0 for rows with k or fewer visible keys, 16 where ties at T keep it going to the last bit."""
    key = logits.contiguous().view(torch.int32).long()
    key = torch.where(key >= 0, key, key ^ 0x7FFFFFFF) + 2 ** 31  # the kernel's orderable key, as an int64
    rows = logits.shape[0]
    thr = torch.zeros(rows, dtype=torch.long, device=logits.device)
    n_at = torch.full((rows,), logits.shape[1], dtype=torch.long, device=logits.device)
    done = (logits > float("-inf")).sum(1) <= k
    steps = torch.zeros(rows, dtype=torch.long, device=logits.device)
    for step in range(16):
        bit = 1 << (30 - 2 * step)
        counts = torch.stack([(key >= (thr + c * bit)[:, None]).sum(1) for c in (1, 2, 3)], 1)
        d = (counts >= k).sum(1)
        n_at = torch.where(d > 0, counts.gather(1, (d - 1).clamp(min=0)[:, None])[:, 0], n_at)
        thr = thr + d * bit
        steps += (~done).long()
        done |= n_at == k
    return steps


def load_baseline_topk(path: str):
    """A topk.py (another tree's) as a module of its own, beside this tree's minidsa.kernels.topk."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def early_exit_ab(args) -> int:
    """--early-exit-ab: the register select's search, old vs new, per kind x width x batch; prints a Markdown table."""
    import triton

    from minidsa.kernels import num_sms, topk

    baseline = load_baseline_topk(args.baseline_topk) if args.baseline_topk else None
    dev = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(dev), "sms": num_sms(dev), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": args.commit, "baseline": args.baseline_topk, "k": TOPK, "inner": args.inner,
            "replays": args.replays, "REGISTER_EARLY_EXIT": topk.REGISTER_EARLY_EXIT}
    print(f"# register top-k early exit A/B, k={TOPK}: {meta['device']}, torch {meta['torch']}, triton "
          f"{meta['triton']}, {meta['date']}, commit {meta['commit']}, main = {meta['baseline']}", flush=True)
    rows_out: list[dict] = []
    for kind in EE_KINDS:
        for width in args.widths or EE_WIDTHS:
            for batch in args.batches or EE_BATCHES:
                logits = logit_rows(kind, batch, width, seed=batch * 100003 + width)
                r2t = torch.randperm(batch * (width + 64), device="cuda").view(batch, width + 64).to(torch.int32)
                rows = torch.arange(batch - 1, -1, -1, device="cuda")
                steps = search_steps(logits, TOPK).float()
                row: dict = {"kind": kind, "batch": batch, "width": width, "steps_mean": steps.mean().item(),
                             "steps_max": steps.max().item(), "us": {}, "errors": {}}
                paths = {"served": lambda: topk.fastest_topk_slots(logits, TOPK, r2t, rows)}
                if triton.next_power_of_2(width) <= topk.REGISTER_MAX_BLOCK:
                    row["tiles"] = list(topk.register_tiles_for(width, TOPK))
                    if baseline is not None:
                        paths["main"] = lambda: baseline.topk_slots(logits, TOPK, r2t, rows, method="register")
                    paths["unrolled"] = lambda: topk.topk_slots(logits, TOPK, r2t, rows, method="register",
                                                                register_early_exit=False)
                    paths["early exit"] = lambda: topk.topk_slots(logits, TOPK, r2t, rows, method="register",
                                                                  register_early_exit=True)
                want = None
                for name, fn in paths.items():
                    try:
                        got = fn()
                        if want is None:
                            want = got
                        elif name != "served" and not all(torch.equal(a, b) for a, b in zip(got, want)):
                            row["errors"][name] = "slots / positions differ from the other paths'"
                        elif name == "served" and not same_sets(got, want):
                            row["errors"][name] = "positions differ from the other paths'"
                        row["us"][name] = graph_us(fn, args.inner, args.replays)
                    except Exception as e:  # noqa: BLE001 - recorded, not fatal
                        row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                rows_out.append(row)
                print(f"{kind} B={batch} W={width}: steps {row['steps_mean']:.1f}, "
                      + ", ".join(f"{n} {t:.1f}" for n, t in row["us"].items())
                      + (f"  ERRORS {row['errors']}" if row["errors"] else ""), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"meta": meta, "rows": rows_out}, f, indent=1)

    print(f"\nRegister top-k k={TOPK}, us per call in CUDA graphs (median of {args.replays} replays of {args.inner} "
          f"calls), {meta['device']}, triton {meta['triton']}, commit {meta['commit']}, main = {meta['baseline']}.\n")
    print("| logits | batch | width | tiles | main | unrolled | early exit | early / main | early / unrolled "
          "| steps (mean, max) | served |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows_out:
        us = r["us"]

        def cell(name: str) -> str:
            return f"{us[name]:.1f}" if name in us else ("error" if name in r["errors"] else "-")

        def ratio(a: str, b: str) -> str:
            return f"{us[a] / us[b]:.3f}" if a in us and b in us else "-"

        tiles = "+".join(str(t) for t in r.get("tiles", []) if t) or "-"
        print(f"| {r['kind']} | {r['batch']} | {r['width']} | {tiles} | {cell('main')} | {cell('unrolled')} "
              f"| {cell('early exit')} | {ratio('early exit', 'main')} | {ratio('early exit', 'unrolled')} "
              f"| {r['steps_mean']:.1f}, {r['steps_max']:.0f} | {cell('served')} |")
    errors = [(r["kind"], r["batch"], r["width"], r["errors"]) for r in rows_out if r["errors"]]
    if errors:
        print(f"\n{len(errors)} shapes with errors: {errors}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
