"""FlashMLA's sparse MLA kernels (deepseek-ai/FlashMLA), served where `flash_mla` imports on an SM90 GPU.

Contract relied on (FlashMLA's flash_mla_interface.py and csrc/api, commit 9241ae3, built by
scripts/build_flashmla.sh; the same calls benchmarks/scripts/bench_mla.py measured against ours):
- decode, FP8 cache: `flash_mla_with_kvcache(q [b, s_q, h_q, 576] bf16, k_cache [blocks, block_size, 1, 656]
  float8_e4m3fn, None, None, 512, sched_meta, None, softmax_scale, causal=False, is_fp8_kvcache=True,
  indices=[b, s_q, topk] int32)` -> (out [b, s_q, h_q, 512] bf16, lse). The 656-byte row is our FP8 layout
  (512 e4m3, 4 fp32 scales, 64 bf16 rope); an index is `block * block_size + offset`, -1 = none. h_q 64 or
  128, topk a multiple of 64 (TOPK_BLOCK_SIZE on SM90). `sched_meta` (`get_mla_metadata()[0]`) is empty until
  the first call fills it (a kernel writing tensors it allocates); it may be reused only for the same shapes.
- prefill, bf16 cache: `flash_mla_sparse_fwd(q [s_q, h_q, 576] bf16, kv [s_kv, 1, 576] bf16,
  indices [s_q, 1, topk] int32, sm_scale, d_v=512)` -> (out [s_q, h_q, 512], max_logits, lse); h_q 64 or 128,
  topk a multiple of 128 (2 * B_TOPK); -1 = none.

How we call them:
- Heads per rank: 64 and 128 as they are. Fewer heads that divide 64 (tensor parallelism: 32 at TP=4 of
  DeepSeek-V3.2's 128 or TP=2 of GLM-5's 64, 16 at TP=8 or 4) are padded to 64 with zero queries, as vLLM does for
  FlashMLA sparse; the padded heads' outputs are dropped (`padded_heads`). The padded copy is one `F.pad` per
  call from the caching allocator (no host sync: CUDA-graph capturable; inside the opaque op: nothing traced).
  It costs MMA work for heads that are thrown away (64 / h times the head tiles), but a sparse-decode CTA's cost
  is dominated by reading and dequantising its KV tile, which padding does not change: benchmarks/bench_mla.py
  `--only padded` measures it against Triton at 32 and 16 heads.
- Our top-k slots are already global slot ids. The block size of the cache view is only index arithmetic
  for the sparse kernels (slot = block * block_size + offset), so any view of the same rows works: 64-slot
  blocks when the slot count allows (what was benchmarked), else blocks of one slot.
- Sparse decode has no causal mask and no context length: every query token is its own batch row
  (b = T, s_q = 1), so decode, target verify and draft steps are one case. Token counts above
  DECODE_MAX_TOKENS (FP8 prefill chunks) run in pieces: the kernel's split-KV scratch is
  (b + SMs) x h_q x 512 fp32, 256 KiB a token at 128 heads.
- Scheduler metadata is kept per shape (`_SCHED_META`, keyed by the library and the shape): made by the first
  call outside CUDA-graph capture (the engine's warm-up runs before each capture), then reused, so a captured
  graph reads metadata that lives as long as the process. A shape first seen while capturing gets a fresh
  object whose metadata kernel is captured with the attention (recomputed on each replay) and is not kept.
- The bf16 prefill kernel gives each (token, 64 heads) one CTA over the whole top-k: below one wave of CTAs
  the Triton kernel, which splits the top-k axis, is used (`flashmla_wins`).

`probe` runs at start-up (attention/select.py decides with it; each engine then holds a `FlashMLA` handle).
Everything else runs inside the opaque custom op `minidsa::flashmla_sparse_mla`, never in traced code, and
reaches the module through Python's import cache (`library`). A call that fails raises `LibraryCallFailed`: the
op runs the Triton kernel for that call and logs the failure once. No failure is remembered, so engines in one
process never see each other's FlashMLA.
"""

from __future__ import annotations

from types import ModuleType

import torch

from minidsa.kernels import num_sms
from minidsa.kernels.optional_lib import LibraryStatus, failed, import_library, load_library

