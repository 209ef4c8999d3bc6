"""The all-reduce of a decode step inside CUDA graphs: NCCL against minidsa's one-shot peer-to-peer kernel
(kernels/allreduce.py over CUDA IPC buffers, parallel/allreduce.py), per size; issue 48 part 2.

For each rank count (--ranks; default 2 and every visible GPU) this starts one process per GPU (torch.multiprocessing,
spawned with this process's environment: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set here where unset, never turned on), and for rows in --rows x 7168 bf16:
- checks, eagerly, that the one-shot result equals the fp32 sum in rank order rounded once to bf16 (exactly) and
  NCCL's within bf16 rounding;
- captures a CUDA graph of --per-graph chained all-reduces (each one's output the next one's input, as a decode
  step chains its layers) for each path, replays each --replays times in batches (a host barrier before each batch,
  so the ranks start together), and takes the median per all-reduce; the slowest rank's median is reported.

Prints a table and writes allreduce_<gpu>_x<ranks>_<commit>.json (device, date, commit, environment, per-size us,
and `recommended_max_bytes`: the largest size up to which the one-shot kernel is faster at every measured size,
the value for `ONE_SHOT_MAX_BYTES` in minidsa/kernels/allreduce.py) into --out. Under 3 minutes on 2-4 GPUs.
--sweep adds other launches of the kernel (tile, warps, programs) as columns, for tuning `Launch`;
--torch-symm-mem adds torch's symmetric-memory all-reduces that need no multicast (`one_shot_all_reduce_copy`, and
`two_shot_all_reduce_out` after a copy into the symmetric buffer) as columns, for comparison.

    python benchmarks/scripts/bench_allreduce.py [--ranks 2 4] [--rows 1 2 4 ...] [--sweep] [--torch-symm-mem] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

HIDDEN = 7168
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_S = 150  # one rank count, start to finish: a kernel that never returns ends the run, it does not hang it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def _time_graph(graph: torch.cuda.CUDAGraph, per_graph: int, replays: int, batch: int, barrier) -> list[float]:
    """us per all-reduce of each batch of `batch` replays (a barrier before each batch)."""
    out = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(max(1, replays // batch)):
        barrier()
        start.record()
        for _ in range(batch):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (batch * per_graph))
    return out


def _capture(fn, x: torch.Tensor, per_graph: int) -> torch.cuda.CUDAGraph:
    """A graph of `per_graph` chained calls of fn, starting from the static input x."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (NCCL and Triton set themselves up eagerly)
        y = x
        for _ in range(2):
            y = fn(y)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(per_graph):
            y = fn(y)
    torch.cuda.synchronize()
    return graph


