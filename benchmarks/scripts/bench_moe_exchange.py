"""Issue 49: the MoE exchange of one decode step under data-parallel attention, what minidsa does (all-gather +
reduce-scatter) against an all-to-all dispatch / combine, per size.

Under `--enable-dp-attention` each MoE layer all-gathers every rank's rows, the replicated router and this rank's
experts work on all of them, and a reduce-scatter hands each rank its own rows back (minidsa/models/deepseek_v32.py
`MoE._forward_dp`, through `TensorParallel.all_gather_rows` / `reduce_scatter_rows`, which this script calls). An
all-to-all instead sends each token only to the ranks holding one of its experts and brings one row back from each.
One process per rank (torch.multiprocessing, spawned as benchmarks/scripts/bench_allreduce.py does, with its
NCCL_NVLS_ENABLE=0 and the other two multicast switches set where unset), and for --rows rows per rank x --hidden
(7168, bf16), with random routing (top --top-k of --experts, experts placed whole, --experts / N per rank in order as
under DP attention), three exchanges:

- ag_rs: all_gather_rows, this rank's experts' share of every row, reduce_scatter_rows (minidsa today);
- a2a: this rank's rows ordered by destination, each only to the ranks holding one of its experts (all_to_all_single,
  the functional op minidsa's collectives use: capturable), their share, all_to_all_single back, a sum per token.
  The splits are this routing's, fixed when the graph is captured: a served step would also exchange the counts
  first (a host sync) or pad, so this is the all-to-all's floor;
- a2a_padded: the same with each destination's block padded to --rows rows (static splits, capturable for any
  routing; as many rows on the wire as ag_rs).

The experts are a stand-in (no GEMM is timed): rank q's share of a row is the row times the sum of the routing
weights of its experts among the row's top-k. Checked eagerly first, exactly: with rows in {-1, 0, 1}, weights in
{1, 2} and rank q's share scaled by q + 1 (so a row summed from the wrong ranks shows), every partial sum is an integer
of at most 16 x ranks, exact in bf16 in any order up to 16 ranks, and each method's output must equal the reference
(each row times the sum over its experts of weight x (owner + 1)) bit for bit. Timing (weights normalised per row,
so a chain keeps its scale): on GPUs, a CUDA graph of --per-graph chained exchanges per method, --replays replays in
batches of --batch after a host barrier, the median per exchange, the slowest rank's median reported (NCCL); on a
CPU (`--device cpu`, gloo) each exchange eagerly, no graphs: a smoke run whose figures mean nothing
(tests/test_multi_gpu_scripts.py).

Prints a table and writes moe_exchange.json (device, date, commit, environment, per size: us per method, the
fastest, rows dispatched, equal) into --out. Not run on GPUs yet: about a minute on 4 is an estimate.

    python3 benchmarks/scripts/bench_moe_exchange.py [--ranks 4] [--rows 1 16 64 128 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_allreduce import NO_MULTICAST, ROOT, _capture, _commit, _time_graph, _version, spawn_ranks  # noqa: E402

HIDDEN = 7168
ROWS = (1, 16, 64, 128, 256)
METHODS = ("ag_rs", "a2a", "a2a_padded")
TIMEOUT_S = 240  # start to finish; a collective that never returns ends the run


def expert_shares(world: int, rows: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """[world * rows, world] int64: per token (rank-major), the sum of its top-k experts' weights (1 or 2 each) held
    by each rank. The same on every rank (a seeded CPU generator), as the replicated router's choice is."""
    g = torch.Generator().manual_seed(seed)
    tokens = world * rows
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices  # distinct experts per token
    weights = torch.randint(1, 3, (tokens, top_k), generator=g)
    owner = ids // (experts // world)
    return torch.zeros(tokens, world, dtype=torch.long).scatter_add_(1, owner, weights)


def check_weights(shares: torch.Tensor) -> torch.Tensor:
    """Rank q's share scaled by q + 1: a row that reaches the wrong ranks sums to another integer."""
    return shares * torch.arange(1, shares.shape[1] + 1)


