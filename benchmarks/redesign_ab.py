"""Issue 30's before/after: the same GPU measurements on the code before the redesign and after it, side by side.

`scripts/gpu_check.sh redesign_ab` runs, on one machine and interleaved (before, after, before, after), `minidsa
bench` on the default workload and the decode suite at batch 1 and 32, for both trees, writing
ab_{before,after}_{bench,decode}.json; this script reads them and writes redesign_ab.md / redesign_ab.json with the
ratios (after / before):

    python benchmarks/redesign_ab.py --dir $OUT --before f6bdc44 --after <commit>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def rows(d: str) -> list[tuple[str, float | None, float | None, bool]]:
    """(measure, before, after, higher is better)."""
    out: list[tuple[str, float | None, float | None, bool]] = []
    bench = {side: _load(os.path.join(d, f"ab_{side}_bench.json")) for side in ("before", "after")}
    for key, label, scale, higher in (("output_tokens_per_s", "minidsa bench: output tok/s", 1, True),
                                      ("itl_s.p50", "minidsa bench: ITL p50 ms", 1e3, False),
                                      ("itl_s.p99", "minidsa bench: ITL p99 ms", 1e3, False),
                                      ("ttft_s.p50", "minidsa bench: TTFT p50 s", 1, False)):
        vals = []
        for side in ("before", "after"):
            v = (bench[side] or {}).get("results")
            for part in key.split("."):
                v = v.get(part) if isinstance(v, dict) else None
            vals.append(v * scale if isinstance(v, (int, float)) else None)
        out.append((label, vals[0], vals[1], higher))
    decode = {side: _load(os.path.join(d, f"ab_{side}_decode.json")) for side in ("before", "after")}
    steps = {side: {(r["bs"], r["ctx"]): r["step_ms"] for r in (decode[side] or {}).get("decode", [])
                    if "step_ms" in r} for side in ("before", "after")}
    for bs, ctx in sorted(set(steps["before"]) | set(steps["after"])):
        out.append((f"decode suite: graph step ms, batch {bs}, context {ctx}", steps["before"].get((bs, ctx)),
                    steps["after"].get((bs, ctx)), False))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where gpu_check.sh's redesign_ab section wrote its JSON")
    p.add_argument("--before", required=True, help="commit of the tree before the redesign")
    p.add_argument("--after", required=True, help="commit of the tree after it")
    args = p.parse_args()
    table = rows(args.dir)
    device = next((x.get("device") for x in (_load(os.path.join(args.dir, f"ab_{s}_decode.json"))
                                              for s in ("after", "before")) if x), "?")
    lines = [f"Redesign before ({args.before}) / after ({args.after}), {device}, {time.strftime('%Y-%m-%d')}, one "
             "machine, interleaved", "", "| measure | before | after | after / before | better |",
             "|---|---|---|---|---|"]
    for label, before, after, higher in table:
        if before is None or after is None:
            lines.append(f"| {label} | {before if before is not None else '-'} | "
                         f"{after if after is not None else '-'} | - | - |")
            continue
        ratio = after / before
        lines.append(f"| {label} | {before:.3f} | {after:.3f} | {ratio:.3f} | "
                     f"{'after' if (ratio > 1) == higher and ratio != 1 else 'before'} |")
    with open(os.path.join(args.dir, "redesign_ab.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.dir, "redesign_ab.json"), "w") as f:
        json.dump({"before": args.before, "after": args.after, "device": device, "date": time.strftime("%Y-%m-%d"),
                   "rows": [dict(zip(("measure", "before", "after", "higher_is_better"), r)) for r in table]}, f,
                  indent=1)
    print("\n".join(lines))
    return 0 if all(b is not None and a is not None for _, b, a, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
