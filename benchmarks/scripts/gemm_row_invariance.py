"""Are an fp32 GEMM's first rows the same bits when it runs on more rows? (GPU; prints, asserts nothing.)

A captured EXTEND graph runs a prefill of T tokens padded to its bucket's rows; eager runs T rows. cuBLAS may pick
another kernel, with another summation order, for the padded row count, and then the graph's values differ from
eager's in the last bits (TAIL.md section 10: q_b_proj | wq_b as one 672-wide GEMM on the tiny fp32 model, 261
tokens in the 384-token bucket). Shapes are the tiny model's by default.

    python benchmarks/scripts/gemm_row_invariance.py [--rows 261] [--bucket 384] [--k 48] [--widths 672 512 160]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=261)
    p.add_argument("--bucket", type=int, default=384)
    p.add_argument("--k", type=int, default=48)
    p.add_argument("--widths", type=int, nargs="+", default=[672, 512, 160])
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.bucket, args.k, device="cuda") * 0.3
    for n in args.widths:
        w = torch.randn(n, args.k, device="cuda") * 0.1
        alone, padded = F.linear(x[:args.rows], w), F.linear(x, w)[:args.rows]
        print(f"linear N={n} K={args.k}: {args.rows} rows alone vs in {args.bucket}: max |diff| "
              f"{(alone - padded).abs().max().item():.3e}, rows differing {(alone != padded).any(1).sum().item()}")
    # absorb_q's reference at prefill sizes: a per-head bmm over a strided slice of the fused GEMM's output
    q = torch.randn(args.bucket, 672, device="cuda")[:, 512:].view(args.bucket, 4, 40)[..., :24]
    w_uk = torch.randn(4, 24, 32, device="cuda")
    alone = torch.bmm(q[:args.rows].transpose(0, 1), w_uk)
    padded = torch.bmm(q.transpose(0, 1), w_uk)[:, :args.rows]
    print(f"bmm over the strided q slice: max |diff| {(alone - padded).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