def _rank(rank: int, world: int, args: argparse.Namespace, result_path: str) -> None:
    import torch.distributed as dist

    from minidsa.kernels import allreduce as kernel
    from minidsa.parallel.allreduce import gather_on, start_peer_all_reduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    control = dist.new_group(backend="gloo")
    group_name = dist.group.WORLD.group_name
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # the communicator is made here, not inside a capture
    torch.cuda.synchronize()
    max_bytes = max(args.rows) * HIDDEN * 2
    made = start_peer_all_reduce(rank, world, device, gather_on(control, world), True, max_bytes=max_bytes,
                                 log=False)
    if made.buffers is None:
        raise RuntimeError(f"rank {rank}: the one-shot all-reduce cannot serve here: {made.why}")
    peer = made.buffers

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group=control)

    def nccl(t):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, "sum", group_name))

    def one_shot(t):
        return torch.ops.minidsa.all_reduce(t, group_name, peer.buffer_ptrs, peer.signal_ptrs, peer.rank, peer.world,
                                            peer.capacity, peer.max_bytes)

    torch_paths, symm_why = _torch_symm_mem(args, device, group_name, world, control)
    extra_paths = {**torch_paths}
    for launch in (_launches() if args.sweep else ()):  # other launches of the kernel (--sweep)
        extra_paths[_label(launch)] = functools.partial(
            lambda t, launch: kernel.one_shot_all_reduce(t, peer.buffer_ptrs, peer.signal_ptrs, peer.rank,
                                                         peer.world, peer.capacity, launch=launch), launch=launch)
    rows_out = []
    for rows in args.rows:
        g = torch.Generator(device=device).manual_seed(1000 * rank + rows)
        x = torch.randn(rows, HIDDEN, device=device, generator=g).to(torch.bfloat16)
        # correctness, eagerly: exact against the fp32 sum in rank order, within bf16 rounding against NCCL
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        fp32 = torch.zeros(rows, HIDDEN, device=device)
        for t in every:
            fp32 += t.float()
        want = fp32.to(torch.bfloat16)
        got, ref = one_shot(x), nccl(x)
        exact = bool(torch.equal(got, want))
        err = (got.float() - ref.float()).abs()
        diff = err.max().item()
        # NCCL rounds its partial sums to bf16 on the way (more ranks, more roundings): within 2^-7 of the terms
        ok = exact and bool((err <= sum(t.float().abs() for t in every) * 2.0**-7).all())
        # timing, inside CUDA graphs, interleaved path by path
        graphs = {"nccl": _capture(nccl, x, args.per_graph), "one_shot": _capture(one_shot, x, args.per_graph)}
        extra_diff = {}
        for name, fn in extra_paths.items():  # torch's symmetric-memory ops, other launches: for comparison
            extra_diff[name] = (fn(x).float() - ref.float()).abs().max().item()
            graphs[name] = _capture(fn, x, args.per_graph)
        for graph in graphs.values():
            graph.replay()
        times = {name: [] for name in graphs}
        for _ in range(2):
            for name, graph in graphs.items():
                times[name] += _time_graph(graph, args.per_graph, args.replays // 2, args.batch, barrier)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        # the graphs hold their pools: drop them before the next size
        del graphs
        torch.cuda.synchronize()
        rows_out.append(dict(rows=rows, bytes=rows * HIDDEN * 2, nccl_us=med["nccl"], one_shot_us=med["one_shot"],
                             **{f"{name}_us": med[name] for name in extra_paths},
                             **{f"{name}_max_abs_diff_vs_nccl": d for name, d in extra_diff.items()},
                             exact_vs_fp32_sum=exact, max_abs_diff_vs_nccl=diff, ok=ok))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows_out, group=control)
    if rank == 0:
        worst = []
        for i, r in enumerate(rows_out):
            per = [g[i] for g in gathered]
            worst.append(dict(r, nccl_us=max(p["nccl_us"] for p in per),
                              one_shot_us=max(p["one_shot_us"] for p in per),
                              exact_vs_fp32_sum=all(p["exact_vs_fp32_sum"] for p in per),
                              max_abs_diff_vs_nccl=max(p["max_abs_diff_vs_nccl"] for p in per),
                              ok=all(p["ok"] for p in per),
                              **{f"{name}_us": max(p[f"{name}_us"] for p in per) for name in extra_paths},
                              **{f"{name}_max_abs_diff_vs_nccl": max(p[f"{name}_max_abs_diff_vs_nccl"] for p in per)
                                 for name in extra_paths}))
        with open(result_path, "w") as f:
            json.dump(dict(results=worst, capacity=peer.capacity, default_max_bytes=kernel.ONE_SHOT_MAX_BYTES,
                           torch_symm_mem=symm_why, default_launch=_label(kernel.DEFAULT_LAUNCH)), f)
    barrier()
    dist.destroy_process_group()


def _label(launch) -> str:
    return f"b{launch.block}w{launch.num_warps}p{launch.max_programs}"


def _launches():
    from minidsa.kernels.allreduce import Launch

    return (Launch(512, 2, 64), Launch(1024, 4, 64), Launch(1024, 4, 128), Launch(2048, 8, 32),
            Launch(2048, 8, 128), Launch(4096, 8, 64), Launch(4096, 16, 128))


def _torch_symm_mem(args, device, group_name: str, world: int, control) -> tuple[dict, str | None]:
    """torch's symmetric-memory all-reduces that need no multicast (`symm_mem.one_shot_all_reduce_copy`, and
    `two_shot_all_reduce_out` after a copy into the symmetric buffer), where --torch-symm-mem asks for them:
    ({name: fn}, None) or ({}, why not), the same on every rank."""
    if not args.torch_symm_mem:
        return {}, "not measured (--torch-symm-mem)"
    import torch.distributed as dist

    buf, why = None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op or absent later
            symm_mem.enable_symm_mem_for_group(group_name)
        buf = symm_mem.empty(max(args.rows) * HIDDEN, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group_name)
        why = f"backend {symm_mem.get_backend(device) if hasattr(symm_mem, 'get_backend') else '?'}"
    except Exception as e:  # noqa: BLE001
        why = f"unavailable: {type(e).__name__}: {e}"
    every = [None] * world
    dist.all_gather_object(every, why, group=control)
    bad = [w for w in every if w.startswith("unavailable")]
    if bad:
        return {}, bad[0]

    def torch_one_shot(t):
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:t.numel()].view_as(t), t, "sum", group_name)

    def torch_two_shot(t):
        staged = buf[:t.numel()].view_as(t)
        staged.copy_(t)
        return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, torch.empty_like(t))

    return {"torch_one_shot": torch_one_shot, "torch_two_shot": torch_two_shot}, why


