"""FP8 block-scaled GEMM at the real models' projection shapes: Triton w8a8 vs bf16 vs per-tensor FP8 vs DeepGEMM.

For each projection (N x K) and M = tokens in the step:
- triton:    minidsa's w8a8 block-scaled GEMM (activation quantisation included), the model's FP8 path
- bf16:      torch.mm against a bf16 copy of the weight (what an unquantised model runs)
- scaled_mm: torch._scaled_mm with one scale per tensor (no block scales): a ceiling for FP8 tensor cores
- deepgemm:  deep_gemm.fp8_gemm_nt with 1x128 / 128x128 scales (activation quantisation included), if it imports

Small M is weight-bandwidth bound: GB/s = weight bytes / time (1 byte per FP8 weight, 2 per bf16). Large M is
compute bound: TFLOP/s = 2 M N K / time. Writes fp8_gemm.md and fp8_gemm.json under --out.

    python benchmarks/scripts/bench_fp8_gemm.py --out /tmp/out [--ms 1 8 32 128 256 2048 8192] [--shapes dsv32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = {  # name -> (N, K): the FP8 projections of one layer
    "dsv32": [
        ("q_a|wk|kv_a (fused)", 1536 + 128 + 576, 7168),
        ("q_b", 128 * 192, 1536),
        ("indexer wq_b", 64 * 128, 1536),
        ("q_b|wq_b (fused)", 128 * 192 + 64 * 128, 1536),
        ("o_proj", 7168, 128 * 128),
        ("dense gate|up", 2 * 18432, 7168),
        ("dense down", 7168, 18432),
        ("shared expert gate|up", 2 * 2048, 7168),
        ("shared expert down", 7168, 2048),
    ],
    "glm5": [
        ("q_a|wk|kv_a (fused)", 2048 + 128 + 576, 6144),
        ("q_b", 64 * 256, 2048),
        ("o_proj", 6144, 64 * 256),
        ("dense gate|up", 2 * 12288, 6144),
    ],
}


ROTATE_BYTES = 256 << 20  # weights cycled through per timing: several times the 50 MB L2


def copies_for(weight_bytes: int) -> int:
    """How many copies of a weight make a rotation larger than L2 (each call then reads it from HBM)."""
    return max(1, min(16, -(-ROTATE_BYTES // weight_bytes)))


def decode_tile_candidates(m: int, n: int, k: int, num_sms: int, wide: bool = False):
    """Tile configs tried for small M by --sweep (the default pick first); `wide` (--wide-sweep) adds narrow N
    tiles (16, 32), deeper pipelines and a doubled split-K."""
    from minidsa.kernels import fp8_gemm
    seen = [fp8_gemm.pick_tiles(m, n, k, num_sms)]
    num_kb = -(-k // 128)
    shapes = ((16, 64), (16, 128), (32, 64), (32, 128), (64, 64))
    if wide:
        shapes = ((16, 16), (16, 32)) + shapes
    for block_m, block_n in shapes:
        if block_m < m // 2 or block_m > max(16, 1 << (m - 1).bit_length()):
            continue
        n_tiles = -(-n // block_n)
        auto = max(1, -(-2 * num_sms // n_tiles))
        for split in sorted({1, 2, 4, auto} | ({2 * auto, max(1, auto // 2)} if wide else set())):
            if split > num_kb:
                continue
            for warps, stages in ((4, 3), (8, 4)) + (((4, 5), (8, 6), (2, 4)) if wide else ()):
                t = fp8_gemm.GemmTiles(block_m, block_n, split, True, warps, stages)
                if t not in seen:
                    seen.append(t)
    return seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 8, 32, 128, 256, 2048, 8192])
    p.add_argument("--shapes", nargs="+", default=["dsv32", "glm5"], choices=sorted(SHAPES))
    p.add_argument("--budget", type=float, default=0.05, help="seconds of timed repeats per measurement")
    p.add_argument("--sweep", action="store_true",
                   help="also time other Triton tile configs at M <= 64 (best one reported per shape)")
    p.add_argument("--wide-sweep", action="store_true",
                   help="--sweep over more configs (narrow N, deeper pipelines), x quantised before the GEMM")
    p.add_argument("--only", nargs="+", default=None, help="projection names to run (default: all of --shapes)")
    args = p.parse_args(argv)

    from minidsa.bench import decode_suite as perf
    from minidsa.kernels import deepgemm, fp8_gemm, num_sms
    from minidsa.kernels.fp8 import FP8_MAX, quant_block

    dev = torch.device("cuda")
    dg_module, dg = deepgemm.probe(dev, deepgemm.GEMM_API)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; DeepGEMM: {dg.reason}", flush=True)
    rows = []
    for family in args.shapes:
        for name, n, k in SHAPES[family]:
            if args.only and name not in args.only:
                continue
            w = torch.randn(n, k, device=dev) * 0.02
            nc = copies_for(n * k)
            wq, ws = zip(*[quant_block(w, pow2_scale=True) for _ in range(nc)])
            w_bf16 = [w.bfloat16() for _ in range(copies_for(2 * n * k))]
            w_scale = (w.abs().amax() / FP8_MAX).float()
            w_pt = [(w / w_scale).to(torch.float8_e4m3fn) for _ in range(nc)]
            del w
            for m in args.ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                impls = {
                    "triton": [lambda i=i: fp8_gemm.w8a8_block_gemm(x, wq[i], ws[i]) for i in range(nc)],
                    "bf16": [lambda i=i: torch.mm(x, w_bf16[i].t()) for i in range(len(w_bf16))],
                }
                m16 = -(-m // 16) * 16  # _scaled_mm wants multiples of 16
                x_pt = torch.zeros(m16, k, device=dev, dtype=torch.float8_e4m3fn)
                x_pt[:m] = x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                one = torch.ones((), device=dev)
                impls["scaled_mm"] = [lambda i=i: torch._scaled_mm(x_pt, w_pt[i].t(), scale_a=one, scale_b=w_scale,
                                                                   out_dtype=torch.bfloat16) for i in range(nc)]
                if dg.available:
                    impls["deepgemm"] = [lambda i=i: deepgemm.fp8_gemm_nt(dg_module, x, wq[i], ws[i])
                                         for i in range(nc)]
                sms = num_sms(dev)
                row = {"family": family, "shape": name, "N": n, "K": k, "M": m,
                       "tiles": fp8_gemm.pick_tiles(m, n, k, sms).__dict__}
                for impl, fns in impls.items():
                    try:
                        if impl == "deepgemm" and fns[0]() is None:
                            row[impl] = None
                            continue
                        t = perf.graph_time(fns, budget_s=args.budget)
                    except Exception as e:  # report, keep measuring the rest
                        row[impl] = None
                        row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:200]
                        continue
                    wbytes = n * k * (2 if impl == "bf16" else 1)
                    row[impl] = {"us": t * 1e6, "GBps": wbytes / t / 1e9, "TFLOPs": 2 * m * n * k / t / 1e12}
                if (args.sweep or args.wide_sweep) and m <= 64:
                    best, timed = None, []
                    # As the engine runs them at decode: the norm or the SwiGLU before the GEMM quantised x.
                    act = fp8_gemm.quant_act(x) if args.wide_sweep else None
                    for tiles in decode_tile_candidates(m, n, k, sms, args.wide_sweep):
                        try:
                            t = perf.graph_time([lambda i=i: fp8_gemm.w8a8_block_gemm(x, wq[i], ws[i], tiles, act)
                                            for i in range(nc)], budget_s=args.budget / 4)
                        except Exception:
                            continue
                        timed.append({"us": t * 1e6, **tiles.__dict__})
                        if best is None or t < best[0]:
                            best = (t, tiles)
                    if best:
                        row["sweep_best"] = {"us": best[0] * 1e6, "GBps": n * k / best[0] / 1e9,
                                             "tiles": best[1].__dict__}
                        row["sweep_default"] = timed[0] if timed else None  # pick_tiles' choice, timed as the rest
                        row["sweep"] = sorted(timed, key=lambda r: r["us"])[:12]
                rows.append(row)
                cells = " ".join(f"{i}={row[i]['us']:.1f}us" for i in [*impls, "sweep_best"] if row.get(i))
                print(f"{family} {name:24s} M={m:5d} {cells}", flush=True)
                del x, x_pt
            del wq, ws, w_bf16, w_pt
            torch.cuda.empty_cache()

    impls = ["triton", "bf16", "scaled_mm"] + (["deepgemm"] if dg.available else []) \
        + (["sweep_best"] if args.sweep or args.wide_sweep else [])
    lines = [f"# FP8 block-scaled GEMM ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}; DeepGEMM: {dg.reason}. Time in us; small M (<= 256): weight GB/s "
             "(FP8 1 B/weight, bf16 2 B); large M: TFLOP/s. triton and deepgemm include the per-token activation "
             "quantisation; scaled_mm is per-tensor FP8 (no block scales), a ceiling. Timed in CUDA graphs over "
             "copies of the weight that exceed L2 (the time a decode step pays; no host launch cost)."
             + (" sweep_best: the fastest Triton tile config tried at M <= 64 (in the JSON)." if args.sweep or args.wide_sweep else ""),
             "",
             "| model | projection | N x K | M | " + " | ".join(impls) + " | triton tiles |",
             "|---|---|---|---|" + "---|" * len(impls) + "---|"]
    for r in rows:
        cells = []
        for i in impls:
            v = r.get(i)
            if not v:
                cells.append("-")
            elif r["M"] <= 256:
                cells.append(f"{v['us']:.1f} ({v['GBps']:.0f} GB/s)")
            else:
                cells.append(f"{v['us']:.1f} ({v['TFLOPs']:.0f} TF/s)")
        t = r["tiles"]
        tiles = f"{t['block_m']}x{t['block_n']} split {t['split_k']}{' fused-q' if t['fuse_act_quant'] else ''}"
        lines.append(f"| {r['family']} | {r['shape']} | {r['N']}x{r['K']} | {r['M']} | " + " | ".join(cells)
                     + f" | {tiles} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "deepgemm": dg.reason, "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
