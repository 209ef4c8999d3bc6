"""Engine start-up time by depth: each model built in a fresh process with an empty inductor cache.

    PYTHONPATH=. python3 benchmarks/startup.py --models tiny:4 tiny:61 --out $OUT

For each model: wall time of `LLM(model)` (weights, KV cache, torch.compile of one decoder layer per layer kind,
CUDA-graph capture of every batch bucket) and the engine's own breakdown line, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
t = time.perf_counter()
from minidsa import LLM
llm = LLM(model=sys.argv[1], progress=False, max_running_requests=int(sys.argv[2]), cuda_graph_max_bs=int(sys.argv[2]))
print("STARTUP_SECONDS", time.perf_counter() - t, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny:4", "tiny:61"])
    ap.add_argument("--max-bs", type=int, default=64, help="largest CUDA-graph batch bucket")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", CHILD, model, str(args.max_bs)], env=env, capture_output=True,
                               text=True)
            wall = time.perf_counter() - t
        lines = r.stdout.splitlines()
        inside = next((float(x.split()[1]) for x in lines if x.startswith("STARTUP_SECONDS")), None)
        breakdown = next((x for x in lines if x.startswith("start-up")), "")
        row = {"model": model, "process_s": round(wall, 1), "llm_s": inside and round(inside, 1),
               "breakdown": breakdown, "rc": r.returncode}
        if r.returncode:
            row["error"] = (r.stderr or r.stdout)[-1500:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0].get("llm_s")
    print("\n| model | LLM() s | process s | vs first | breakdown |\n|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['llm_s'] / base:.2f}x" if base and row.get("llm_s") else "-"
        print(f"| {row['model']} | {row.get('llm_s')} | {row['process_s']} | {ratio} | {row['breakdown']} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "startup.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
