"""The host cost of a DP-attention step's results reaching rank 0 over the gloo control group:
`torch.distributed.gather_object` (what minidsa did: two collectives, the sizes then the padded data) against
`minidsa.parallel.channel.ResultChannel` (one fixed-size gather; the rest of a long result point to point), with a
decode step's result of --requests token ids per rank. No GPU: the control group is gloo on the host either way.

    PYTHONPATH=. python3 benchmarks/scripts/bench_result_channel.py --ranks 2 4 --out /tmp/rc

Prints and writes (--out) us per step, the median of --repeats rounds of --steps steps, rank 0's clock.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp


def _result(rank: int, requests: int) -> dict:
    """What a decode step's StepResult carries, as plain data of about its size."""
    return {"rank": rank, "token_ids": [[1000 + i] for i in range(requests)], "finished": [False] * requests,
            "logprobs": None}


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from minidsa.parallel.channel import ResultChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    channel = ResultChannel(SimpleNamespace(rank=rank, world_size=world, control_group=group))
    mine = _result(rank, args.requests)
    timings: dict[str, list[float]] = {"gather_object": [], "ResultChannel": []}
    for _ in range(args.repeats):
        for name in timings:
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(args.steps):
                if name == "gather_object":
                    out = [None] * world if rank == 0 else None
                    dist.gather_object(mine, out, dst=0, group=group)
                elif rank == 0:
                    out = channel.gather(mine)
                else:
                    channel.send(mine)
            timings[name].append((time.perf_counter() - start) / args.steps * 1e6)
    if rank == 0:
        assert out == [_result(r, args.requests) for r in range(world)]
        queue.put({name: statistics.median(v) for name, v in timings.items()})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--requests", type=int, default=64, help="requests per rank in the step's result")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for world in args.ranks:
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        got = queue.get(timeout=600)
        for proc in procs:
            proc.join(60)
        row = {"ranks": world, "requests": args.requests, **got,
               "ratio": got["gather_object"] / got["ResultChannel"]}
        rows.append(row)
        print(f"{world} ranks: gather_object {got['gather_object']:.0f} us, ResultChannel {got['ResultChannel']:.0f} "
              f"us per step ({row['ratio']:.2f}x)", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result_channel.json"), "w") as f:
            json.dump({"host": socket.gethostname(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                       "command": "python3 benchmarks/scripts/bench_result_channel.py " + " ".join(sys.argv[1:]),
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