NAME = "flash_mla"
REQUIRED_API = ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd")
# The build (scripts/build_flashmla.sh) generates sm_90a code only; SM100 kernels exist upstream but are unmeasured.
SUPPORTED_SM_MAJOR = (9,)
HEADS = (64, 128)  # the kernels' head counts; fewer heads per rank that divide 64 are padded to 64 (`padded_heads`)
PAD_HEADS_TO = 64
LATENT_DIM, ROPE_DIM = 512, 64
DECODE_TOPK_BLOCK = 64
PREFILL_TOPK_BLOCK = 128
HEADS_PER_CTA = 64  # the bf16 prefill kernel's head tile
DECODE_MAX_TOKENS = 256  # query tokens per sparse-decode launch (bounds its split-KV scratch; B=128 s_q=2 measured)
CACHE_BLOCK = 64


# Scheduler metadata per (library module, device index, tokens, heads, top-k, cache block): a cache keyed by what
# it was made for (see the module docstring).
_SCHED_META: dict[tuple, object] = {}


def _capturing() -> bool:
    """Is the current stream being captured into a CUDA graph?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def probe(device: torch.device | str) -> tuple[ModuleType | None, LibraryStatus]:
    """(flash_mla, its status) when its sparse kernels serve on `device`, else (None, why not). Start-up only."""
    return load_library(NAME, REQUIRED_API, torch.device(device), SUPPORTED_SM_MAJOR,
                        "FlashMLA's sparse kernels (as built) need SM90")


def library() -> ModuleType:
    """flash_mla from Python's module cache, for the custom op (raises LibraryCallFailed if it does not import)."""
    return import_library(NAME)


class FlashMLA:
    """flash_mla as one engine uses it: made at start-up by attention/select.py (`load_libraries`) on every rank."""

    def __init__(self, module: ModuleType, status: LibraryStatus):
        self.module = module
        self.status = status


def padded_heads(heads: int) -> int | None:
    """The head count FlashMLA runs for `heads` query heads per rank: as is for 64 and 128, 64 for fewer heads
    that divide 64 (zero-padded queries, outputs dropped), None where it cannot serve them."""
    if heads in HEADS:
        return heads
    if 0 < heads < PAD_HEADS_TO and PAD_HEADS_TO % heads == 0:
        return PAD_HEADS_TO
    return None


def heads_unsupported(heads: int) -> str | None:
    """Why FlashMLA cannot serve `heads` query heads per rank, or None (start-up and per call)."""
    if padded_heads(heads) is None:
        return f"{heads} heads per rank (FlashMLA: 64 or 128, or fewer that divide 64, padded to 64)"
    return None


def heads_note(heads: int) -> str:
    """How FlashMLA runs `heads` heads per rank, for the start-up log ('' when as they are)."""
    padded = padded_heads(heads)
    return "" if padded in (None, heads) else f"{heads} heads per rank padded to {padded}"


def unsupported(q: torch.Tensor, kv_cache: torch.Tensor, topk: int, v_dim: int) -> str | None:
    """Why FlashMLA cannot serve this call, or None (host code inside the custom op: concrete shapes)."""
    heads, dk = q.shape[1], q.shape[2]
    if q.dtype != torch.bfloat16:
        return f"queries are {q.dtype} (FlashMLA: bfloat16)"
    why_not = heads_unsupported(heads)
    if why_not is not None:
        return why_not
    if v_dim != LATENT_DIM or dk - v_dim != ROPE_DIM:
        return f"latent {v_dim} + rope {dk - v_dim} (FlashMLA: {LATENT_DIM} + {ROPE_DIM})"
    block = DECODE_TOPK_BLOCK if kv_cache.dtype == torch.uint8 else PREFILL_TOPK_BLOCK
    if topk == 0 or topk % block:
        return f"top-k {topk} (FlashMLA {'FP8 decode' if block == DECODE_TOPK_BLOCK else 'bf16 prefill'}: " \
               f"a multiple of {block})"
    if kv_cache.dtype not in (torch.uint8, torch.bfloat16) or kv_cache.stride(-1) != 1:
        return f"an MLA cache of {kv_cache.dtype} (FlashMLA: the FP8 layout or bfloat16)"
    return None


