"""DeepGEMM vs Triton indexer logits, side by side on identical inputs (one GPU, one run).

    PYTHONPATH=. python3 benchmarks/scripts/bench_indexer.py --out $OUT      # DeepGEMM importable: both columns

For each shape (decode batch 1/8/64/128 at 8k/32k/128k, verify 2 and 4 tokens per request, one request's
prefill chunk) it times:
- "kernel": the kernel alone on prebuilt inputs (DeepGEMM: context lengths, block table and schedule made
  beforehand; Triton: `indexer.index_logits`, whose output allocation is part of the call);
- "served": what each layer of a step calls (DeepGEMM: `deepgemm.paged_index_logits` with the step's context
  lengths, block table and schedule made once per step for all layers, i.e. the kernel + the in-place mask of
  its undefined tail; Triton: `torch.ops.minidsa.index_logits`);
each both eagerly (`do_bench`: host launch overhead included when it exceeds the GPU time) and as a replay
of a CUDA graph holding one call (how decode, verify and draft steps run). L2 is flushed between runs either
way. Pieces of the DeepGEMM wrapper are timed alone (graph). Top-k sets (2048) of both on the same inputs
are compared. Results: a table on stdout, JSON and Markdown under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import triton

from minidsa.bench import decode_suite as perf
from minidsa.kernels import custom_ops, deepgemm, indexer  # noqa: F401  (custom_ops registers the ops)
from minidsa.kernels import reference as ref

DEV = torch.device("cuda")
H, D, PAGE, TOPK = 64, 128, 64, 2048


def do_bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def setup(num_reqs: int, ctx: int, seed: int = 0):
    """A paged fp8 indexer cache with `num_reqs` rows of `ctx` keys on shuffled pages (+ room for drafts)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages_per_row = -(-(ctx + 8) // PAGE)
    num_pages = num_reqs * pages_per_row + 1
    keys = (torch.randn(num_pages, PAGE, D, device=DEV, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(num_pages, PAGE, device=DEV, generator=g) * 0.02 + 0.01
    cache = torch.cat([keys.view(torch.uint8).view(num_pages, -1), scales.view(torch.uint8).view(num_pages, -1)], 1)
    perm = torch.randperm(num_pages - 1, device=DEV, generator=g)[: num_reqs * pages_per_row] + 1
    pos = torch.arange(pages_per_row * PAGE, device=DEV)
    pages = perm.view(num_reqs, pages_per_row)
    r2t = (pages[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    return cache.contiguous(), r2t


def queries(t: int, seed: int = 1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(t, H, D, device=DEV, generator=g)
    w = torch.rand(t, H, device=DEV, generator=g)
    return ref.quant_index_q(q, w, ref.hadamard_matrix(D, "cuda"))


class Table:
    def __init__(self, out: str | None):
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.out = out

    def add(self, **row) -> None:
        self.rows.append(row)
        print(" | ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        self.save()

    def save(self) -> None:
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "bench_indexer.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
        with open(os.path.join(self.out, "bench_indexer.md"), "w") as f:
            f.write(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [f"Indexer logits, DeepGEMM vs Triton: {m.get('device')}, {m.get('date')}, commit {m.get('commit')}, "
                 f"torch {m.get('torch')}, triton {m.get('triton')}, {m.get('deepgemm')}", "",
                 "| case | what | Triton eager | DeepGEMM eager | Triton graph | DeepGEMM graph | DG/Triton (graph) |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            if "triton_graph_ms" not in r:
                continue
            ratio = (r["deepgemm_graph_ms"] / r["triton_graph_ms"]) if r.get("deepgemm_graph_ms") else None
            lines.append(f"| {r['case']} | {r['what']} | {_ms(r.get('triton_eager_ms'))} | "
                         f"{_ms(r.get('deepgemm_eager_ms'))} | {_ms(r['triton_graph_ms'])} | "
                         f"{_ms(r.get('deepgemm_graph_ms'))} | {'-' if ratio is None else f'{ratio:.2f}'} |")
        extra = [r for r in self.rows if "triton_graph_ms" not in r]
        if extra:
            lines += ["", "| case | measure | value |", "|---|---|---|"]
            lines += [f"| {r['case']} | {r['what']} | {r['value']} |" for r in extra]
        return "\n".join(lines) + "\n"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f} us"


def both(fn) -> tuple[float | None, float | None]:
    """(eager ms, graph-replay ms) of fn; None where it failed (prefill paths sync with the host: no graph)."""
    eager = None
    try:
        eager = do_bench(fn)
        g = perf.capture_graph([fn])
        return eager, do_bench(g.replay)
    except Exception as e:  # a shape one side cannot take: recorded, the run goes on
        print(f"  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return eager, None


def topk_agreement(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    ia, ib = a.topk(k, dim=1).indices, b.topk(k, dim=1).indices
    same = 0
    for i in range(a.shape[0]):
        same += len(set(ia[i].tolist()) & set(ib[i].tolist()))
    return same / (a.shape[0] * k)


def paged_case(tab: Table, name: str, reqs: int, ctx: int, per_req: int, dg) -> None:
    cache, r2t = setup(reqs, ctx)
    t = reqs * per_req
    rows = torch.arange(reqs, device=DEV).repeat_interleave(per_req)
    tree = None
    if per_req > 1:  # verify: a chain of drafts after ctx cached keys, each seeing its ancestors
        kv_lens = torch.full((t,), ctx, device=DEV, dtype=torch.int32)
        tree = torch.tril(torch.ones(per_req, per_req, dtype=torch.bool, device=DEV)).repeat(reqs, 1)
    else:
        kv_lens = torch.full((t,), ctx, device=DEV, dtype=torch.int32)
    width = ctx + (per_req if tree is not None else 0)
    q, w = queries(t)

    tri_kernel = lambda: indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, tree, reqs)  # noqa: E731
    tri_served = lambda: torch.ops.minidsa.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, tree, reqs)  # noqa: E731
    te_k, tg_k = both(tri_kernel)
    te_s, tg_s = both(tri_served)
    de_k = dg_k = de_s = dg_s = None
    if dg is not None:
        vis_end = kv_lens if tree is None else kv_lens + tree.shape[1]
        ctx2 = deepgemm.context_lens_2d(vis_end)
        table = deepgemm.block_table(r2t, rows, width, PAGE)
        kv = cache.view(cache.shape[0], PAGE, 1, D + 4)
        q4, wf = q.contiguous().unsqueeze(1), w.float().contiguous()
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        sched = dg.get_paged_mqa_logits_metadata(ctx2, PAGE, sms)
        dg_kernel = lambda: dg.fp8_paged_mqa_logits(q4, kv, wf, ctx2, table, sched, width, False)  # noqa: E731
        meta = (ctx2, table, sched)
        # As a step serves it: per-step metadata made once for all layers (DSABackend.index_metadata).
        dg_served = lambda: deepgemm.paged_index_logits(dg, q, w, cache, PAGE, r2t, rows, kv_lens, width, tree, meta)  # noqa: E731
        de_k, dg_k = both(dg_kernel)
        de_s, dg_s = both(dg_served)
        logits = dg_kernel()
        pieces = {  # the first two run once per forward step (every layer shares them), the mask per layer
            "block table (per step)": lambda: deepgemm.block_table(r2t, rows, width, PAGE),
            "schedule (per step)": lambda: dg.get_paged_mqa_logits_metadata(ctx2, PAGE, sms),
            "tail mask in place (per layer)": lambda: indexer.mask_invisible_(logits, kv_lens, tree),
        }
        for piece, fn in pieces.items():
            _, gms = both(fn)
            tab.add(case=name, what=f"DeepGEMM wrapper piece: {piece} (graph)", value=_ms(gms))
        if t <= 256:
            a = dg_served()
            b = tri_kernel()
            agree = topk_agreement(a, b, min(TOPK, width))
            tab.add(case=name, what="top-k (2048) set agreement DeepGEMM vs Triton", value=f"{agree:.5f}")
    tab.add(case=name, what="kernel", triton_eager_ms=te_k, deepgemm_eager_ms=de_k, triton_graph_ms=tg_k,
            deepgemm_graph_ms=dg_k)
    tab.add(case=name, what="served", triton_eager_ms=te_s, deepgemm_eager_ms=de_s, triton_graph_ms=tg_s,
            deepgemm_graph_ms=dg_s)


def prefill_case(tab: Table, name: str, chunk: int, ctx: int, dg) -> None:
    """One request's prefill chunk: the last `chunk` of `ctx` tokens (causal)."""
    cache, r2t = setup(1, ctx)
    rows = torch.zeros(chunk, device=DEV, dtype=torch.int64)
    kv_lens = torch.arange(ctx - chunk + 1, ctx + 1, device=DEV, dtype=torch.int32)
    q, w = queries(chunk)
    tri_paged = lambda: indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, ctx, None, 1)  # noqa: E731
    k8, ks8 = indexer.gather_index_k(cache, r2t[0, :ctx], PAGE, D)
    ks = torch.zeros(chunk, device=DEV, dtype=torch.int32)
    ke = kv_lens.clone()
    tri_ragged = lambda: indexer.ragged_index_logits(q, w, k8, ks, ke, ks8)  # noqa: E731
    te_k, tg_k = both(tri_ragged)
    te_s, tg_s = both(tri_paged)
    de_k = dg_k = de_s = dg_s = None
    if dg is not None:
        wf = w.float().contiguous()
        dg_kernel = lambda: dg.fp8_mqa_logits(q, (k8, ks8), wf, ks, ke, True)  # noqa: E731
        dg_served = lambda: deepgemm.extend_index_logits(dg, q, w, cache, PAGE, r2t, rows, kv_lens, ctx)  # noqa: E731
        de_k, dg_k = both(dg_kernel)
        de_s, dg_s = both(dg_served)
    tab.add(case=name, what="kernel (ragged, gathered keys)", triton_eager_ms=te_k, deepgemm_eager_ms=de_k,
            triton_graph_ms=tg_k, deepgemm_graph_ms=dg_k)
    tab.add(case=name, what="served (Triton paged / DeepGEMM gather + ragged)", triton_eager_ms=te_s,
            deepgemm_eager_ms=de_s, triton_graph_ms=tg_s, deepgemm_graph_ms=dg_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    tab = Table(args.out)
    dg, status = deepgemm.probe(DEV)
    commit = os.environ.get("MINIDSA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tab.meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit,
                    torch=torch.__version__, triton=triton.__version__, deepgemm=status.reason,
                    argv=" ".join(sys.argv))
    print(tab.meta, flush=True)
    decode = [(b, c) for c in (8192, 32768, 131072) for b in (1, 8, 64, 128)]
    if args.quick:
        decode = [(1, 131072), (64, 32768), (128, 8192)]
    for b, c in decode:
        paged_case(tab, f"decode B={b} L={c // 1024}k", b, c, 1, dg)
    for b, n in ((16, 2), (64, 2), (16, 4), (64, 4))[: 2 if args.quick else None]:
        paged_case(tab, f"verify B={b}x{n} L=32k", b, 32768, n, dg)
    for chunk, ctx in ((2048, 8192), (4096, 32768))[: 1 if args.quick else None]:
        prefill_case(tab, f"prefill chunk {chunk} of L={ctx // 1024}k", chunk, ctx, dg)
    print(tab.markdown())


if __name__ == "__main__":
    main()
