"""The fp32 GEMVs of a DeepSeek-V3.2 layer: the torch path (x.float(), cuBLAS's F.linear, the scale) against the
Triton op (kernels/gemv.py), side by side, at decode token counts.

- indexer weights_proj: N = 64, K = 7168, times the indexer's weight scale;
- router gate:          N = 256, K = 7168.
x is bf16 [T, 7168], the weights fp32. Each timing is the median of CUDA-graph replays over copies of the weight
that exceed L2 (the time a decode step pays: each call reads its weight from HBM, no host launch cost).
GB/s = weight bytes / time. --sweep also times other tile configs for the Triton op (best one reported).

    python benchmarks/scripts/bench_gemv.py [--tokens 1 2 4 8 16 32] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = [("indexer weights_proj", 64, 7168, 64**-0.5 * 128**-0.5), ("router gate", 256, 7168, 1.0)]
ROTATE_BYTES = 256 << 20  # weights cycled through per timing: several times the 50 MB L2


def tile_candidates(t: int, n: int, k: int):
    """The default pick first, then variations of its block N, block K, split and pipeline depth."""
    from minidsa.kernels import gemv
    base = gemv.pick_tiles(t, n, k)
    seen = [base]
    for block_n in (base.block_n // 2, base.block_n * 2):
        for split in (base.split_k // 2, base.split_k, min(gemv.MAX_SPLIT, base.split_k * 2)):
            for stages in (1, 3):
                if block_n < 1 or split < 1:
                    continue
                c = dataclasses.replace(base, block_n=block_n, split_k=split, num_stages=stages)
                if c not in seen:
                    seen.append(c)
    for block_k in (base.block_k // 2, base.block_k * 2):
        if block_k >= 16 and base.block_t * base.block_n * block_k <= (1 << 16):
            c = dataclasses.replace(base, block_k=block_k)
            if c not in seen:
                seen.append(c)
    return seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--budget", type=float, default=0.05, help="seconds of timed repeats per measurement")
    p.add_argument("--sweep", action="store_true", help="also time other Triton tile configs (best one reported)")
    args = p.parse_args(argv)

    from minidsa.bench import decode_suite as perf
    from minidsa.kernels import custom_ops  # noqa: F401 - registers torch.ops.minidsa.fp32_gemv
    from minidsa.kernels import gemv

    dev = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name, n, k, scale in SHAPES:
        copies = max(1, -(-ROTATE_BYTES // (4 * n * k)))
        ws = [torch.randn(n, k, device=dev) * k**-0.5 for _ in range(copies)]
        for t in args.tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "N": n, "K": k, "T": t, "tiles": dataclasses.asdict(gemv.pick_tiles(t, n, k))}
            impls = {"torch": [lambda w=w: gemv.fp32_gemv_reference(x, w, scale) for w in ws],
                     "triton": [lambda w=w: torch.ops.minidsa.fp32_gemv(x, w, scale) for w in ws]}
            for impl, fns in impls.items():
                s = perf.graph_time(fns, budget_s=args.budget)
                row[impl] = {"us": s * 1e6, "GBps": 4 * n * k / s / 1e9}
            want = gemv.fp32_gemv_reference(x, ws[0], scale)
            got = torch.ops.minidsa.fp32_gemv(x, ws[0], scale)
            terms = (x.float().abs() @ ws[0].abs().T) * scale
            row["max_err_over_terms"] = ((got - want).abs() / terms).max().item()
            if args.sweep:
                best = None
                for tiles in tile_candidates(t, n, k):
                    try:
                        s = perf.graph_time([lambda w=w: gemv.fp32_gemv(x, w, scale, tiles) for w in ws],
                                            budget_s=args.budget / 4)
                    except Exception as e:  # a config the compiler refuses: report, keep sweeping
                        print(f"  {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    if best is None or s < best[0]:
                        best = (s, tiles)
                if best:
                    row["sweep_best"] = {"us": best[0] * 1e6, "GBps": 4 * n * k / best[0] / 1e9,
                                         "tiles": dataclasses.asdict(best[1])}
            rows.append(row)
            cells = " ".join(f"{i}={row[i]['us']:.2f}us ({row[i]['GBps']:.0f} GB/s)"
                             for i in ("torch", "triton", "sweep_best") if row.get(i))
            print(f"{name:22s} T={t:3d} {cells} err/terms={row['max_err_over_terms']:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()

    impls = ["torch", "triton"] + (["sweep_best"] if args.sweep else [])
    lines = [f"# fp32 GEMVs ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}. Time in us (weight GB/s), CUDA-graph replays over weight copies past L2. "
             "torch: x.float(), F.linear, the scale; triton: torch.ops.minidsa.fp32_gemv (one launch).", "",
             "| GEMV | N x K | T | " + " | ".join(impls) + " | triton tiles |",
             "|---|---|---|" + "---|" * len(impls) + "---|"]
    for r in rows:
        cells = [f"{r[i]['us']:.2f} ({r[i]['GBps']:.0f})" if r.get(i) else "-" for i in impls]
        t = r["tiles"]
        tiles = f"{t['block_t']}x{t['block_n']}x{t['block_k']} split {t['split_k']}"
        lines.append(f"| {r['shape']} | {r['N']}x{r['K']} | {r['T']} | " + " | ".join(cells) + f" | {tiles} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
