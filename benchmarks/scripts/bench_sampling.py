"""Sampling at DeepSeek's vocabulary (129280): the torch exponential race vs the one-pass Triton kernel.

Times `sampling.sample` as the worker calls it (eager, outside the CUDA graph: launches included) at temperature
1 with no filters (the default request), and the race alone, per batch size, both implementations in one run.

    python benchmarks/scripts/bench_sampling.py --out /tmp/out [--batches 1,8,32,64,128]

Writes sampling.json and sampling.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time

import torch

from minidsa.bench.decode_suite import time_cuda
from minidsa.common.request import SamplingParams
from minidsa.common.sampling import SamplingBatch, race_for, sample

VOCAB = 129280


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--batches", default="1,8,32,64,128")
    args = p.parse_args(argv)
    rows = []
    for bs in [int(b) for b in args.batches.split(",")]:
        logits = torch.randn(bs, VOCAB, device="cuda").bfloat16()
        params = [SamplingParams(temperature=1.0).validate()] * bs
        sb = SamplingBatch.build(params, [0] * bs, random.Random(0), VOCAB, "cuda")
        row = {"batch": bs}
        for impl in ("torch", "triton"):
            race = race_for(impl)
            row[f"sample_{impl}_us"] = time_cuda(lambda: sample(logits, sb, race), iters=200, warmup=10) * 1e6
        row["ratio"] = row["sample_torch_us"] / row["sample_triton_us"]
        row["same_ids"] = bool(torch.equal(sample(logits, sb, race_for("torch"))[0],
                                           sample(logits, sb, race_for("triton"))[0]))
        rows.append(row)
        print(row, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": os.environ.get("MINIDSA_COMMIT", commit),
              "vocab": VOCAB, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = [f"# Sampling, temperature 1, vocab {VOCAB} ({result['device']}, {result['date']}, {result['commit']})", "",
          "| batch | torch race (us) | one-pass Triton (us) | ratio | same ids |", "|---|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['sample_torch_us']:.1f} | {r['sample_triton_us']:.1f} | {r['ratio']:.2f} | "
           f"{r['same_ids']} |" for r in rows]
    with open(os.path.join(args.out, "sampling.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