def exchanges(tp, weight: torch.Tensor, rows: int) -> tuple[dict, int]:
    """The three exchanges of this rank's [rows, H] for the per-(token, rank) shares `weight` [world * rows, world]
    (on the device, in the rows' dtype): ({name: fn(x) -> [rows, H]}, the rows this rank sends in the all-to-all's
    dispatch, itself included). Routing-derived indices are made here, once, outside what is timed (a served step's
    dispatch would make them from the router's top-k)."""
    rank, world, group = tp.rank, tp.size, tp.group_name
    device = weight.device
    mine = weight[:, rank:rank + 1]  # this rank's share of every gathered row
    own = weight[rank * rows:(rank + 1) * rows]  # this rank's tokens' shares per destination
    goes = own != 0
    send_counts = goes.sum(0).tolist()
    send_index = torch.cat([torch.nonzero(goes[:, q]).flatten() for q in range(world)])
    comes = (weight[:, rank] != 0).view(world, rows)  # which of each source's tokens have a share here
    recv_counts = comes.sum(1).tolist()
    recv_weight = weight[:, rank][comes.flatten()][:, None]  # source-major, each source's token order: as sent
    # padded: block q holds the tokens going to q, then index `rows` (a zero row appended to x) up to `rows`
    pad_index = torch.full((world, rows), rows, dtype=torch.long, device=device)
    pad_weight = torch.zeros(world, rows, 1, dtype=weight.dtype, device=device)
    for q in range(world):
        pad_index[q, :send_counts[q]] = torch.nonzero(goes[:, q]).flatten()
        pad_weight[q, :recv_counts[q], 0] = weight[q * rows:(q + 1) * rows, rank][comes[q]]
    pad_index, pad_weight = pad_index.flatten(), pad_weight.view(world * rows, 1)
    equal = [rows] * world

    def all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = torch.ops._c10d_functional.all_to_all_single(t.contiguous(), out_splits, in_splits, group)
        return torch.ops._c10d_functional.wait_tensor(out)

    def ag_rs(x):
        return tp.reduce_scatter_rows(tp.all_gather_rows(x) * mine)

    def a2a(x):
        got = all_to_all(x.index_select(0, send_index), recv_counts, send_counts)  # dispatch
        back = all_to_all(got * recv_weight, send_counts, recv_counts)  # combine
        return x.new_zeros(x.shape).index_add_(0, send_index, back)

    def a2a_padded(x):
        sent = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, pad_index)
        back = all_to_all(all_to_all(sent, equal, equal) * pad_weight, equal, equal)
        return x.new_zeros(rows + 1, x.shape[1]).index_add_(0, pad_index, back)[:rows]

    return {"ag_rs": ag_rs, "a2a": a2a, "a2a_padded": a2a_padded}, sum(send_counts)


def _time_eager(fn, x: torch.Tensor, replays: int, barrier) -> list[float]:
    """us per call, one call at a time after a barrier (CPU smoke runs: no graphs)."""
    out = []
    for _ in range(replays):
        barrier()
        t0 = time.perf_counter()
        fn(x)
        out.append(1e6 * (time.perf_counter() - t0))
    return out


