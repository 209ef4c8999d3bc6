"""RMSNorm + FP8 input quantisation: the fused launch (kernels/norm_quant.py) vs what ran before it, each timed as
CUDA-graph replays (how decode runs it). GPU only.

    python3 benchmarks/scripts/bench_norm_quant.py --json norm_quant_h100.json --commit $(git rev-parse --short HEAD)

Per (width, residual, tokens), us per call (a graph of `--inner` calls, median of `--replays` replays):
- old: the residual add + RMSNorm as the compiled layer runs them (`torch.compile` of `reference.rms_norm` after the
  add: inductor's one reduction kernel), then `fp8_gemm.quant_act` of the result (the launch the fused MoE makes at
  every size, the w8a8 GEMM above 64 rows, DeepGEMM's GEMM always);
- old norm only: the same without the quantisation (at decode sizes the Triton GEMM quantises inside itself, so the
  norm alone is what a dense layer or an attention input paid);
- new: `norm_quant.rmsnorm_quant` (add, norm, bf16 normed row, e4m3 + scales in one launch).
Widths: DeepSeek-V3.2 hidden 7168 (after the attention's residual add: the MoE / MLP input; and the layer's input
norm, no add), its q_lora_rank 1536 (q_a_layernorm), GLM-5's hidden 6144. Outputs are checked (the new path's
bytes equal to `quant_act` of its own normed row) on the first call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_topk_short import graph_us  # noqa: E402

CASES = ((7168, True), (7168, False), (1536, False), (6144, True))  # (width, residual add before the norm)
TOKENS = (1, 8, 32, 128, 2048, 8192)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--commit", default="unknown", help="the commit measured (recorded in the output)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--inner", type=int, default=20, help="calls per graph")
    ap.add_argument("--replays", type=int, default=50, help="graph replays; the median is reported")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_norm_quant.py times CUDA kernels and needs a CUDA GPU: torch.cuda.is_available() is False. "
              "Nothing was timed.", file=sys.stderr)
        return 2

    import triton

    from minidsa.kernels import fp8_gemm, norm_quant, reference

    dev = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "commit": args.commit, "inner": args.inner, "replays": args.replays,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(f"# RMSNorm + FP8 quantisation: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['date']}, commit {meta['commit']}", flush=True)

    def add_norm(x, residual, weight):
        return reference.rms_norm(residual + x, weight, 1e-6)

    def norm(x, weight):
        return reference.rms_norm(x, weight, 1e-6)

    compiled_add_norm = torch.compile(add_norm, dynamic=False)
    compiled_norm = torch.compile(norm, dynamic=False)
    rows: list[dict] = []
    failed = False
    for width, residual in CASES:
        for tokens in args.tokens:
            g = torch.Generator(device=dev).manual_seed(width + tokens)
            x = torch.randn(tokens, width, device=dev, generator=g).bfloat16()
            res = torch.randn(tokens, width, device=dev, generator=g).bfloat16() if residual else None
            weight = (1 + 0.2 * torch.randn(width, device=dev, generator=g)).bfloat16()
            old_norm = (lambda: compiled_add_norm(x, res, weight)) if residual else (lambda: compiled_norm(x, weight))
            paths = {
                "old": lambda: fp8_gemm.quant_act(old_norm()),
                "old norm only": old_norm,
                "new": lambda: norm_quant.rmsnorm_quant(x, weight, 1e-6, res),
            }
            row = {"width": width, "residual": residual, "tokens": tokens, "us": {}, "errors": {}}
            _, normed, q, s = paths["new"]()
            own_q, own_s = fp8_gemm.quant_act(normed)
            if not (torch.equal(s, own_s) and torch.equal(q.view(torch.uint8), own_q.view(torch.uint8))):
                row["errors"]["new"] = "e4m3 bytes or scales differ from quant_act of its own normed row"
                failed = True
            for name, fn in paths.items():
                try:
                    row["us"][name] = graph_us(fn, args.inner, args.replays)
                except Exception as e:  # noqa: BLE001 - recorded, not fatal
                    row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(f"W={width} residual={residual} T={tokens}: " + ", ".join(f"{n} {t:.1f}" for n, t in row["us"].items())
                  + (f"  ERRORS {row['errors']}" if row["errors"] else ""), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print()
    print("| width | add | tokens | old (norm + quant_act) | old norm only | new (one launch) | new / old |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        us = r["us"]
        ratio = f"{us['new'] / us['old']:.2f}" if "new" in us and "old" in us else "-"
        print(f"| {r['width']} | {'yes' if r['residual'] else 'no'} | {r['tokens']} | {us.get('old', float('nan')):.1f} "
              f"| {us.get('old norm only', float('nan')):.1f} | {us.get('new', float('nan')):.1f} | {ratio} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