def recommended_max_bytes(results: list[dict]) -> int:
    """The largest size up to which the one-shot kernel is faster than NCCL at every measured size, and correct;
    0 if it is not faster at the smallest."""
    best = 0
    for r in sorted(results, key=lambda r: r["bytes"]):
        if not r["ok"] or r["one_shot_us"] >= r["nccl_us"]:
            break
        best = r["bytes"]
    return best


def spawn_ranks(rank_fn, world: int, args: argparse.Namespace, timeout_s: float) -> dict:
    """rank_fn(rank, world, args, result_path) in `world` spawned processes (this environment, a fresh port); the JSON
    rank 0 wrote at result_path. The ranks are killed past timeout_s (a collective that never returns ends the run,
    not the call) and when this process is interrupted (SIGTERM raises SystemExit where main installs it)."""
    import torch.multiprocessing as mp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(rank_fn, args=(world, args, path), nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {timeout_s} s (a wait that never ended?)")
        except BaseException:  # a timeout here, or the caller's (SIGTERM): no rank keeps its GPU
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        with open(path) as f:
            return json.load(f)


def run(world: int, args: argparse.Namespace) -> dict:
    return spawn_ranks(_rank, world, args, TIMEOUT_S)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default: 2 and every GPU)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--per-graph", type=int, default=20, help="chained all-reduces in one CUDA graph")
    p.add_argument("--replays", type=int, default=200, help="timed replays per path and size")
    p.add_argument("--batch", type=int, default=10, help="replays back to back between two host barriers")
    p.add_argument("--sweep", action="store_true",
                   help="also time other launches of the kernel (tile, warps, programs: kernels/allreduce.py Launch)")
    p.add_argument("--torch-symm-mem", action="store_true",
                   help="also time torch's symmetric-memory one-shot and two-shot all-reduces (no multicast)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"needs 2 GPUs, {gpus} visible")
        return 1
    ranks = args.ranks or sorted({2, gpus})
    name = torch.cuda.get_device_name(0)
    commit = _commit()
    os.makedirs(args.out, exist_ok=True)
    status = 0
    for world in ranks:
        t0 = time.monotonic()
        res = run(world, args)
        results = res["results"]
        rec = recommended_max_bytes(results)
        print(f"\n{name} x{world}, CUDA graphs of {args.per_graph} chained all-reduces, us per all-reduce "
              f"(slowest rank's median), {time.monotonic() - t0:.0f} s")
        extra = [k[:-3] for k in results[0] if k.endswith("_us") and k not in ("nccl_us", "one_shot_us")]
        print(f"{'rows':>5} {'bytes':>9} {'NCCL':>8} {'one-shot':>9} {'speed-up':>9} "
              + "".join(f"{e:>15}" for e in extra) + "  check")
        for r in results:
            check = "ok" if r["ok"] else \
                f"FAILED (exact {r['exact_vs_fp32_sum']}, vs NCCL {r['max_abs_diff_vs_nccl']:.3g})"
            print(f"{r['rows']:>5} {r['bytes']:>9} {r['nccl_us']:>8.2f} {r['one_shot_us']:>9.2f} "
                  f"{r['nccl_us'] / r['one_shot_us']:>8.2f}x " + "".join(f"{r[e + '_us']:>15.2f}" for e in extra)
                  + f"  {check}")
        print(f"torch symmetric memory: {res['torch_symm_mem']}")
        print(f"recommended ONE_SHOT_MAX_BYTES at {world} ranks: {rec} ({rec // (HIDDEN * 2)} rows x {HIDDEN} bf16); "
              f"now {res['default_max_bytes']}")
        status |= 0 if all(r["ok"] for r in results) else 2
        record = dict(device=name, gpus=world, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                      commit=commit, torch=torch.__version__, cuda=torch.version.cuda,
                      triton=_version("triton"), env={k: os.environ.get(k) for k in NO_MULTICAST},
                      hidden=HIDDEN, dtype="bfloat16", per_graph=args.per_graph, replays=args.replays,
                      batch=args.batch, results=results, recommended_max_bytes=rec,
                      current_max_bytes=res["default_max_bytes"], launch=res["default_launch"],
                      torch_symm_mem=res["torch_symm_mem"],
                      command=" ".join([os.path.basename(sys.executable), *sys.argv]))
        short = name.replace("NVIDIA ", "").split()[0].lower()
        path = os.path.join(args.out, f"allreduce_{short}_x{world}_{commit}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}")
    return status


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
