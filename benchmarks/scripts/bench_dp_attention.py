"""Issue 49: one side of the data-parallel-attention comparison, on one engine: start-up, KV capacity, `minidsa bench`'s
default workload scaled by the side's GPU count, and the steady decode step at a few batches.

`scripts/gpu_check.sh dp_attention` runs it once per side on the same preset (one GPU; `--tp N`; `--tp N
--enable-dp-attention`) and benchmarks/scripts/dp_attention_page.py sets the sides side by side. One engine serves
all of a side's measurements (an engine's start is most of a side's time), in this order (the short ones first, so
that a side cut by its time limit keeps them):

1. start-up: the Engine's construction, wall seconds (weights, KV cache, capture, warm-up; rank 0 starts the other
   ranks inside it), with rank 0's phases; the KV capacity (`metrics().kv_total_tokens`: under DP attention the
   ranks' caches together); then --agreement prompts' greedy tokens (bench_speculative.py `greedy_outputs`: 256
   random tokens each, 64 out, seed 7 on every side), in one batch and one request at a time: the page compares the
   sides' tokens (DP attention against TP=N, beside each side's own batched-against-alone floor);
2. steady decode at each of --batches (benchmarks/scripts/bench_speculative.py `steady_decode`: B requests of
   --prompt-len random tokens, then the steps until each has --decode-tokens more): ms per step, output tok/s, ITL.
   A batch `N/gpu` is N times the side's GPU count: `64/gpu` is 256 requests at --tp 4 (64 per attention rank
   under DP attention), 64 on one GPU; a plain `N` is N requests on every side;
3. `minidsa bench` offline (minidsa/bench/offline.py `run_bench`, its warm-up included) on the device's default
   workload (256 requests, 100-1024 tokens in and out, seed 0 on a GPU) with --workload-scale times the requests
   (default: the side's GPU count, --tp); the same seed, so a scaled workload starts with the unscaled one's
   requests. The concurrency is the engine's --max-running-requests: per attention rank under DP attention, for the
   whole engine otherwise (the section scales it, and --cuda-graph-max-bs, for the TP side).

Writes --out/<--label>.json, rewritten after each stage so that a side cut by its time limit keeps what it measured.
On a CPU (`--allow-cpu`, with `--device cpu --dtype float32`) it is a smoke run whose figures mean nothing.

    PYTHONPATH=. python3 benchmarks/scripts/bench_dp_attention.py --out /tmp/dp --label dp4 \\
        --model bench-dsv32:10 --tp 4 --enable-dp-attention --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculative import ForwardTimer, greedy_outputs, steady_decode  # noqa: E402


def parse_batch(text: str) -> tuple[int, bool]:
    """`N` (N requests on every side) or `N/gpu` (N per GPU of the side) -> (N, per GPU)."""
    m = re.fullmatch(r"([1-9]\d*)(/gpu)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a batch is N or N/gpu, got {text!r}")
    return int(m.group(1)), m.group(2) is not None


def side_name(gpus: int, dp_attention: bool, two_batch: bool = False) -> str:
    if dp_attention:
        return f"DP attention {gpus}" + (" + two-batch overlap" if two_batch else "")
    return f"TP={gpus}" if gpus > 1 else "one GPU"


def run(args, write) -> dict:
    """The side's measurements, handed to `write` after each stage."""
    from minidsa.bench import offline
    from minidsa.cli import engine_config_from_args
    from minidsa.engine.core import Engine

    config = engine_config_from_args(args)
    gpus = config.tensor_parallel_size
    dp = config.enable_dp_attention
    two_batch = config.enable_two_batch_overlap
    result = {"label": args.label, "side": side_name(gpus, dp, two_batch), "gpus": gpus, "dp_attention": dp,
              "two_batch_overlap": two_batch, "two_batch_overlap_min_tokens": config.two_batch_overlap_min_tokens,
              "attention_ranks": gpus if dp else 1, "preset": args.model,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": offline.git_commit(),
              "command": "python3 benchmarks/scripts/bench_dp_attention.py " + " ".join(sys.argv[1:]),
              "max_running_requests": config.max_running_requests, "cuda_graph_max_bs": config.cuda_graph_max_bs}
    t0 = time.perf_counter()
    engine = Engine(config, progress=False)
    result["startup_s"] = time.perf_counter() - t0
    try:
        on_cuda = engine.runner.device.type == "cuda"
        result.update(device=torch.cuda.get_device_name() if on_cuda else "cpu", model=engine.model_name,
                      kv_total_tokens=engine.metrics().kv_total_tokens,
                      startup_phases=[[p.name, p.seconds, p.detail] for p in engine.runner.startup.phases])
        write(result)
        if args.agreement:
            result["greedy"] = greedy_outputs(engine, args.agreement, 64)
            result["greedy_alone"] = greedy_outputs(engine, args.agreement, 64, together=False)
            write(result)
        timer = ForwardTimer(engine.runner)
        result["decode"] = []
        for n, per_gpu in args.batches:
            bs = n * gpus if per_gpu else n
            r = steady_decode(engine, timer, bs, args.prompt_len, args.decode_tokens, seed=bs)
            r.update(batch_asked=f"{n}/gpu" if per_gpu else str(n), per_attention_rank=bs / result["attention_ranks"])
            result["decode"].append(r)
            write(result)
            print(f"decode batch {bs}: step {r['step_ms']:.3f} ms, {r['tok_per_s']:.0f} tok/s, ITL "
                  f"{r['itl_ms']:.3f} ms", flush=True)
        if not args.skip_bench:
            defaults = offline.GPU_DEFAULTS if on_cuda else offline.CPU_DEFAULTS
            requests = (args.num_requests or defaults["num_requests"]) * args.workload_scale
            bench = offline.run_bench(engine, requests, args.input_len, args.output_len, args.workload_seed,
                                      progress=False)
            result["bench"] = {"workload": bench["workload"], "workload_scale": args.workload_scale,
                               "results": bench["results"]}
            write(result)
            offline.print_summary(bench)
    finally:
        engine.close()
    return result


def main(argv: list[str] | None = None) -> int:
    from minidsa.cli import _length_range, add_engine_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--label", required=True, help="the side's name: its JSON is OUT/LABEL.json")
    p.add_argument("--workload-scale", type=int, default=None,
                   help="requests x this (default: the side's GPU count, --tp)")
    p.add_argument("--num-requests", type=int, default=None, help="before scaling; default the device's (256 on a GPU)")
    p.add_argument("--input-len", type=_length_range, default=None, metavar="N|MIN-MAX", help="default the device's")
    p.add_argument("--output-len", type=_length_range, default=None, metavar="N|MIN-MAX", help="default the device's")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--skip-bench", action="store_true", help="start-up, KV capacity and decode steps only")
    p.add_argument("--batches", type=parse_batch, nargs="+", default=[(1, False), (64, True)], metavar="N|N/gpu",
                   help="steady-decode batches (default: 1 64/gpu)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64, help="timed decode tokens per request")
    p.add_argument("--agreement", type=int, default=16, metavar="N",
                   help="greedy prompts compared across the sides (0: none)")
    p.add_argument("--allow-cpu", action="store_true", help="a smoke run without a GPU (the figures mean nothing)")
    add_engine_args(p)
    p.set_defaults(model="bench-dsv32:10")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.workload_scale is None:
        args.workload_scale = max(1, args.tensor_parallel_size or 1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.label}.json")

    def write(result: dict) -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)  # a reader (the page, after a timeout) never sees half a file

    write(run(args, write))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
