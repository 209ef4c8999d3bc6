"""Issue 49: `scripts/gpu_check.sh dp_attention`'s outputs as one summary JSON, and that JSON as the Markdown tables
for benchmarks/multi_gpu/NOTES.md: one GPU, TP=N and DP attention N side by side (KV capacity, `minidsa bench`,
decode steps, start-up), the issue's targets as ratios with pass / fail, and the MoE exchange (all-gather +
reduce-scatter against all-to-all). Device, date, commit and command go with every table.

The section runs each part into $OUT/dp_attention_raw/ (sides/<label>.json from bench_dp_attention.py,
exchange/moe_exchange.json from bench_moe_exchange.py, parts.txt, meta.txt) and calls, after each part,

    python3 benchmarks/scripts/dp_attention_page.py --collect $OUT/dp_attention_raw --json $OUT/dp_attention.json \\
        --markdown $OUT/dp_attention.md

The page alone, from a summary JSON brought back:

    python3 benchmarks/scripts/dp_attention_page.py --json dp_attention.json --markdown /tmp/dp_attention.md
"""

from __future__ import annotations

import glob
import json
import operator
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import _load  # noqa: E402
from bench_speculative import agreement  # noqa: E402
from multi_gpu_page import _f, _parts, parts_table, read_meta, run_page  # noqa: E402

SIDES = ("one", "tp", "dp", "tbo")  # the table's column order (tbo: DP attention with two-batch overlap)

# (what, metric, side, against, comparison, bound): the targets, DP attention's figure over another side's.
TARGETS = [
    ("KV capacity, DP attention / one GPU", "kv_total_tokens", "dp", "one", ">=", 3.5),
    ("`minidsa bench` output tok/s, DP attention / one GPU", "output_tok_s", "dp", "one", ">=", 3.2),
    ("`minidsa bench` output tok/s, DP attention / TP", "output_tok_s", "dp", "tp", ">", 1.0),
    ("ITL p99, DP attention / TP", "itl_p99_ms", "dp", "tp", "<=", 1.5),
]
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def side_key(r: dict) -> str:
    """Which column a side's JSON is: DP attention, TP (several GPUs), or one GPU."""
    if r.get("dp_attention"):
        return "tbo" if r.get("two_batch_overlap") else "dp"
    return "tp" if (r.get("gpus") or 1) > 1 else "one"


def agreement_table(sides: dict) -> list[str]:
    """Greedy agreement between the sides (their batched outputs) beside each side's floor (its own outputs batched
    against one request at a time: bf16 reductions change with the batch shape)."""
    names = {k: r.get("side", k) for k, r in sides.items() if r.get("greedy")}
    rows = [(f"{names[a]} vs {names[b]}", sides[a]["greedy"], sides[b]["greedy"])
            for a, b in (("dp", "tp"), ("dp", "one"), ("tp", "one"), ("tbo", "dp")) if a in names and b in names]
    rows += [(f"{names[k]}: batched vs one at a time (the floor)", sides[k]["greedy"], sides[k]["greedy_alone"])
             for k in SIDES if k in names and sides[k].get("greedy_alone")]
    if not rows:
        return []
    first = next(iter(names))
    L = ["## Greedy agreement", "", f"{len(sides[first]['greedy'])} prompts of 256 random tokens, 64 greedy tokens "
         "each, the same on every side (bench_speculative.py `greedy_outputs`, seed 7). Tokens agree bit for bit on a "
         "CPU in fp32; in bf16 on GPUs a different batch shape or reduction order moves a logit, and a greedy "
         "sequence parts at the first near-tie. The floor rows say how far that alone goes.", "",
         "| compared | identical outputs | mean first difference | tokens equal |", "|---|---:|---:|---:|"]
    for label, a, b in rows:
        r = agreement(a, b)
        L.append(f"| {label} | {r['identical']} / {r['requests']} | {r['mean_first_difference']:.1f} | "
                 f"{r['token_agreement']:.1%} |")
    return L + [""]


def _slim(r: dict) -> dict:
    """A side's JSON without the bench's per-step timeline (it stays in the raw tarball)."""
    r = json.loads(json.dumps(r))
    ((r.get("bench") or {}).get("results") or {}).pop("timeline", None)
    return r


def collect(raw: str) -> dict:
    sides: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(raw, "sides", "*.json"))):
        r = _load(path)
        if r is not None:
            sides[side_key(r)] = _slim(r)
    meta = read_meta(raw)
    for r in sides.values():
        meta.setdefault("device", r.get("device"))
    return {"meta": meta, "parts": _parts(os.path.join(raw, "parts.txt")), "sides": sides,
            "exchange": _load(os.path.join(raw, "exchange", "moe_exchange.json"))}


