"""Two trees of minidsa measured on one machine in one call, interleaved, and their ratios (after / before).

`scripts/gpu_check.sh ab` (and `redesign_ab`, issue 30) runs, for the tree before and the tree now, `minidsa bench`
on its default workload (ab_{side}_bench.json) and the decode suite on each preset of AB_PRESETS
(ab_{side}_decode_{preset}.json; one preset: ab_{side}_decode.json). This script reads them and writes
NAME.md / NAME.json:
- minidsa bench: output tok/s, ITL p50 / p99, TTFT p50;
- per preset, the CUDA-graph decode step (ms, MBU) at each batch and context;
- for two depths of one preset (e.g. bench-dsv32:4 and :6), what each added layer costs: the step difference over
  the layer difference, and its MBU (the bytes the extra layers read over that time, over the copy ceiling measured
  in the same run), so the lm_head and the embedding are out of the per-layer figure (issue 29);
- with the suite's --profile, the batch-1 graph's kernels per step and kernel time, per side.

    python benchmarks/scripts/ab.py --dir $OUT --before d4ff887 --after <commit> [--name tail_ab --title "..."]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

SIDES = ("before", "after")


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _decode_files(d: str) -> dict[str, dict[str, dict | None]]:
    """preset -> side -> decode-suite JSON."""
    out: dict[str, dict[str, dict | None]] = {}
    for side in SIDES:
        for path in sorted(glob.glob(os.path.join(d, f"ab_{side}_decode*.json"))):
            data = _load(path)
            preset = (data or {}).get("preset") or os.path.basename(path)
            out.setdefault(preset, dict.fromkeys(SIDES))[side] = data
    return out


def _depth(preset: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(.+):(\d+)", preset)
    return (m.group(1), int(m.group(2))) if m else None


def rows(d: str) -> list[tuple[str, float | None, float | None, bool]]:
    """(measure, before, after, higher is better)."""
    out: list[tuple[str, float | None, float | None, bool]] = []
    bench = {side: _load(os.path.join(d, f"ab_{side}_bench.json")) for side in SIDES}
    if any(bench.values()):
        for key, label, scale, higher in (("output_tokens_per_s", "minidsa bench: output tok/s", 1, True),
                                          ("itl_s.p50", "minidsa bench: ITL p50 ms", 1e3, False),
                                          ("itl_s.p99", "minidsa bench: ITL p99 ms", 1e3, False),
                                          ("ttft_s.p50", "minidsa bench: TTFT p50 s", 1, False)):
            vals = []
            for side in SIDES:
                v = (bench[side] or {}).get("results")
                for part in key.split("."):
                    v = v.get(part) if isinstance(v, dict) else None
                vals.append(v * scale if isinstance(v, (int, float)) else None)
            out.append((label, vals[0], vals[1], higher))
    decode = _decode_files(d)
    steps: dict[str, dict[str, dict[tuple[int, int], dict]]] = {
        preset: {side: {(r["bs"], r["ctx"]): r for r in (sides[side] or {}).get("decode", []) if "step_ms" in r}
                 for side in SIDES} for preset, sides in decode.items()}
    label = "decode suite" if len(decode) == 1 else "decode suite {preset}"
    for preset, sides in steps.items():
        for bs, ctx in sorted(set(sides["before"]) | set(sides["after"])):
            b, a = sides["before"].get((bs, ctx)), sides["after"].get((bs, ctx))
            name = label.format(preset=preset)
            out.append((f"{name}: graph step ms, batch {bs}, context {ctx}", b and b["step_ms"], a and a["step_ms"],
                        False))
            out.append((f"{name}: MBU, batch {bs}, context {ctx}", b and b.get("MBU"), a and a.get("MBU"), True))
    by_base: dict[str, list[tuple[int, str]]] = {}
    for preset in steps:
        if (dp := _depth(preset)) is not None:
            by_base.setdefault(dp[0], []).append((dp[1], preset))
    for base, depths in by_base.items():
        if len(depths) < 2:
            continue
        (lo, lo_p), (hi, hi_p) = min(depths), max(depths)
        for bs, ctx in sorted(steps[hi_p]["after"]):
            ms, mbu = [], []
            for side in SIDES:
                a, b = steps[hi_p][side].get((bs, ctx)), steps[lo_p][side].get((bs, ctx))
                copy = ((decode[hi_p][side] or {}).get("ceilings") or {}).get("copy_GBps")
                if a is None or b is None:
                    ms.append(None)
                    mbu.append(None)
                    continue
                per_layer_ms = (a["step_ms"] - b["step_ms"]) / (hi - lo)
                ms.append(per_layer_ms)
                per_layer_gb = (a["bytes_GB"] - b["bytes_GB"]) / (hi - lo)
                mbu.append(per_layer_gb / (per_layer_ms * 1e-3) / copy if copy and per_layer_ms > 0 else None)
            what = f"per layer added, {lo_p} -> {hi_p}, batch {bs}, context {ctx}"
            out.append((f"{what}: ms", ms[0], ms[1], False))
            out.append((f"{what}: MBU", mbu[0], mbu[1], True))
    for preset, sides in decode.items():
        prof = {side: ((sides[side] or {}).get("profile") or {}).get("compiled") for side in SIDES}
        if any(prof.values()):
            name = label.format(preset=preset)
            for key, what, higher in (("kernels_per_step", "kernels per step", False),
                                      ("kernel_us", "kernel us per step", False)):
                out.append((f"{name}: batch-1 graph, {what}", (prof["before"] or {}).get(key),
                            (prof["after"] or {}).get(key), higher))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where gpu_check.sh's ab section wrote its JSON")
    p.add_argument("--before", required=True, help="commit of the tree before")
    p.add_argument("--after", required=True, help="commit of the tree after")
    p.add_argument("--name", default="ab", help="output file stem (NAME.md, NAME.json)")
    p.add_argument("--title", default="Before / after", help="the table's first words")
    args = p.parse_args()
    table = rows(args.dir)
    raw = sorted(glob.glob(os.path.join(args.dir, "ab_*_decode*.json"))) + \
        sorted(glob.glob(os.path.join(args.dir, "ab_*_bench.json")))
    device = next((x["device"] for x in map(_load, raw) if x and x.get("device")), "?")
    lines = [f"{args.title}: before ({args.before}) / after ({args.after}), {device}, {time.strftime('%Y-%m-%d')}, "
             "one machine, interleaved", "", "| measure | before | after | after / before | better |",
             "|---|---|---|---|---|"]
    for label, before, after, higher in table:
        if before is None or after is None:
            lines.append(f"| {label} | {before if before is not None else '-'} | "
                         f"{after if after is not None else '-'} | - | - |")
            continue
        ratio = after / before if before else float("nan")
        lines.append(f"| {label} | {before:.3f} | {after:.3f} | {ratio:.3f} | "
                     f"{'after' if (ratio > 1) == higher and ratio != 1 else 'before'} |")
    with open(os.path.join(args.dir, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.dir, f"{args.name}.json"), "w") as f:
        json.dump({"before": args.before, "after": args.after, "device": device, "date": time.strftime("%Y-%m-%d"),
                   "rows": [dict(zip(("measure", "before", "after", "higher_is_better"), r)) for r in table]}, f,
                  indent=1)
    print("\n".join(lines))
    return 0 if table and all(b is not None and a is not None for _, b, a, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
