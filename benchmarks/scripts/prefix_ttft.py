"""Shared-prefix TTFT with and without the prefix cache, each measured twice in one process.

The second run of each engine has every kernel variant compiled already, so first-use
JIT costs (Triton specialisations for new shapes) cannot masquerade as cache effects.
Usage: python benchmarks/scripts/prefix_ttft.py [--model bench-dsv32] [--num-requests 64] [--max-model-len 8192]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from minidsa.bench.offline import run_bench
from minidsa.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench-dsv32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for cache in (True, False):
        eng = Engine(model=a.model, enable_prefix_caching=cache, enable_compile=False, cuda_graph_max_bs=64,
                     max_model_len=a.max_model_len, progress=False)
        for rep, seed in enumerate((0, 1)):  # seed 1: another system prompt, so it is computed again
            r = run_bench(eng, a.num_requests, seed=seed, progress=False, workload="shared-prefix")["results"]
            rows.append({"prefix_cache": cache, "run": rep, "ttft_mean_s": r["ttft_s"]["mean"],
                         "ttft_p99_s": r["ttft_s"]["p99"], "itl_p50_s": r["itl_s"]["p50"],
                         "duration_s": r["duration_s"], "out_tok_s": r["output_tokens_per_s"],
                         "hit_rate": (r.get("prefix_cache") or {}).get("hit_rate")})
            print(json.dumps(rows[-1]), flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