# FP8 decode with 16 heads per rank padded to 64 (4x the MMA work of the real heads): FlashMLA from this many query
# tokens on, the Triton kernel below. H200, bench_mla's padded section
# (benchmarks/kernels/mla_padded_h200_8af7fc2.json):
# Triton 0.017 / 0.032 ms at 1 / 16 tokens against FlashMLA's 0.021 / 0.038; FlashMLA 0.088 against 0.116 at 64.
# At 32 heads (2x) FlashMLA was faster at every batch measured (1, 16, 64).
FP8_QUARTER_HEADS_MIN_TOKENS = 64


def flashmla_wins(num_tokens: int, heads: int, fp8_cache: bool, device: torch.device) -> bool:
    """Should FlashMLA serve this supported call? FP8 decode: always at 32 heads or more (0.181 vs 0.369 ms at B=128,
    378 vs 174 TFLOP/s at B=64, H100, bench_mla: benchmarks/kernels/mla_fp8_h100.md), from
    `FP8_QUARTER_HEADS_MIN_TOKENS` on at 16 or fewer. bf16 prefill: from one wave of its (token, 64-head) CTAs on.
    `heads` per rank as the caller has them (a padded count runs 64: one CTA a token)."""
    if fp8_cache:
        if heads * 4 <= PAD_HEADS_TO:
            return num_tokens >= FP8_QUARTER_HEADS_MIN_TOKENS
        return num_tokens > 0
    return num_tokens * ((padded_heads(heads) or heads) // HEADS_PER_CTA) >= num_sms(device)


def _sched_meta(module: ModuleType, shape: tuple) -> object:
    """Scheduler metadata for one decode shape: kept when made outside graph capture (see module docstring)."""
    key = (module, *shape)
    meta = _SCHED_META.get(key)
    if meta is None:
        meta = module.get_mla_metadata()[0]
        if not _capturing():
            _SCHED_META[key] = meta
    return meta


def _paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The FP8 cache [S, 656] uint8 as FlashMLA's [blocks, block_size, 1, 656] float8_e4m3fn (same bytes)."""
    block = CACHE_BLOCK if kv_cache.shape[0] % CACHE_BLOCK == 0 else 1
    return kv_cache.view(torch.float8_e4m3fn).view(-1, block, 1, kv_cache.shape[1])


def sparse_mla(module: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor,
               sm_scale: float, v_dim: int) -> torch.Tensor:
    """The reference sparse_mla contract through FlashMLA (call `unsupported` first); raises LibraryCallFailed
    if FlashMLA fails. Fewer heads than the kernel's are zero-padded (`padded_heads`) and their outputs dropped."""
    heads = q.shape[1]
    padded = padded_heads(heads)
    if padded != heads:
        q = torch.nn.functional.pad(q, (0, 0, 0, padded - heads))  # [T, padded, dk], the new heads zero
    if kv_cache.dtype == torch.uint8:
        out = _decode(module, q, kv_cache, topk_slots, sm_scale, v_dim)
    else:
        out = _prefill(module, q, kv_cache, topk_slots, sm_scale, v_dim)
    return out if padded == heads else out[:, :heads].contiguous()


def _decode(module: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
            v_dim: int) -> torch.Tensor:
    num_tokens, heads, dk = q.shape
    topk = topk_slots.shape[1]
    kcache = _paged_view(kv_cache)
    q = q.contiguous()
    idx = topk_slots.to(torch.int32).contiguous()
    pieces = []
    try:
        for start in range(0, num_tokens, DECODE_MAX_TOKENS):
            end = min(start + DECODE_MAX_TOKENS, num_tokens)
            n = end - start
            meta = _sched_meta(module, (q.device.index, n, heads, topk, kcache.shape[1]))
            out, _ = module.flash_mla_with_kvcache(
                q[start:end].unsqueeze(1), kcache, None, None, v_dim, meta, None, softmax_scale=sm_scale,
                causal=False, is_fp8_kvcache=True, indices=idx[start:end].unsqueeze(1))
            pieces.append(out.view(n, heads, v_dim))
    except Exception as e:  # a build whose contract differs: never fail the step for it
        raise failed("flash_mla_with_kvcache", e) from e
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _prefill(module: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
             v_dim: int) -> torch.Tensor:
    kv = kv_cache.view(kv_cache.shape[0], 1, kv_cache.shape[1])
    idx = topk_slots.to(torch.int32).contiguous().unsqueeze(1)
    try:
        return module.flash_mla_sparse_fwd(q.contiguous(), kv, idx, sm_scale, v_dim)[0]
    except Exception as e:
        raise failed("flash_mla_sparse_fwd", e) from e