def metric(r: dict | None, name: str) -> float | None:
    """One figure of a side, None where it was not measured."""
    if not r:
        return None
    bench = ((r.get("bench") or {}).get("results")) or {}
    if name == "kv_total_tokens":
        return r.get("kv_total_tokens")
    if name == "startup_s":
        return r.get("startup_s")
    if name == "output_tok_s":
        return bench.get("output_tokens_per_s")
    if name in ("itl_p50_ms", "itl_p99_ms"):
        v = (bench.get("itl_s") or {}).get(name[4:7])
        return None if v is None else 1e3 * v
    if name in ("ttft_p50_s", "ttft_p99_s"):
        return (bench.get("ttft_s") or {}).get(name[5:8])
    raise KeyError(name)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(sides: dict) -> list[dict]:
    out = []
    for what, name, side, against, op, bound in TARGETS:
        r = ratio(metric(sides.get(side), name), metric(sides.get(against), name))
        out.append({"what": what, "needed": f"{op} {bound:g}x", "ratio": r,
                    "passed": None if r is None else COMPARE[op](r, bound)})
    return out


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _decode(r: dict | None, asked: str) -> dict | None:
    return next((d for d in (r or {}).get("decode") or [] if d.get("batch_asked") == asked), None)


def _source(r: dict, meta: dict) -> str:
    return (f"{r.get('side', '?')}: {r.get('device') or meta.get('device') or '?'} x {r.get('gpus', '?')}, "
            f"{r.get('date') or meta.get('date') or '?'}, commit {r.get('commit') or meta.get('commit') or '?'}: "
            f"`{r.get('command', '?')}`")


