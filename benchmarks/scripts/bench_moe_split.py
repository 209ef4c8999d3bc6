"""The fused MoE's gate/up GEMM split along K (`fused_moe.gate_up_splits`) against unsplit, at the expert shapes of one
rank: DeepSeek-V3.2's 256 experts (top-8 of 4 of 8 groups, hidden 7168) with each expert's intermediate 2048 / N under
--tp N (N = 1, 2, 4, 8), FP8 weights, at decode batches. Both sides run in the same process, in CUDA graphs of 20 calls
(the whole op: alignment, quantisation, both GEMMs, the k-sum), interleaved; us per call, the median of 7 replays.

    PYTHONPATH=. python3 benchmarks/scripts/bench_moe_split.py --out /tmp/moe_split

Writes moe_split.json and moe_split.md (device, date, MINIDSA_COMMIT, command).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import E, H, graph_ms, make_router, routed  # noqa: E402

from minidsa.kernels import fp8, num_sms  # noqa: E402
from minidsa.kernels import fused_moe as fm  # noqa: E402


def weights(inter: int, device: torch.device) -> tuple:
    """Random finite e4m3 experts (bytes below 0x78: positive values up to 128; the values do not change the time)
    with 128x128 block scales."""
    g = torch.Generator(device=device).manual_seed(inter)

    def e4m3(*shape):
        return torch.randint(0, 0x78, shape, dtype=torch.uint8, device=device, generator=g).view(fp8.FP8_DTYPE)

    gate_up, down = e4m3(E, 2 * inter, H), e4m3(E, H, inter)
    gus = torch.full((E, *fp8.block_scale_shape(2 * inter, H)), 1e-4, device=device)
    dns = torch.full((E, *fp8.block_scale_shape(H, inter)), 1e-4, device=device)
    return gate_up, down, gus, dns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
              "commit": os.environ.get("MINIDSA_COMMIT", "unknown"), "torch": torch.__version__,
              "command": "python3 benchmarks/scripts/bench_moe_split.py " + " ".join(argv or sys.argv[1:]),
              "sms": num_sms(dev), "rows": []}
    router = make_router()
    for tp in args.tp:
        inter = 2048 // tp
        params = weights(inter, dev)
        for t in args.tokens:
            x, ids, w = routed(router, t, seed=t)
            ids = ids.int()
            cfg = fm.tile_config(t, ids.shape[1], E, fp8.FP8_DTYPE, x.dtype)
            blocks = fm.align_for(ids.numel())(ids, E, cfg.block_m).block_expert.numel()
            auto = fm.gate_up_splits(blocks * -(-inter // cfg.block_n), -(-H // 128), num_sms(dev), True)
            whole_cfg = fm.TileConfig(**{**cfg.__dict__, "gate_up_split_k": 1})
            split_cfg = fm.TileConfig(**{**cfg.__dict__, "gate_up_split_k": auto})
            outs = {}
            for name, c in (("whole", whole_cfg), ("split", split_cfg)):
                outs[name] = fm.fused_moe_triton(x, ids, w, *params, config=c)
            err = ((outs["split"].float() - outs["whole"].float()).norm() / outs["whole"].float().norm()).item()
            times = {"whole": [], "split": []}
            for _ in range(3):  # interleaved
                for name, c in (("whole", whole_cfg), ("split", split_cfg)):
                    times[name].append(1e3 * graph_ms(
                        lambda c=c, p=params: fm.fused_moe_triton(x, ids, w, *p, config=c)))
            row = {"tp": tp, "inter": inter, "tokens": t, "splits": auto,
                   "programs": blocks * -(-inter // cfg.block_n),
                   "whole_us": sorted(times["whole"])[1], "split_us": sorted(times["split"])[1], "rel_diff": err}
            row["speedup"] = row["whole_us"] / row["split_us"]
            result["rows"].append(row)
            print(row, flush=True)
        params = None
        torch.cuda.empty_cache()
    lines = [f"# Fused MoE gate/up split along K, one rank's experts (FP8, E {E}, H {H})", "",
             f"{result['device']} ({result['sms']} SMs), {result['date']}, commit {result['commit']}; "
             f"`{result['command']}`", "",
             "| --tp | I per rank | tokens | gate/up programs | splits | unsplit us | split us | speed-up | rel diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['tp']} | {r['inter']} | {r['tokens']} | {r['programs']} | {r['splits']} | "
                     f"{r['whole_us']:.1f} | {r['split_us']:.1f} | {r['speedup']:.2f}x | {r['rel_diff']:.1e} |")
    with open(os.path.join(args.out, "moe_split.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "moe_split.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