def _rank(rank: int, world: int, args: argparse.Namespace, result_path: str) -> None:
    import torch.distributed as dist

    from minidsa.common.tensor_parallel import TensorParallel

    on_cuda = args.device == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    control = dist.new_group(backend="gloo")
    tp = TensorParallel(rank=rank, size=world, group_name=dist.group.WORLD.group_name, expert_parallel=True,
                        dp_attention=True)
    dtype = getattr(torch, args.dtype)
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # the communicator is made here, not inside a capture

    def barrier():
        if on_cuda:
            torch.cuda.synchronize()
        dist.barrier(group=control)

    rows_out = []
    for rows in args.rows:
        shares = expert_shares(world, rows, args.experts, args.top_k, seed=rows)
        weight = check_weights(shares)
        g = torch.Generator().manual_seed(1000 * rank + rows)
        x = torch.randint(-1, 2, (rows, args.hidden), generator=g).to(device=device, dtype=dtype)
        want = x * weight[rank * rows:(rank + 1) * rows].sum(1, keepdim=True).to(device=device, dtype=dtype)
        check, dispatch_rows = exchanges(tp, weight.to(device=device, dtype=dtype), rows)
        equal = {name: bool(torch.equal(check[name](x), want)) for name in METHODS}
        timed, _ = exchanges(tp, (weight / weight.sum(1, keepdim=True)).to(device=device, dtype=dtype), rows)
        x = torch.randn(rows, args.hidden, generator=g).to(device=device, dtype=dtype)
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        if on_cuda:
            graphs = {name: _capture(timed[name], x, args.per_graph) for name in METHODS}
            for graph in graphs.values():
                graph.replay()
            for _ in range(2):  # interleaved method by method
                for name, graph in graphs.items():
                    times[name] += _time_graph(graph, args.per_graph, args.replays // 2, args.batch, barrier)
            del graphs  # their memory pools, before the next size
            torch.cuda.synchronize()
        else:
            for _ in range(2):
                for name in METHODS:
                    times[name] += _time_eager(timed[name], x, max(1, args.replays // 2), barrier)
        rows_out.append(dict(rows=rows, bytes_per_rank=rows * args.hidden * x.element_size(),
                             **{f"{name}_us": statistics.median(times[name]) for name in METHODS},
                             dispatch_rows=dispatch_rows, equal=equal))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows_out, group=control)
    if rank == 0:
        results = []
        for i, r in enumerate(rows_out):
            per = [g[i] for g in gathered]
            slowest = {f"{m}_us": max(p[f"{m}_us"] for p in per) for m in METHODS}
            results.append(dict(r, **slowest, fastest=min(METHODS, key=lambda m: slowest[f"{m}_us"]),
                                dispatch_rows_mean=statistics.mean(p["dispatch_rows"] for p in per),
                                gathered_rows=world * r["rows"],
                                equal={m: all(p["equal"][m] for p in per) for m in METHODS}))
            results[-1].pop("dispatch_rows")
        with open(result_path, "w") as f:
            json.dump({"results": results}, f)
    barrier()
    dist.destroy_process_group()


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 22703) in older ones
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="rank count (default: every visible GPU; 2 on a CPU)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows per rank")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--experts", type=int, default=256, help="routed experts (DeepSeek-V3.2's 256)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (DeepSeek-V3.2's 8)")
    p.add_argument("--per-graph", type=int, default=20, help="chained exchanges in one CUDA graph")
    p.add_argument("--replays", type=int, default=200, help="timed replays per method and size")
    p.add_argument("--batch", type=int, default=10, help="replays back to back between two host barriers")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: NCCL, CUDA graphs; cpu: gloo, eager (a smoke run)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    # gpu_check's `timeout` sends SIGTERM: leave through spawn_ranks, which kills the ranks holding the GPUs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    on_cuda = args.device == "cuda"
    world = args.ranks or (torch.cuda.device_count() if on_cuda else 2)
    if world < 2 or (on_cuda and torch.cuda.device_count() < world):
        print(f"needs 2 or more ranks, one GPU each: {world} asked, {torch.cuda.device_count()} GPUs visible")
        return 1
    if world > 16:
        print(f"{world} ranks: the exact check holds up to 16 (bf16 integers above 256 round)")
        return 1
    if args.experts % world:
        print(f"--experts {args.experts} does not split over {world} ranks")
        return 1
    name = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    commit = os.environ.get("MINIDSA_COMMIT") or _commit()
    t0 = time.monotonic()
    results = spawn_ranks(_rank, world, args, TIMEOUT_S)["results"]
    how = f"CUDA graphs of {args.per_graph} chained exchanges" if on_cuda else "eager, gloo (smoke run)"
    print(f"\n{name} x{world}, {args.hidden} x {args.dtype} rows, top-{args.top_k} of {args.experts} experts, {how}; "
          f"us per exchange (slowest rank's median), {time.monotonic() - t0:.0f} s")
    print(f"{'rows':>5} {'ag_rs':>9} {'a2a':>9} {'a2a_pad':>9} {'a2a/ag_rs':>10} {'dispatched':>11}  fastest  equal")
    for r in results:
        print(f"{r['rows']:>5} {r['ag_rs_us']:>9.2f} {r['a2a_us']:>9.2f} {r['a2a_padded_us']:>9.2f} "
              f"{r['a2a_us'] / r['ag_rs_us']:>9.2f}x {r['dispatch_rows_mean']:>6.1f}/{r['gathered_rows']:<4} "
              f"{r['fastest']:>8}  {'yes' if all(r['equal'].values()) else 'NO ' + str(r['equal'])}")
    record = dict(device=name, gpus=world if on_cuda else 0, ranks=world,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                  torch=torch.__version__, cuda=torch.version.cuda,
                  nccl=_nccl_version() if on_cuda else None, triton=_version("triton"),
                  env={k: os.environ.get(k) for k in NO_MULTICAST}, backend="nccl" if on_cuda else "gloo",
                  cuda_graphs=on_cuda, hidden=args.hidden, dtype=args.dtype, experts=args.experts, top_k=args.top_k,
                  per_graph=args.per_graph, replays=args.replays, batch=args.batch, results=results,
                  command=" ".join(["python3", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe_exchange.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    return 0 if all(all(r["equal"].values()) for r in results) else 2


if __name__ == "__main__":
    sys.exit(main())