def sides_table(s: dict) -> list[str]:
    sides, meta = s.get("sides") or {}, s.get("meta") or {}
    if not sides:
        return []
    cols = [k for k in SIDES if k in sides]
    names = {k: sides[k].get("side", k) for k in cols}
    ratio_cols = [(a, b) for a, b in (("dp", "one"), ("dp", "tp"), ("tbo", "dp")) if a in sides and b in sides]
    head = ["measure"] + [names[k] for k in cols] + [f"{names[a]} / {names[b]}" for a, b in ratio_cols]
    L = ["## One GPU, tensor parallelism and DP attention side by side", "",
         "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def row(label: str, values: dict, digits: int, higher_ratio: bool = True) -> None:
        cells = [_f(values.get(k), digits) for k in cols]
        ratios = [_x(ratio(values.get(a), values.get(b))) for a, b in ratio_cols] if higher_ratio else \
            ["" for _ in ratio_cols]
        L.append(f"| {label} | " + " | ".join(cells + ratios) + " |")

    row("KV capacity, tokens", {k: metric(sides[k], "kv_total_tokens") for k in cols}, 0)
    reqs = {k: ((sides[k].get("bench") or {}).get("workload") or {}).get("num_requests") for k in cols}
    row("`minidsa bench` requests (default workload x GPUs)", reqs, 0, higher_ratio=False)
    row("concurrency (max running requests, all ranks)",
        {k: (sides[k].get("max_running_requests") or 0) * (sides[k].get("attention_ranks") or 1) for k in cols}, 0,
        higher_ratio=False)
    for label, name, digits in (("output tok/s", "output_tok_s", 1), ("ITL p50 ms", "itl_p50_ms", 3),
                                ("ITL p99 ms", "itl_p99_ms", 3), ("TTFT p50 s", "ttft_p50_s", 3),
                                ("TTFT p99 s", "ttft_p99_s", 3)):
        row(label, {k: metric(sides[k], name) for k in cols}, digits)
    asked = []
    for k in cols:
        for d in sides[k].get("decode") or []:
            if d.get("batch_asked") not in asked:
                asked.append(d["batch_asked"])
    for a in asked:
        ds = {k: _decode(sides[k], a) for k in cols}
        sizes = " / ".join(str(ds[k]["batch"]) if ds[k] else "-" for k in cols)
        row(f"decode batch {a} ({sizes}): ms per step", {k: ds[k] and ds[k]["step_ms"] for k in cols}, 3)
        row(f"decode batch {a}: output tok/s", {k: ds[k] and ds[k]["tok_per_s"] for k in cols}, 1)
    row("start-up s (engine construction)", {k: metric(sides[k], "startup_s") for k in cols}, 1)
    L += ["", "Ratios: DP attention's figure over the other side's (for ms and s, above 1 means slower). `minidsa "
          "bench` runs its default workload (seed 0) with the requests scaled by the side's GPU count; decode: "
          "steady decode of B requests (a batch N/gpu is N per GPU: under DP attention N per attention rank), ms per "
          "engine step and output tok/s. Start-up: the sides ran one after another in this call, sharing the "
          "compile caches as they filled; KV capacity: automatic (under DP attention the ranks' caches together).",
          ""]
    L += [f"- {_source(sides[k], meta)}" for k in cols]
    return L + [""]


def targets_table(s: dict) -> list[str]:
    sides, meta = s.get("sides") or {}, s.get("meta") or {}
    if not sides:
        return []
    L = ["## Issue 49's targets", "", f"{meta.get('device') or '?'}, {meta.get('date') or '?'}, commit "
         f"{meta.get('commit') or '?'}; the figures and commands of the table above.", "",
         "| target | needed | measured | result |", "|---|---:|---:|---|"]
    for t in targets(sides):
        result = "not measured" if t["passed"] is None else "pass" if t["passed"] else "**FAIL**"
        L.append(f"| {t['what']} | {t['needed']} | {_x(t['ratio'])} | {result} |")
    return L + [""]


def exchange_table(x: dict | None) -> list[str]:
    if not x:
        return []
    how = f"CUDA graphs of {x['per_graph']} chained exchanges, the slowest rank's median" if x.get("cuda_graphs") \
        else "eager, gloo: a smoke run, the figures mean nothing"
    L = ["## The MoE exchange of a decode step: all-gather + reduce-scatter against all-to-all", "",
         f"{x['device']} x {x['ranks']}, {x['date']}, commit {x['commit']}: `{x['command']}`; NCCL "
         f"{x.get('nccl') or '-'}, torch {x.get('torch')}, multicast variables {x.get('env')}.", "",
         f"Rows of {x['hidden']} x {x['dtype']} per rank, random routing (top-{x['top_k']} of {x['experts']} experts, "
         f"{x['experts'] // x['ranks']} per rank); us per exchange, {how}. AG + RS: what minidsa does "
         "(`MoE._forward_dp`); all-to-all: each token only to the ranks holding its experts, with this routing's "
         "splits fixed at capture (a served step would also exchange counts or pad: the all-to-all's floor); padded: "
         "every destination's block padded to the rows per rank (static, as many rows as the all-gather). Experts "
         "are a stand-in (no GEMM).", "",
         "| rows per rank | bytes per rank | rows dispatched / gathered | AG + RS us | all-to-all us | all-to-all "
         "padded us | all-to-all / AG + RS | fastest | outputs equal |",
         "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    names = {"ag_rs": "AG + RS", "a2a": "all-to-all", "a2a_padded": "all-to-all padded"}
    for r in x["results"]:
        equal = "yes" if all(r["equal"].values()) else \
            "**NO**: " + ", ".join(names[m] for m, ok in r["equal"].items() if not ok)
        L.append(f"| {r['rows']} | {r['bytes_per_rank']} | {r['dispatch_rows_mean']:.1f} / {r['gathered_rows']} | "
                 f"{r['ag_rs_us']:.2f} | {r['a2a_us']:.2f} | {r['a2a_padded_us']:.2f} | "
                 f"{_x(ratio(r['a2a_us'], r['ag_rs_us']))} | {names[r['fastest']]} | {equal} |")
    L += ["", "Outputs equal: each method's output, from integer-valued rows and weights (exact in bf16), equals the "
          "reference bit for bit on every rank."]
    return L + [""]


def page(s: dict) -> str:
    meta = s.get("meta") or {}
    L = ["# Data-parallel attention against tensor parallelism: current figures", "",
         f"{meta.get('model') or '?'} at N = {meta.get('tp') or '?'} on {meta.get('device') or '?'}; "
         f"{meta.get('date') or '?'}, commit {meta.get('commit') or '?'}; engine flags of every side: "
         f"`{meta.get('engine_args') or ''}`. Made by `scripts/gpu_check.sh dp_attention` and "
         "`benchmarks/scripts/dp_attention_page.py`.", ""]
    L += sides_table(s) + targets_table(s) + agreement_table(s.get("sides") or {}) + \
        exchange_table(s.get("exchange")) + parts_table(s)
    return "\n".join(L).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_page(__doc__, collect, page, argv, indent=1)

if __name__ == "__main__":
    sys.exit(main())
