"""Benchmark the DSA kernels on one GPU: time, GB/s, TFLOP/s, and fractions of ceilings measured in the same run.

    PYTHONPATH=. python3 benchmarks/scripts/bench_kernels.py --out results/   # one command, one GPU call

Ceilings: a device-to-device copy (bytes read + written) and a bf16 8192^3
matmul. Each kernel is timed with triton.testing.do_bench (median, L2
flushed between runs), next to its baseline from the same run (the torch
reference, torch.topk). Launch parameters are swept on the target shapes and
the best is used for the other shapes. Results: a table on stdout, JSON and
Markdown under --out (written after every row, so a cut-short run keeps what
it measured).

Shapes (DeepSeek-V3.2): 64 indexer heads x 128, page size 64, index_topk
2048, 128 MLA heads, 576 / 512 latent dims.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import triton

from minidsa.kernels import custom_ops, deepgemm, indexer, kv_move, sparse_mla, topk  # noqa: F401
from minidsa.kernels import reference as ref

DEV = torch.device("cuda")
H_IDX, D_IDX, PAGE, TOPK = 64, 128, 64, 2048
H_MLA, D_KV, D_V = 128, 576, 512


class Recorder:
    def __init__(self, out_dir: str | None):
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.out_dir = out_dir
        self.t0 = time.time()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(_fmt(row), flush=True)
        self.save()

    def save(self) -> None:
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "bench_kernels.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
        with open(os.path.join(self.out_dir, "bench_kernels.md"), "w") as f:
            f.write(markdown(self.meta, self.rows))


def timed(fn, rep: int = 100) -> float:
    """Median milliseconds of fn (do_bench: warm-up first, L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def row(group: str, name: str, impl: str, ms: float | None, nbytes: float = 0.0, flops: float = 0.0,
        ceil: dict | None = None, note: str = "") -> dict:
    r = {"group": group, "case": name, "impl": impl, "ms": ms, "bytes": nbytes, "flops": flops, "note": note}
    if ms:
        r["GB/s"] = nbytes / ms / 1e6 if nbytes else None
        r["TFLOP/s"] = flops / ms / 1e9 if flops else None
        if ceil:
            r["frac_copy"] = r["GB/s"] / ceil["copy_GBps"] if r["GB/s"] else None
            r["frac_mm"] = r["TFLOP/s"] / ceil["bf16_TFLOPs"] if r["TFLOP/s"] else None
    return r


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _fmt(r: dict) -> str:
    return (f"{r['group']:<12} {r['case']:<34} {r['impl']:<24} {_f(r['ms'], '9.4f')} ms "
            f"{_f(r.get('GB/s'), '8.0f')} GB/s {_f(r.get('TFLOP/s'), '7.1f')} TF/s "
            f"copy {_f(r.get('frac_copy'), '5.2f')} mm {_f(r.get('frac_mm'), '5.2f')}  {r['note']}")


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"device: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"date {meta.get('date')}, commit {meta.get('commit')}",
             f"ceilings: copy {_f(meta.get('copy_GBps'), '.0f')} GB/s, bf16 matmul "
             f"{_f(meta.get('bf16_TFLOPs'), '.0f')} TFLOP/s; DeepGEMM: {meta.get('deepgemm')}", "",
             "| group | case | impl | ms | GB/s | TFLOP/s | of copy BW | of bf16 mm | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['case']} | {r['impl']} | {_f(r['ms'], '.4f')} | "
                     f"{_f(r.get('GB/s'), '.0f')} | {_f(r.get('TFLOP/s'), '.1f')} | {_f(r.get('frac_copy'), '.2f')} "
                     f"| {_f(r.get('frac_mm'), '.2f')} | {r['note']} |")
    return "\n".join(lines) + "\n"


def try_time(fn, rep: int = 100) -> tuple[float | None, str]:
    try:
        return timed(fn, rep), ""
    except Exception as e:  # a config that does not compile (shared memory, registers): record, go on
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


