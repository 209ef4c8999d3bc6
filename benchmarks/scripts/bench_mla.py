"""Sparse MLA over the bf16 and the FP8 (656-byte) MLA cache, side by side, on one GPU.

    PYTHONPATH=. python3 benchmarks/scripts/bench_mla.py --out results/ [--only kernels,store,capacity,step,accuracy]
    PYTHONPATH=. python3 benchmarks/scripts/bench_mla.py --out results/ --only padded   # 32 / 16 heads per rank

Sections:
- kernels: a sweep of the FP8 path's launch parameters and scale application at batch 128; then sparse
  MLA TFLOP/s (default parameters), decode at batch 1 / 8 / 64 / 128 (one query token a request, and two as in
  FlashMLA's published s_q = 2 figure), 128 and 64 heads, top-k 2048, and a 4096-token prefill; each
  shape over both layouts holding the same values (the bf16 cache is the FP8 cache dequantised).
  FlashMLA's sparse kernels beside them when `flash_mla` imports (scripts/build_flashmla.sh; gpu_check
  section `flashmla`): its FP8 decode on the same FP8 rows, its bf16 prefill on the same bf16 rows, and
  the relative difference of its output to ours; then the op the engine serves with FlashMLA chosen
  (`minidsa::flashmla_sparse_mla`: FlashMLA or Triton per shape) over both caches.
  Every kernel time is a CUDA-graph replay (`perf.graph_time`: no host launch cost, as in a captured
  step) of calls over distinct index sets that together read more than L2 holds.
- padded (not in the default list; issue 48): tensor parallelism's 32 and 16 heads per rank, which FlashMLA
  serves with the queries zero-padded to 64 heads (`flashmla.padded_heads`), against the Triton kernel at the
  rank's own heads: FP8-cache decode at batch 1 / 16 / 64 (one query token a request), top-k 2048, and a
  4096-token bf16 prefill; FlashMLA at 64 heads beside them (the padded call's work), the served op
  (`minidsa::flashmla_sparse_mla`), and each output's relative difference to Triton's.
- small (not in the default list): batch 1-32 decode, 128 heads, a sweep of launch parameters and split counts.
- store: the FP8 store kernel (quantising) against the bf16 cache's index_put.
- capacity: KV tokens that fit on this GPU with the bench-dsv32 preset for each layout (the engine's own
  sizing: kv_cache_mem_fraction of the memory free after the weights), and bytes per token of the
  real 61-layer DeepSeek-V3.2.
- step: the bench-dsv32 decode step (CUDA graph of the eager modules) at batch 128 / context 32k per layout,
  with sparse MLA served by Triton and, when `flash_mla` imports, by FlashMLA (`use_flash_mla`), side by side.
- accuracy: bench-dsv32 in bf16, one model, two caches: a 3000-token prompt (> index_topk) and 16
  teacher-forced decode steps; logits error of the FP8 cache against the bf16 cache, greedy-token agreement,
  per-layer top-k overlap.
Results: a table on stdout, bench_mla.json / bench_mla.md under --out (after every row).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (Recorder, row, timing, ceilings: one set of helpers)

from minidsa.bench import decode_suite as perf  # noqa: E402
from minidsa.kernels import custom_ops, flashmla, mla_store, sparse_mla  # noqa: E402,F401
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.common.kv_cache import MLALayout  # noqa: E402

DEV = torch.device("cuda")
D_V, D_R, TOPK = 512, 64, 2048
D_KV = D_V + D_R
FP8 = MLALayout.for_model(D_V, D_R, torch.bfloat16, "fp8")
NUM_SLOTS = 1 << 18


class Recorder(bk.Recorder):
    def save(self) -> None:
        if not self.out_dir:
            return
        import json

        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "bench_mla.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
        with open(os.path.join(self.out_dir, "bench_mla.md"), "w") as f:
            f.write(bk.markdown(self.meta, self.rows))


# ---------------------------------------------------------------------------
# timing: CUDA-graph replays over more distinct cache rows than L2 holds
# ---------------------------------------------------------------------------
L2_SPAN = 128 << 20  # bytes of cache rows one timed graph reads at least (the H100's L2 is 50 MB)
MAX_CALLS = 64


def calls_for(bytes_per_call: float) -> int:
    """Calls (each over its own index set) per timed graph: together they read more than L2 holds, so a small
    batch is timed reading HBM, as in a step whose other layers evicted its rows."""
    return int(max(2, min(MAX_CALLS, -(-L2_SPAN // max(int(bytes_per_call), 1)))))


def graph_ms(fns: list) -> tuple[float | None, str]:
    """(median milliseconds per call of fns replayed from one CUDA graph, error note)."""
    try:
        return perf.graph_time(fns) * 1e3, ""
    except Exception as e:  # a config that does not compile (shared memory, registers): record, go on
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def index_sets(num_tokens: int, calls: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, NUM_SLOTS, (num_tokens, TOPK), device=DEV, generator=g, dtype=torch.int32)
            for _ in range(calls)]


# ---------------------------------------------------------------------------
# FlashMLA, when built (scripts/build_flashmla.sh): its sparse decode (FP8 cache) and sparse prefill (bf16)
# ---------------------------------------------------------------------------
def flash_mla_module():
    try:
        import flash_mla  # noqa: F401

        return flash_mla, ""
    except Exception as e:
        return None, f"flash_mla not importable: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def flash_mla_decode_fn(fm, q: torch.Tensor, cache_fp8: torch.Tensor, idx: torch.Tensor, tokens_per_req: int):
    """FlashMLA's sparse FP8 decode on our data. Its contract (flash_mla_interface.py): q [B, s_q, H, 576] bf16,
    k_cache [blocks, block_size, 1, 656] float8_e4m3fn in the same 656-byte layout as ours, indices
    [B, s_q, topk] of global slots (block * block_size + offset, -1 invalid), block_table / cache_seqlens None
    for sparse attention, a fresh scheduler object per shape (filled on its first call). -> out [B, s_q, H, 512]."""
    num_tokens, heads, _ = q.shape
    batch = num_tokens // tokens_per_req
    kcache = cache_fp8.view(torch.float8_e4m3fn).view(-1, 64, 1, cache_fp8.shape[-1])
    qq = q.view(batch, tokens_per_req, heads, D_KV)
    ii = idx.view(batch, tokens_per_req, TOPK)
    sched, _ = fm.get_mla_metadata()

    def run():
        out, _ = fm.flash_mla_with_kvcache(qq, kcache, None, None, D_V, sched, None, softmax_scale=0.05,
                                           causal=False, is_fp8_kvcache=True, indices=ii)
        return out.view(num_tokens, heads, D_V)

    return run


def flash_mla_prefill_fn(fm, q: torch.Tensor, cache_bf16: torch.Tensor, idx: torch.Tensor):
    """flash_mla_sparse_fwd(q [s_q, H, 576] bf16, kv [s_kv, 1, 576] bf16, indices [s_q, 1, topk], sm_scale,
    d_v) -> (out [s_q, H, 512], max_logits, lse)."""
    kv = cache_bf16.view(-1, 1, D_KV)
    ii = idx.unsqueeze(1)
    return lambda: fm.flash_mla_sparse_fwd(q, kv, ii, 0.05, D_V)[0]


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------
def _caches(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 cache, bf16 cache of the same values) of NUM_SLOTS rows of N(0, 1) values."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    fp8 = FP8.allocate(1, NUM_SLOTS, DEV)[0]
    for start in range(0, NUM_SLOTS, 1 << 16):
        rows = torch.randn(1 << 16, D_KV, device=DEV, generator=g).bfloat16()
        ref.store_mla(fp8, torch.arange(start, start + (1 << 16), device=DEV), rows, D_V)
    bf16 = torch.empty(NUM_SLOTS, D_KV, device=DEV, dtype=torch.bfloat16)
    for start in range(0, NUM_SLOTS, 1 << 16):
        sl = torch.arange(start, start + (1 << 16), device=DEV)
        bf16[sl] = ref.load_mla(fp8, sl, D_V).bfloat16()
    return fp8, bf16


def _cost(num_tokens: int, heads: int, row_bytes: int) -> tuple[float, float]:
    flops = 2.0 * num_tokens * heads * TOPK * (D_KV + D_V)
    nbytes = num_tokens * TOPK * (row_bytes + 4) + num_tokens * heads * (D_KV + D_V) * 2
    return nbytes, flops


FP8_SWEEP = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 64, 8, 1), (64, 32, 4, 2), (32, 64, 4, 2)]


def bench_fp8_sweep(rec: Recorder, ceil: dict, fp8: torch.Tensor, quick: bool) -> None:
    """Launch parameters of the FP8 path at batch 128, 128 heads: pick the default."""
    g = torch.Generator(device=DEV).manual_seed(7)
    q = (torch.randn(128, 128, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
    nb, fl = _cost(128, 128, FP8.bytes_per_token)
    idxs = index_sets(128, calls_for(nb), g)
    best, best_ms = None, float("inf")
    for cfg in FP8_SWEEP[: 2 if quick else None]:
        ms, err = graph_ms([lambda i=i: sparse_mla.sparse_mla(q, fp8, i, 0.05, D_V, config=cfg) for i in idxs])
        rec.add(bk.row("sparse_mla", "fp8 sweep B=128 H=128", f"triton {cfg}", ms, nb, fl, ceil, err))
        if ms and ms < best_ms:
            best, best_ms = cfg, ms
    rec.meta["sparse_mla_fp8_best"] = best
    rec.add(bk.row("sparse_mla", "fp8 sweep B=128 H=128", f"best {best} (default: "
                   f"{sparse_mla.SPARSE_MLA_FP8_CONFIG})", best_ms, nb, fl, ceil))


SMALL_SWEEP = [(64, 64, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 64, 4, 1)]
SMALL_SPLITS = (None, 8, 16, 32, 64)


def bench_small_sweep(rec: Recorder, ceil: dict) -> None:
    """Decode at batch 1-32 (the per-layer tail, issue 29): launch parameters and split counts of the Triton kernel
    over both caches, 128 heads, top-k 2048. None = the default split rule."""
    fp8, bf16 = _caches()
    g = torch.Generator(device=DEV).manual_seed(11)
    for batch in (1, 4, 16, 32):
        q = (torch.randn(batch, 128, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
        for name, cache, row_bytes in (("bf16", bf16, D_KV * 2), ("fp8", fp8, FP8.bytes_per_token)):
            nb, fl = _cost(batch, 128, row_bytes)
            idxs = index_sets(batch, calls_for(nb), g)
            for cfg in SMALL_SWEEP:
                for splits in SMALL_SPLITS:
                    ms, err = graph_ms([lambda i=i: sparse_mla.sparse_mla(q, cache, i, 0.05, D_V, num_splits=splits,
                                                                           config=cfg) for i in idxs])
                    rec.add(bk.row("sparse_mla small", f"B={batch} H=128 {name}", f"{cfg} splits={splits}", ms, nb,
                                   fl, ceil, err))


def _served_path(q: torch.Tensor, cache: torch.Tensor) -> str:
    """Which kernel minidsa::flashmla_sparse_mla runs for this call (the op decides the same way)."""
    if flashmla.unsupported(q, cache, TOPK, D_V) is not None:
        return "Triton"
    return "FlashMLA" if flashmla.flashmla_wins(q.shape[0], q.shape[1], cache.dtype == torch.uint8, DEV) \
        else "Triton"


def bench_kernels_section(rec: Recorder, ceil: dict, quick: bool) -> None:
    fp8, bf16 = _caches()
    bench_fp8_sweep(rec, ceil, fp8, quick)
    fm, why = flash_mla_module()
    rec.meta["flash_mla"] = "imported" if fm is not None else why
    _, status = flashmla.probe(DEV)
    served = fm is not None and status.available  # what the engine's start-up choice would say
    rec.meta["flash_mla_served"] = status.reason
    g = torch.Generator(device=DEV).manual_seed(6)
    shapes = [(1, 1), (8, 1), (64, 1), (128, 1), (64, 2), (128, 2), (4096, 0)]
    for heads in (128, 64):
        for batch, s_q in shapes[:4] + shapes[5:6] if quick else shapes:
            num_tokens = batch * max(s_q, 1)
            case = f"prefill T={batch} H={heads}" if s_q == 0 else f"decode B={batch} s_q={s_q} H={heads}"
            q = (torch.randn(num_tokens, heads, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
            idxs = index_sets(num_tokens, calls_for(_cost(num_tokens, heads, FP8.bytes_per_token)[0]), g)
            idx = idxs[0]
            for name, cache, row_bytes in (("bf16", bf16, D_KV * 2), ("fp8", fp8, FP8.bytes_per_token)):
                nb, fl = _cost(num_tokens, heads, row_bytes)
                ms, err = graph_ms([lambda i=i: sparse_mla.sparse_mla(q, cache, i, 0.05, D_V) for i in idxs])
                rec.add(bk.row("sparse_mla", case, f"triton {name} cache", ms, nb, fl, ceil, err))
            if fm is not None:
                name = "bf16" if s_q == 0 else "fp8"
                try:
                    if s_q == 0:
                        fns, row_bytes = [flash_mla_prefill_fn(fm, q, bf16, i) for i in idxs], D_KV * 2
                    else:
                        fns = [flash_mla_decode_fn(fm, q, fp8, i, s_q) for i in idxs]
                        row_bytes = FP8.bytes_per_token
                    nb, fl = _cost(num_tokens, heads, row_bytes)
                    # Same inputs, same answer? (ours over the same cache as the reference point)
                    ours = sparse_mla.sparse_mla(q, bf16 if s_q == 0 else fp8, idx, 0.05, D_V).float()
                    diff = ((fns[0]().float() - ours).norm() / ours.norm()).item()
                    ms, err = graph_ms(fns)
                    err = err or f"rel. difference to ours {diff:.2e}"
                except Exception as e:
                    ms, err, nb, fl = None, f"failed: {type(e).__name__}: {str(e)[:120]}", 0, 0
                rec.add(bk.row("sparse_mla", case, f"FlashMLA {name} cache", ms, nb, fl, ceil, err))
            if served:  # the engine's op with FlashMLA chosen: FlashMLA or Triton per shape, both caches
                for name, cache, row_bytes in (("bf16", bf16, D_KV * 2), ("fp8", fp8, FP8.bytes_per_token)):
                    nb, fl = _cost(num_tokens, heads, row_bytes)
                    op = torch.ops.minidsa.flashmla_sparse_mla
                    try:
                        ours = sparse_mla.sparse_mla(q, cache, idx, 0.05, D_V).float()
                        diff = ((op(q, cache, idx, 0.05, D_V).float() - ours).norm() / ours.norm()).item()
                        ms, err = graph_ms([lambda i=i: op(q, cache, i, 0.05, D_V) for i in idxs])
                    except Exception as e:
                        ms, err, diff = None, f"failed: {type(e).__name__}: {str(e)[:120]}", float("nan")
                    rec.add(bk.row("sparse_mla", case, f"served {name} ({_served_path(q, cache)})", ms, nb, fl,
                                   ceil, err or f"rel. difference to ours {diff:.2e}"))


PADDED_HEADS = (32, 16)
PADDED_BATCHES = (1, 16, 64)


def bench_padded_section(rec: Recorder, ceil: dict) -> None:
    """32 / 16 heads per rank: FlashMLA with the queries padded to 64 heads vs Triton at the rank's heads. Costs
    are counted at the rank's heads (the padded heads' work is waste), so TFLOP/s compare like for like."""
    fp8, bf16 = _caches()
    fm, why = flash_mla_module()
    _, status = flashmla.probe(DEV)
    if fm is None or not status.available:
        rec.add(bk.row("sparse_mla padded", "32 / 16 heads", "FlashMLA padded", None,
                       note=f"not measured: {why or status.reason}"))
    op = torch.ops.minidsa.flashmla_sparse_mla
    g = torch.Generator(device=DEV).manual_seed(13)
    shapes = [(b, "fp8") for b in PADDED_BATCHES] + [(4096, "bf16")]
    for heads in PADDED_HEADS:
        for num_tokens, name in shapes:
            cache, row_bytes = (fp8, FP8.bytes_per_token) if name == "fp8" else (bf16, D_KV * 2)
            case = f"{'decode B' if name == 'fp8' else 'prefill T'}={num_tokens} H={heads} {name} cache"
            q = (torch.randn(num_tokens, heads, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
            nb, fl = _cost(num_tokens, heads, row_bytes)
            idxs = index_sets(num_tokens, calls_for(nb), g)
            want = sparse_mla.sparse_mla(q, cache, idxs[0], 0.05, D_V).float()
            ms, err = graph_ms([lambda i=i: sparse_mla.sparse_mla(q, cache, i, 0.05, D_V) for i in idxs])
            rec.add(bk.row("sparse_mla padded", case, f"triton {heads} heads", ms, nb, fl, ceil, err))
            if fm is None or not status.available:
                continue

            def rel(got: torch.Tensor) -> str:
                return f"rel. difference to Triton {((got.float() - want).norm() / want.norm()).item():.2e}"

            try:  # what the served op runs for FlashMLA: the padded call (flashmla.sparse_mla pads)
                diff = rel(flashmla.sparse_mla(fm, q, cache, idxs[0], 0.05, D_V))
                ms, err = graph_ms([lambda i=i: flashmla.sparse_mla(fm, q, cache, i, 0.05, D_V) for i in idxs])
            except Exception as e:
                ms, err, diff = None, f"failed: {type(e).__name__}: {str(e)[:120]}", ""
            rec.add(bk.row("sparse_mla padded", case, f"FlashMLA padded {heads} -> 64 heads", ms, nb, fl, ceil,
                           err or diff))
            q64 = (torch.randn(num_tokens, 64, D_KV, device=DEV, generator=g) * 0.3).bfloat16()
            try:  # the same work at 64 real heads: what padding costs over a 64-head rank
                ms, err = graph_ms([lambda i=i: flashmla.sparse_mla(fm, q64, cache, i, 0.05, D_V) for i in idxs])
            except Exception as e:
                ms, err = None, f"failed: {type(e).__name__}: {str(e)[:120]}"
            rec.add(bk.row("sparse_mla padded", case, "FlashMLA 64 real heads (same kernel work)", ms, nb, fl, ceil,
                           err))
            try:
                diff = rel(op(q, cache, idxs[0], 0.05, D_V))
                ms, err = graph_ms([lambda i=i: op(q, cache, i, 0.05, D_V) for i in idxs])
            except Exception as e:
                ms, err, diff = None, f"failed: {type(e).__name__}: {str(e)[:120]}", ""
            rec.add(bk.row("sparse_mla padded", case, f"served ({_served_path(q, cache)})", ms, nb, fl, ceil,
                           err or diff))


def bench_store_section(rec: Recorder, ceil: dict) -> None:
    """The MLA key finished (RMSNorm + rope) and stored, from its raw projection, into either cache layout."""
    weight = torch.ones(D_V, device=DEV).bfloat16()
    for num_tokens in (1, 32, 128, 16384):
        g = torch.Generator(device=DEV).manual_seed(num_tokens)
        kv = torch.randn(num_tokens, D_KV, device=DEV, generator=g).bfloat16()
        cos = torch.randn(num_tokens, D_KV - D_V, device=DEV, generator=g)[:, : (D_KV - D_V) // 2]
        sin = cos.clone()
        loc = torch.randperm(NUM_SLOTS, device=DEV, generator=g)[:num_tokens]
        fp8 = FP8.allocate(1, NUM_SLOTS, DEV)[0]
        bf16 = torch.zeros(NUM_SLOTS, D_KV, device=DEV, dtype=torch.bfloat16)
        calls = 16  # the same rows each call: a store's bytes are the step's own, written once
        fp8_bytes, bf16_bytes = num_tokens * (D_KV * 2 + FP8.bytes_per_token), num_tokens * D_KV * 4
        for impl, fn, nbytes in (
                ("triton fp8", lambda: mla_store.norm_rope_store_mla(fp8, loc, kv, weight, 1e-6, cos, sin), fp8_bytes),
                ("triton bf16", lambda: mla_store.norm_rope_store_mla(bf16, loc, kv, weight, 1e-6, cos, sin),
                 bf16_bytes),
                ("torch reference fp8", lambda: ref.norm_rope_store_mla(fp8, loc, kv, weight, 1e-6, cos, sin),
                 fp8_bytes),
                ("torch reference bf16", lambda: ref.norm_rope_store_mla(bf16, loc, kv, weight, 1e-6, cos, sin),
                 bf16_bytes)):
            ms, err = graph_ms([fn] * calls)
            rec.add(bk.row("store_mla", f"T={num_tokens}", impl, ms, nbytes, ceil=ceil, note=err))


def _runner(kv_cache_dtype: str, max_total_tokens: int = 0, max_running_requests: int = 1024):
    from minidsa.config import EngineConfig, ModelConfig, resolve
    from minidsa.common.presets import preset_config
    from minidsa.exec.build import choose_kernels
    from minidsa.exec.runner import ModelRunner

    raw = preset_config("bench-dsv32")
    init_std = raw.pop("initializer_range", 0.02)
    cfg = EngineConfig(model=None, dtype="bfloat16", device="cuda", page_size=64,
                       max_running_requests=max_running_requests, max_total_tokens=max_total_tokens,
                       indexer_cache_dtype="fp8", kernel_backend="auto", kv_cache_dtype=kv_cache_dtype,
                       enable_cuda_graph=False, enable_compile=False)
    resolved = resolve(cfg, ModelConfig.from_dict(raw), init_std)
    return ModelRunner(resolved, choose_kernels(resolved), progress=False)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def bench_capacity_section(rec: Recorder) -> None:
    from minidsa.common.kv_cache import IndexerLayout, kv_bytes_per_token

    tokens = {}
    for layout in ("auto", "fp8"):
        runner = _runner(layout)
        n = (runner.kv_capacity.num_pages - 1) * runner.page_size  # page 0 is the dummy page
        tokens[layout] = n
        rec.add(bk.row("capacity", f"bench-dsv32 KV tokens, MLA {layout}", f"{runner.kv_bytes_per_token} B/token",
                       None, note=f"{n} tokens ({n * runner.kv_bytes_per_token / 2**30:.1f} GiB of KV)"))
        del runner
        _free()
    rec.meta["capacity_tokens"] = tokens
    rec.add(bk.row("capacity", "bench-dsv32 fp8 / bf16 tokens", "ratio", None,
                   note=f"{tokens['fp8'] / tokens['auto']:.3f}x"))
    index = IndexerLayout(128, torch.bfloat16, True, 64)
    for layout in ("auto", "fp8"):
        mla = MLALayout.for_model(D_V, D_R, torch.bfloat16, layout)
        per = kv_bytes_per_token(mla, index, 61, 61)
        rec.add(bk.row("capacity", f"DeepSeek-V3.2 61 layers, MLA {layout}", f"{per} B/token", None,
                       note=f"{int(2**30 / per)} tokens per GiB"))


def bench_step_section(rec: Recorder, iters: int, batch: int = 128, ctx: int = 32768) -> None:
    """The decode step per MLA layout, sparse MLA served by Triton and (when flash_mla imports) by FlashMLA."""
    _, status = flashmla.probe(DEV)
    if not status.available:
        rec.add(bk.row("decode_step", f"bench-dsv32 B={batch} ctx={ctx}", "FlashMLA served", None,
                       note=f"not measured: {status.reason}"))
    for layout in ("auto", "fp8"):
        for use_flash_mla in ((False, True) if status.available else (False,)):
            bench = perf.Bench("bench-dsv32", max_context=ctx, max_batch_tokens=batch * (ctx + 64), max_bs=batch,
                               compile=False, kv_cache_dtype=layout, use_flash_mla=use_flash_mla)
            served = bench.runner.kernels.sparse_mla
            ms = perf._graph_decode_ms(bench, batch, ctx, iters)
            mla_bytes = bench.runner.kv_cache.mla_layout.bytes_per_token
            nbytes = bench.model_config.num_hidden_layers * batch * TOPK * mla_bytes
            rec.add(bk.row("decode_step", f"bench-dsv32 B={batch} ctx={ctx}",
                           f"graph (eager modules), MLA {layout}, sparse MLA {served}", ms,
                           note=f"{batch / ms * 1e3:.0f} tok/s; selected MLA rows {nbytes / 2**20:.0f} MiB/step"))
            del bench
            _free()


@torch.no_grad()
def bench_accuracy_section(rec: Recorder, prompt_len: int = 3000, steps: int = 16) -> None:
    from minidsa.attention.backend import DSABackend
    from minidsa.attention.topk_recording import TopkRecorder
    from minidsa.common.batch import ForwardBatch
    from minidsa.common.plan import StepKind
    from minidsa.common.kv_cache import KVCache, MLALayout as Layout
    from minidsa.sched.pages import pages_needed, slots_of

    runner = _runner("auto", max_total_tokens=8192, max_running_requests=4)
    kv = runner.kv_cache
    fp8_kv = KVCache(kv.num_layers, kv.num_pages, Layout.for_model(D_V, D_R, torch.bfloat16, "fp8"),
                     kv.index_layout, DEV, [k is not None for k in kv.index_k])
    backends = {"auto": runner.attn,
                "fp8": DSABackend(fp8_kv, runner.req_to_token, runner.model_config.index_topk, runner.kernels,
                                  runner.libraries)}
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
    forced = torch.randint(2, vocab, (steps,), generator=g).tolist()
    row = 0  # row 0 and pages 1..: this runner serves nothing else
    pages = list(range(1, 1 + pages_needed(prompt_len + steps + 1, runner.page_size)))
    runner.req_to_token_table.write(row, 0, slots_of(pages, 0, prompt_len + steps + 1, runner.page_size))
    r2t = runner.req_to_token
    logits, topks = {}, {}
    for name, attn in backends.items():
        out_logits, recorded = [], []
        with TopkRecorder(attn) as selected:  # each decode step's selected positions, per layer
            loc = r2t[row, :prompt_len].long()
            batch = ForwardBatch.build(StepKind.EXTEND, prompt, [row], [0], [prompt_len], loc, DEV)
            out_logits.append(runner.model(batch, attn).logits[-1].float())
            for i, tok in enumerate(forced):
                selected.records = []
                pos = prompt_len + i
                batch = ForwardBatch.build(StepKind.DECODE, [tok], [row], [pos], [1], r2t[row, pos:pos + 1].long(),
                                           DEV)
                out_logits.append(runner.model(batch, attn).logits[-1].float())
                recorded.append(dict(selected.records))
        logits[name], topks[name] = torch.stack(out_logits), recorded
    full, fp8 = logits["auto"], logits["fp8"]
    rel = (fp8 - full).norm(dim=-1) / (full - full.mean(-1, keepdim=True)).norm(dim=-1)
    agree = (fp8.argmax(-1) == full.argmax(-1)).float().mean().item()
    hits = total = 0
    for a, b in zip(topks["auto"], topks["fp8"]):
        for layer in a:
            sa = set(a[layer][0].tolist()) - {-1}
            hits += len(sa & (set(b[layer][0].tolist()) - {-1}))
            total += len(sa)
    note = (f"logits error / spread: mean {rel.mean():.4f} max {rel.max():.4f}; greedy agreement {agree:.3f}; "
            f"top-k overlap {hits / max(total, 1):.4f} (prompt {prompt_len}, {steps} decode steps)")
    rec.meta["accuracy"] = note
    rec.add(bk.row("accuracy", "bench-dsv32 bf16: fp8 vs bf16 cache", "teacher-forced", None, note=note))
    del runner, backends, fp8_kv
    _free()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for bench_mla.json / .md")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--only", default="kernels,store,capacity,step,accuracy", help="comma list of sections")
    ap.add_argument("--iters", type=int, default=10, help="decode step replays")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla: needs a CUDA GPU", file=sys.stderr)
        return 2
    rec = Recorder(args.out)
    import datetime

    rec.meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), commit=os.environ.get("MINIDSA_COMMIT", "unknown"),
                    deepgemm="-")
    print(f"# {rec.meta}", flush=True)
    ceil = bk.ceilings(rec)
    only = set(args.only.split(","))
    failed = []
    sections = [("kernels", lambda: bench_kernels_section(rec, ceil, args.quick)),
                ("padded", lambda: bench_padded_section(rec, ceil)),
                ("small", lambda: bench_small_sweep(rec, ceil)),
                ("store", lambda: bench_store_section(rec, ceil)),
                ("capacity", lambda: bench_capacity_section(rec)),
                ("step", lambda: bench_step_section(rec, args.iters)),
                ("accuracy", lambda: bench_accuracy_section(rec))]
    for name, fn in sections:
        if name not in only:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception:
            failed.append(name)
            traceback.print_exc()
            rec.add(bk.row(name, "section failed", "-", None, note=traceback.format_exc().splitlines()[-1][:160]))
        finally:
            _free()
            print(f"# section {name}: {time.time() - t0:.0f} s", flush=True)
    rec.meta["seconds"] = round(time.time() - rec.t0, 1)
    rec.save()
    print()
    print(bk.markdown(rec.meta, rec.rows))
    if failed:
        print(f"sections that failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