# ---------------------------------------------------------------------------
# setups
# ---------------------------------------------------------------------------
def paged_setup(num_rows: int, width: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    per_row = -(-width // PAGE)
    num_pages = num_rows * per_row + 1
    cache = torch.empty(num_pages, PAGE * (D_IDX + 4), dtype=torch.uint8, device=DEV)
    keys, scales = ref.fp8_views(cache, PAGE, D_IDX)
    for s in range(0, num_pages, 4096):  # bounded temporaries
        e = min(s + 4096, num_pages)
        keys[s:e] = torch.randn(e - s, PAGE, D_IDX, device=DEV, generator=g).mul_(60).to(torch.float8_e4m3fn)
    scales.copy_(torch.exp2(torch.randint(-9, -5, (num_pages, PAGE), device=DEV, generator=g).float()))
    pages = (torch.randperm(num_pages - 1, device=DEV, generator=g) + 1)[: num_rows * per_row].view(num_rows, per_row)
    pos = torch.arange(width, device=DEV)
    r2t = (pages[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    return cache, r2t


def queries(num_tokens: int, seed: int = 1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(num_tokens, H_IDX, D_IDX, device=DEV, generator=g)
    w = torch.randn(num_tokens, H_IDX, device=DEV, generator=g) * H_IDX**-0.5 * D_IDX**-0.5
    return ref.quant_index_q(q, w)


def logits_traffic(num_tokens: int, visible_keys: int, width: int) -> tuple[float, float]:
    """(bytes, flops) of the paged indexer: keys + scales read, logits written; 2*H*D flops per visible key."""
    nbytes = visible_keys * (D_IDX + 4) + num_tokens * width * 4 + num_tokens * H_IDX * (D_IDX + 4)
    return float(nbytes), 2.0 * visible_keys * H_IDX * D_IDX


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------
def ceilings(rec: Recorder) -> dict:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a))
    copy = 2 * n / ms / 1e6
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms_mm = timed(lambda: x @ y)
    mm = 2 * 8192**3 / ms_mm / 1e9
    ceil = {"copy_GBps": copy, "bf16_TFLOPs": mm}
    rec.meta.update(ceil)
    rec.add(row("ceiling", "d2d copy 1 GiB", "torch", ms, 2 * n, note="bytes read + written"))
    rec.add(row("ceiling", "bf16 matmul 8192^3", "torch", ms_mm, flops=2 * 8192**3))
    return ceil


def bench_store(rec: Recorder, ceil: dict) -> None:
    """The indexer key finished (LayerNorm + rope) and stored, from its raw projection."""
    cache, r2t = paged_setup(1, 65536)
    weight, bias = torch.ones(D_IDX, device=DEV).bfloat16(), torch.zeros(D_IDX, device=DEV).bfloat16()
    for t in (1, 32, 128, 16384):
        loc = r2t[0, torch.randperm(65536, device=DEV)[:t]].long()
        k = torch.randn(t, D_IDX, device=DEV).bfloat16()
        cos, sin = torch.randn(t, 32, device=DEV), torch.randn(t, 32, device=DEV)
        args = (cache, loc, k, weight, bias, 1e-6, cos, sin, False, PAGE)
        nbytes = t * (D_IDX * 2 + D_IDX + 4 + 8 + 256)
        rec.add(row("store_index_k", f"T={t}", "triton (norm + rope + store)",
                    timed(lambda: indexer.norm_rope_store_index_k(*args)), nbytes, 2.0 * t * D_IDX * D_IDX, ceil))
        rec.add(row("store_index_k", f"T={t}", "torch reference",
                    timed(lambda: ref.norm_rope_store_index_k(*args)), nbytes, 2.0 * t * D_IDX * D_IDX, ceil))


PAGED_SWEEP = [(1, 64, 4, 3), (1, 64, 4, 4), (1, 128, 4, 3), (1, 128, 4, 4), (1, 128, 8, 4), (1, 64, 2, 4)]


def bench_index_logits(rec: Recorder, ceil: dict, quick: bool) -> tuple[tuple, torch.Tensor]:
    # Target shape: decode, batch 64, context 32k.
    b, width = 64, 32768
    cache, r2t = paged_setup(b, width)
    rows = torch.arange(b, device=DEV)
    kv_lens = torch.full((b,), width, device=DEV)
    q, w = queries(b)
    nbytes, flops = logits_traffic(b, b * width, width)
    best, best_ms = None, float("inf")
    for cfg in PAGED_SWEEP[: 3 if quick else None]:
        for chunk in (None, 1024, 4096):
            ms, err = try_time(lambda: indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width,
                                                            chunk_len=chunk, config=cfg))
            rec.add(row("index_logits", f"decode B={b} L=32k sweep", f"triton {cfg} chunk={chunk}", ms, nbytes,
                        flops, ceil, err))
            if ms and ms < best_ms:
                best, best_ms = (cfg, chunk), ms
    rec.add(row("index_logits", f"decode B={b} L=32k", f"triton best {best}", best_ms, nbytes, flops, ceil))
    cfg, chunk = best
    logits = indexer.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width, chunk_len=chunk, config=cfg)
    ms, err = try_time(lambda: ref.index_logits(q, w, cache, PAGE, r2t, rows, kv_lens, width), rep=300)
    rec.add(row("index_logits", f"decode B={b} L=32k", "torch reference", ms, nbytes, flops, ceil, err))
    dg, status = deepgemm.probe(DEV)
    if status.available:
        ms, err = try_time(lambda: deepgemm.paged_index_logits(dg, q, w, cache, PAGE, r2t, rows, kv_lens, width))
        rec.add(row("index_logits", f"decode B={b} L=32k", "deepgemm", ms, nbytes, flops, ceil, err))
    else:
        rec.add(row("index_logits", f"decode B={b} L=32k", "deepgemm", None, note=status.reason))

    # Other decode / verify / prefill shapes with the chosen parameters.
    shapes = [("decode B=1 L=128k", 1, 131072, 1), ("decode B=128 L=8k", 128, 8192, 1),
              ("decode B=128 L=32k", 128, 32768, 1), ("verify B=16x4 L=32k tree", 16, 32768, 4),
              ("prefill 256 tok L=8k", 1, 8192, 256)]
    for name, reqs, ctx, per_req in shapes[: 2 if quick else None]:
        cache, r2t = paged_setup(reqs, ctx + 4)
        t = reqs * per_req
        rows = torch.arange(reqs, device=DEV).repeat_interleave(per_req)
        tree = None
        if "tree" in name:
            kv_lens = torch.full((t,), ctx, device=DEV)
            tree = torch.tril(torch.ones(per_req, per_req, dtype=torch.bool, device=DEV)).repeat(reqs, 1)
        elif per_req > 1:
            kv_lens = torch.arange(ctx - per_req + 1, ctx + 1, device=DEV).repeat(reqs)
        else:
            kv_lens = torch.full((t,), ctx, device=DEV)
        qq, ww = queries(t)
        width = ctx + (per_req if tree is not None else 0)
        vis = int(kv_lens.sum()) + (int(tree.sum()) if tree is not None else 0)
        nb, fl = logits_traffic(t, vis, width)
        if per_req > 1:  # the keys are shared by the tokens of a request: count them once
            nb = reqs * ctx * (D_IDX + 4) + t * width * 4
        ms, err = try_time(lambda: indexer.index_logits(qq, ww, cache, PAGE, r2t, rows, kv_lens, width, tree,
                                                        chunk_len=chunk, config=cfg))
        rec.add(row("index_logits", name, "triton paged, 1 token/program", ms, nb, fl, ceil, err))
        if per_req > 1:
            ms, err = try_time(lambda: indexer.index_logits(qq, ww, cache, PAGE, r2t, rows, kv_lens, width, tree,
                                                            config=indexer.GROUPED_CONFIG))
            rec.add(row("index_logits", name, "triton paged, 2 tokens/program", ms, nb, fl, ceil, err))
        ms, err = try_time(lambda: torch.ops.minidsa.index_logits(qq, ww, cache, PAGE, r2t, rows, kv_lens, width,
                                                                  tree, reqs))
        rec.add(row("index_logits", name, "served (minidsa::index_logits)", ms, nb, fl, ceil, err))
        if name.startswith("decode B=1 "):
            ms, err = try_time(lambda: ref.index_logits(qq, ww, cache, PAGE, r2t, rows, kv_lens, width, tree), rep=300)
            rec.add(row("index_logits", name, "torch reference", ms, nb, fl, ceil, err))
        if name.startswith("prefill"):
            k8, ksc = indexer.gather_index_k(cache, r2t[0, :ctx], PAGE, D_IDX)
            ks = torch.zeros(t, dtype=torch.int32, device=DEV)
            ms, err = try_time(lambda: indexer.ragged_index_logits(qq, ww, k8, ks, kv_lens.int(), ksc))
            rec.add(row("index_logits", name, "triton ragged (keys contiguous)", ms, nb, fl, ceil, err))
            ms, err = try_time(lambda: indexer.extend_index_logits(qq, ww, cache, PAGE, r2t, rows, kv_lens, width))
            rec.add(row("index_logits", name, "triton gather + ragged (served)", ms, nb, fl, ceil, err))
    return best, logits


TOPK_SWEEP = [(8192, 8, 16), (4096, 8, 16), (8192, 8, 32), (16384, 8, 32), (8192, 11, 32)]


def bench_topk(rec: Recorder, ceil: dict, logits: torch.Tensor, quick: bool) -> None:
    b, width = logits.shape
    r2t = torch.arange(b * width, device=DEV, dtype=torch.int32).view(b, width)
    rows = torch.arange(b, device=DEV)
    nbytes = b * width * 4.0
    best, best_ms = None, float("inf")
    for cfg in TOPK_SWEEP[: 2 if quick else None]:
        ms, err = try_time(lambda: topk.topk_slots(logits, TOPK, r2t, rows, config=cfg))
        rec.add(row("topk", f"B={b} L={width // 1024}k k=2048 sweep", f"triton {cfg}", ms, nbytes, ceil=ceil,
                    note=err))
        if ms and ms < best_ms:
            best, best_ms = cfg, ms
    rec.add(row("topk", f"B={b} L={width // 1024}k k=2048", f"triton best {best}", best_ms, nbytes, ceil=ceil))
    rec.add(row("topk", f"B={b} L={width // 1024}k k=2048", "torch.topk + gather",
                timed(lambda: topk.torch_topk_slots(logits, TOPK, r2t, rows)), nbytes, ceil=ceil))
    for t, w in ((1, 131072), (1, 65536), (1, 32768), (8, 32768), (128, 8192), (128, 65536),
                 (256, 16384))[: 1 if quick else None]:
        g = torch.Generator(device=DEV).manual_seed(t)
        lg = torch.randn(t, w, device=DEV, generator=g)
        r2 = torch.arange(t * w, device=DEV, dtype=torch.int32).view(t, w)
        rw = torch.arange(t, device=DEV)
        nb = t * w * 4.0
        rec.add(row("topk", f"B={t} L={w // 1024}k k=2048", f"triton {best}",
                    timed(lambda: topk.topk_slots(lg, TOPK, r2, rw, config=best)), nb, ceil=ceil))
        rec.add(row("topk", f"B={t} L={w // 1024}k k=2048", "torch.topk + gather",
                    timed(lambda: topk.torch_topk_slots(lg, TOPK, r2, rw)), nb, ceil=ceil,
                    note=f"dispatch picks {'triton' if topk.triton_wins(t, w, DEV) else 'torch'}"))
    rec.meta["topk_best"] = best


def bench_small_batch(rec: Recorder, ceil: dict) -> None:
    """Decode at small batch: top-k one program per row vs split over programs vs torch.topk; sparse MLA splits."""
    for t, w in ((1, 4160), (1, 16448), (1, 32832), (1, 131136), (4, 4160), (8, 4160), (8, 32832), (32, 4160),
                 (32, 32832), (64, 32832)):
        g = torch.Generator(device=DEV).manual_seed(t)
        lg = torch.randn(t, w, device=DEV, generator=g)
        lg[:, w - 63:] = float("-inf")  # the invisible tail of a context bucket
        r2 = torch.arange(t * w, device=DEV, dtype=torch.int32).view(t, w)
        rw = torch.arange(t, device=DEV)
        nb = t * w * 4.0
        case = f"B={t} L={w} k=2048"
        picked = topk.split_chunks(t, w, DEV)
        for chunks in sorted({1, 4, 8, 16, 32, 64, picked}):
            if chunks > 1 and chunks * 256 > w:
                continue
            rec.add(row("topk_small", case, f"triton {chunks} programs/row" + (" (default)" if chunks == picked else ""),
                        timed(lambda: topk.topk_slots(lg, TOPK, r2, rw, num_chunks=chunks)), nb, ceil=ceil))
        rec.add(row("topk_small", case, "torch.topk + gather", timed(lambda: topk.torch_topk_slots(lg, TOPK, r2, rw)),
                    nb, ceil=ceil))
    num_slots = 262144
    g = torch.Generator(device=DEV).manual_seed(5)
    cache = torch.randn(num_slots, D_KV, device=DEV, generator=g).bfloat16()
    for t in (1, 2, 4, 8, 16):
        q = (torch.randn(t, H_MLA, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
        idx = torch.randint(0, num_slots, (t, TOPK), device=DEV, generator=g, dtype=torch.int32)
        nb = t * TOPK * (D_KV * 2 + 4) + t * H_MLA * (D_KV + D_V) * 2
        fl = 2.0 * t * H_MLA * TOPK * (D_KV + D_V)
        rec.add(row("sparse_mla_small", f"decode B={t}", "triton default splits",
                    timed(lambda: sparse_mla.sparse_mla(q, cache, idx, 0.05, D_V)), nb, fl, ceil))
        for splits in (4, 8, 16, 32):
            rec.add(row("sparse_mla_small", f"decode B={t}", f"triton {splits} splits",
                        timed(lambda: sparse_mla.sparse_mla(q, cache, idx, 0.05, D_V, num_splits=splits)), nb, fl,
                        ceil))


MLA_SWEEP = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 64, 8, 1), (64, 32, 8, 4)]


def bench_sparse_mla(rec: Recorder, ceil: dict, quick: bool) -> None:
    num_slots = 262144
    g = torch.Generator(device=DEV).manual_seed(5)
    cache = torch.randn(num_slots, D_KV, device=DEV, generator=g).bfloat16()

    def inputs(t: int):
        q = (torch.randn(t, H_MLA, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
        idx = torch.randint(0, num_slots, (t, TOPK), device=DEV, generator=g, dtype=torch.int32)
        return q, idx

    def cost(t: int) -> tuple[float, float]:
        flops = 2.0 * t * H_MLA * TOPK * (D_KV + D_V)
        nbytes = t * TOPK * (D_KV * 2 + 4) + t * H_MLA * (D_KV + D_V) * 2
        return nbytes, flops

    q, idx = inputs(128)
    nb, fl = cost(128)
    best, best_ms = None, float("inf")
    for cfg in MLA_SWEEP[: 2 if quick else None]:
        ms, err = try_time(lambda: sparse_mla.sparse_mla(q, cache, idx, 0.05, D_V, config=cfg))
        rec.add(row("sparse_mla", "decode B=128 sweep", f"triton {cfg}", ms, nb, fl, ceil, err))
        if ms and ms < best_ms:
            best, best_ms = cfg, ms
    rec.add(row("sparse_mla", "decode B=128 H=128 k=2048", f"triton best {best}", best_ms, nb, fl, ceil))
    for splits in (2, 3, 4):
        ms, err = try_time(lambda: sparse_mla.sparse_mla(q, cache, idx, 0.05, D_V, num_splits=splits, config=best))
        rec.add(row("sparse_mla", "decode B=128 H=128 k=2048", f"triton {best} {splits} splits", ms, nb, fl, ceil,
                    err))
    ms, err = try_time(lambda: ref.sparse_mla(q, cache, idx, 0.05, D_V), rep=300)
    rec.add(row("sparse_mla", "decode B=128 H=128 k=2048", "torch reference", ms, nb, fl, ceil, err))
    for t in (1, 8, 64, 4096)[: 2 if quick else None]:
        qq, ii = inputs(t)
        nb, fl = cost(t)
        ms, err = try_time(lambda: sparse_mla.sparse_mla(qq, cache, ii, 0.05, D_V, config=best))
        label = f"prefill T={t}" if t > 128 else f"decode B={t}"
        rec.add(row("sparse_mla", label, f"triton {best} (default splits)", ms, nb, fl, ceil, err))
        if t == 64:
            for splits in (1, 2, 4):
                ms, err = try_time(lambda: sparse_mla.sparse_mla(qq, cache, ii, 0.05, D_V, num_splits=splits,
                                                                 config=best))
                rec.add(row("sparse_mla", label, f"triton {best} {splits} splits", ms, nb, fl, ceil, err))
        if t == 1:
            ms, err = try_time(lambda: ref.sparse_mla(qq, cache, ii, 0.05, D_V))
            rec.add(row("sparse_mla", label, "torch reference", ms, nb, fl, ceil, err))
    rec.meta["sparse_mla_best"] = best


def bench_kv_move(rec: Recorder, ceil: dict) -> None:
    layers, slots, n = 61, 16384, 256
    mla = torch.randn(layers, slots, D_KV, device=DEV).bfloat16()
    index = torch.randint(0, 256, (layers, slots // PAGE, PAGE * (D_IDX + 4)), device=DEV, dtype=torch.uint8)
    perm = torch.randperm(slots, device=DEV)
    src, dst = perm[:n], perm[n: 2 * n]
    nbytes = 2.0 * n * layers * (D_KV * 2 + D_IDX + 4)
    rec.add(row("kv_move", f"61 layers x {n} rows", "triton (1 launch)",
                timed(lambda: kv_move.kv_move(mla, index, src, dst, PAGE, D_IDX)), nbytes, ceil=ceil))
    mla_l, idx_l = list(mla.unbind(0)), list(index.unbind(0))
    rec.add(row("kv_move", f"61 layers x {n} rows", "torch reference",
                timed(lambda: ref.kv_move(mla_l, idx_l, src, dst, PAGE, D_IDX)), nbytes, ceil=ceil))


def kernel_resources() -> list[str]:
    """Registers / spills / shared memory of every compiled variant (Triton's JIT cache; best effort)."""
    out = []
    for mod in (indexer, topk, sparse_mla, kv_move):
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if not name.endswith("_kernel") or not caches:
                continue
            try:
                for dev_cache in caches.values():
                    for k in dev_cache[0].values():
                        out.append(f"{name}: regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} "
                                   f"shared={k.metadata.shared} warps={k.metadata.num_warps} "
                                   f"stages={k.metadata.num_stages}")
            except Exception as e:
                out.append(f"{name}: {type(e).__name__}: {e}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for bench_kernels.json / .md")
    ap.add_argument("--quick", action="store_true", help="fewer sweeps and shapes")
    ap.add_argument("--only", default="store,logits,topk,mla,move,small", help="comma list of sections")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    rec = Recorder(args.out)
    commit = os.environ.get("MINIDSA_COMMIT", "")  # the GPU machine gets a copy of the tree without .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    rec.meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), commit=commit or "unknown",
                    deepgemm=deepgemm.probe(DEV)[1].reason)
    print(f"# {rec.meta}", flush=True)
    ceil = ceilings(rec)
    only = set(args.only.split(","))
    failed = []

    def run(name: str, fn):
        if name not in only:
            return None
        try:
            return fn()
        except Exception:
            failed.append(name)
            traceback.print_exc()
            rec.add(row(name, "section failed", "-", None, note=traceback.format_exc().splitlines()[-1][:160]))
            return None
        finally:
            torch.cuda.empty_cache()

    run("store", lambda: bench_store(rec, ceil))
    best_logits = run("logits", lambda: bench_index_logits(rec, ceil, args.quick))
    if best_logits is not None:
        rec.meta["index_logits_best"] = best_logits[0]
        logits = best_logits[1]
    else:  # top-k on stand-in logits of the same shape
        logits = torch.randn(64, 32768, device=DEV)
    run("topk", lambda: bench_topk(rec, ceil, logits, args.quick))
    run("mla", lambda: bench_sparse_mla(rec, ceil, args.quick))
    run("move", lambda: bench_kv_move(rec, ceil))
    run("small", lambda: bench_small_batch(rec, ceil))
    rec.meta["resources"] = kernel_resources()
    rec.meta["seconds"] = round(time.time() - rec.t0, 1)
    rec.save()
    print()
    print(markdown(rec.meta, rec.rows))
    print("\n".join(rec.meta["resources"]))
    if failed:
        print(f"sections that failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
