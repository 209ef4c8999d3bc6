"""DeepGEMM's kernels (indexer logits, dense and grouped FP8 GEMMs), where `deep_gemm` imports on SM90 / SM100.

Contract relied on (DeepGEMM's public Python API; see shared/REFERENCE_NOTES.md):
- `get_paged_mqa_logits_metadata(context_lens [B, next_n] int32, block_kv, num_sms)`
  -> schedule `[num_sms + 1, 2]` int32. Recomputed on every call: a schedule
  made for other context lengths can hang the kernel. `paged_schedule` computes
  the same in torch (checked at start-up) without its per-size JIT.
- `fp8_paged_mqa_logits(q [B, next_n, H, D] e4m3, kv_cache [pages, block_kv, 1, D + 4]
  uint8, weights [B * next_n, H] fp32, context_lens, block_table [B, blocks] int32,
  schedule, max_context_len, clean_logits)` -> `[B * next_n, max_context_len]`
  fp32 (a row-strided view); logits past a row's context are left undefined.
- `fp8_mqa_logits(q [S, H, D] e4m3, (k [S_kv, D] e4m3, k_scale [S_kv] fp32),
  weights [S, H] fp32, ks [S] int32, ke [S] int32, clean_logits)` -> `[S, S_kv]`.

Every query token is handed over as its own batch row (next_n = 1, context
lengths `(N, 1)`, see `context_lens_2d`), so decode, verify and draft-extend
are one case; tree masks and the causal edge are applied afterwards, in place,
by `indexer.mask_invisible_`, which writes -inf over the undefined tail only.

`probe` runs at start-up (attention/select.py decides with it); each engine then holds a `DeepGEMM` handle
(the module, its status, the page sizes whose schedule `paged_schedule` computes, the failures of the calls
made through it at start-up). The functions below take the module as their first argument: the custom ops
(kernels/custom_ops.py) hand them `library()`, the handle its own. A library call that raises becomes
`LibraryCallFailed`: the op serving it runs the Triton kernel for that call and logs the failure once. Nothing
here keeps state between calls, so engines in one process never see each other's DeepGEMM: the start-up
warm-up (the JIT pool, its registry of the classes it is still building, the in-process warm-up) is
kernels/deepgemm_warmup.py, and what the serving functions need of it arrives as an argument
(`moe_contiguous`'s `building`) or is decided by the custom op before it calls here (`fp8_gemm_nt`).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Protocol

import torch

from minidsa.kernels import indexer
from minidsa.kernels.optional_lib import LibraryStatus, failed, import_library, load_library

logger = logging.getLogger(__name__)

NAME = "deep_gemm"
INDEXER_API = ("get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "fp8_mqa_logits")
GEMM_API = ("fp8_gemm_nt",)
SUPPORTED_SM_MAJOR = (9, 10)


def probe(device: torch.device | str, api: tuple[str, ...] = INDEXER_API) -> tuple[ModuleType | None, LibraryStatus]:
    """(deep_gemm, its status) when it serves the functions `api` on `device`, else (None, why not). Start-up only."""
    return load_library(NAME, api, torch.device(device), SUPPORTED_SM_MAJOR, "DeepGEMM needs SM90 or SM100")


def library() -> ModuleType:
    """deep_gemm from Python's module cache, for the custom ops (raises LibraryCallFailed if it does not import)."""
    return import_library(NAME)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


class DeepGEMM:
    """deep_gemm as one engine uses it: made at start-up by attention/select.py (`load_libraries`) on every rank.

    `schedule_pages`: the page sizes at which `paged_schedule` equals this build's metadata on a sample (checked
    here with `check_schedule`, i.e. when DeepGEMM serves the indexer); at those the engine computes the paged
    kernel's schedule itself, elsewhere the build's metadata kernel serves. `failures`: the calls made through
    this handle (the schedule check, the GEMM warm-up: `deepgemm_warmup.warm_up_fp8_gemms`) that failed, one line
    each.
    """

    def __init__(self, module: ModuleType, status: LibraryStatus, device: torch.device | str,
                 check_schedule: bool = False):
        self.module = module
        self.status = status
        self.failures: list[str] = []
        sizes = ((64,) if status.sm_major == 9 else (32, 64)) if check_schedule else ()
        self.schedule_pages = frozenset(p for p in sizes if self._schedule_matches(torch.device(device), p))

    def own_schedule(self, page_size: int) -> bool:
        """Does minidsa compute the paged kernel's schedule at this page size (`paged_schedule`)?"""
        return page_size in self.schedule_pages

    def _schedule_matches(self, device: torch.device, page_size: int) -> bool:
        """Is `paged_schedule` this build's metadata at `page_size` on a sample (zero, partial and whole segments,
        more segments than SMs and fewer)?"""
        num_sms = _num_sms(device)
        samples = [[0, 1, 255, 256, 257, 5000, 64, 3, 70000, 511, 512, 513, 9] * 3, [7, 300]]
        try:
            same = all(torch.equal(paged_schedule(ctx, num_sms).cpu(),
                                   self.module.get_paged_mqa_logits_metadata(ctx, page_size, num_sms).cpu())
                       for ctx in (context_lens_2d(torch.tensor(s, device=device)) for s in samples))
        except Exception as e:
            same = False
            self.failures.append(f"get_paged_mqa_logits_metadata failed: {type(e).__name__}: {e}")
            logger.warning("DeepGEMM: comparing schedules failed (%s: %s)", type(e).__name__, e)
        if not same:
            logger.warning("DeepGEMM: this build's paged-logits schedule differs from minidsa's at page size %d; its "
                           "own metadata kernel serves (it compiles once per batch size class)", page_size)
        return same


# fp8_paged_mqa_logits cuts each query row's context into segments of this many keys and deals the segments out
# evenly to the SMs (DeepGEMM's split_kv, 256 with its 64-key pages).
SCHEDULE_SPLIT_KV = 256


def paged_schedule(context_lens: torch.Tensor, num_sms: int, split_kv: int = SCHEDULE_SPLIT_KV) -> torch.Tensor:
    """The paged kernel's SM schedule for (N, 1) context lengths: [num_sms + 1, 2] int32, where SM i's share
    starts (query row, segment within that row); entry num_sms is the end.

    DeepGEMM's get_paged_mqa_logits_metadata computes the same, but its kernel is JIT-compiled per batch size
    rounded up to 32, and every query token is a batch row here: each new size class of mixed step would compile one
    (~1.5 s each, mid-serving; benchmarks/serving/ENGINE_LOOP.md). These torch ops take any size, have no host
    sync (CUDA graphs capture them) and are checked equal to DeepGEMM's at start-up (`DeepGEMM`)."""
    lens = context_lens.reshape(-1).to(torch.int64)
    if lens.numel() == 0:
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=lens.device)
    segments = (lens + split_kv - 1) // split_kv
    ends = torch.cumsum(segments, 0)  # row r's segments are [ends[r] - segments[r], ends[r])
    total = ends[-1]
    sm = torch.arange(num_sms + 1, device=lens.device)
    start = sm * (total // num_sms) + torch.minimum(sm, total % num_sms)  # the first SMs take one extra
    row = torch.searchsorted(ends, start, right=True)  # the first row ending after `start`; N past the end
    before = torch.where(row > 0, ends[(row - 1).clamp(min=0)], 0)
    segment = torch.where(row < lens.numel(), start - before, 0)
    return torch.stack([row, segment], 1).to(torch.int32)


def paged_supported(sm_major: int, num_heads: int, head_dim: int, page_size: int, fp8_cache: bool) -> str | None:
    """None when the paged kernel takes these shapes on an SM`sm_major`x GPU, else why not (then Triton serves).
    A pure function of static sizes: the start-up choice and the custom op (per call) both ask it."""
    if not fp8_cache:
        return "the indexer cache is not fp8"
    if head_dim not in (32, 64, 128):
        return f"index head dim {head_dim} (DeepGEMM: 32, 64 or 128)"
    if sm_major == 9:
        if num_heads not in (32, 64):
            return f"{num_heads} indexer heads (DeepGEMM on SM90: 32 or 64)"
        if page_size != 64:
            return f"page size {page_size} (DeepGEMM on SM90: 64)"
    else:
        if num_heads not in (8, 16, 32, 64):
            return f"{num_heads} indexer heads (DeepGEMM on SM100: 8 to 64)"
        if page_size not in (32, 64):
            return f"page size {page_size} (DeepGEMM on SM100: 32 or 64)"
    return None


def context_lens_2d(lens: torch.Tensor) -> torch.Tensor:
    """THE one place context lengths are shaped for DeepGEMM: one row per query token, int32 (N, 1)."""
    return lens.reshape(-1, 1).to(torch.int32).contiguous()


def block_table(req_to_token: torch.Tensor, token_rows: torch.Tensor, max_kv_len: int,
                page_size: int) -> torch.Tensor:
    """[T, pages] int32: page ids of each token's row (slots of a page are contiguous and page-aligned)."""
    num_blocks = -(-max_kv_len // page_size)
    cols = torch.arange(num_blocks, device=req_to_token.device) * page_size
    return (req_to_token[token_rows.unsqueeze(1), cols] // page_size).to(torch.int32)


LOGITS_ALIGN = 256  # fp8_paged_mqa_logits allocates rows of align(max_context_len, 256) (its split_kv)


def paged_logits_buffer(num_tokens: int, max_kv_len: int, device: torch.device) -> torch.Tensor:
    """[T, max_kv_len] fp32 with rows of align(max_kv_len, 256): the layout fp8_paged_mqa_logits returns.

    The op serving DeepGEMM returns this layout on every path (the Triton fallback writes into it too), so the
    fake implementation compiled graphs are traced with can state its strides exactly.
    """
    stride = -(-max_kv_len // LOGITS_ALIGN) * LOGITS_ALIGN
    return torch.empty(num_tokens, stride, dtype=torch.float32, device=device)[:, :max_kv_len]


def step_context_lens(kv_lens: torch.Tensor, tree_mask: torch.Tensor | None, max_kv_len: int) -> torch.Tensor:
    """(N, 1) int32 visible end of each query token (its tree's positions included): what the kernel scores."""
    vis_end = kv_lens if tree_mask is None else kv_lens + tree_mask.shape[1]
    return context_lens_2d(vis_end.clamp(max=max_kv_len))


def library_schedule(module: ModuleType, context_lens: torch.Tensor, page_size: int, num_sms: int) -> torch.Tensor:
    """The build's get_paged_mqa_logits_metadata (where `paged_schedule` differs from it); raises LibraryCallFailed."""
    try:
        return module.get_paged_mqa_logits_metadata(context_lens, page_size, num_sms)
    except Exception as e:
        raise failed("get_paged_mqa_logits_metadata", e) from e


def paged_index_logits(
    module: ModuleType,
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    page_size: int,
    req_to_token: torch.Tensor,
    token_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    tree_mask: torch.Tensor | None = None,
    step_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    own_schedule: bool = True,
) -> torch.Tensor:
    """fp8_paged_mqa_logits with the reference index_logits contract; raises LibraryCallFailed if DeepGEMM fails.

    `step_meta` = (context lens, block table, schedule) made once per forward step for every indexer layer
    (`DSABackend.index_metadata`); without it they are made here. A schedule of None: the build's metadata
    kernel makes it here, per call (`own_schedule` False: where `paged_schedule` differs from the build's).
    Returns DeepGEMM's own output (rows strided to 256, see `paged_logits_buffer`), its undefined tail set to
    -inf in place: no copy is made.
    """
    head_dim = q.shape[2]
    if step_meta is None:
        ctx = step_context_lens(kv_lens, tree_mask, max_kv_len)
        step_meta = (ctx, block_table(req_to_token, token_rows, max_kv_len, page_size),
                     paged_schedule(ctx, _num_sms(q.device)) if own_schedule else None)
    ctx, table, sched = step_meta
    if sched is None:
        sched = library_schedule(module, ctx, page_size, _num_sms(q.device))
    kv = index_k.view(index_k.shape[0], page_size, 1, head_dim + 4)
    try:
        logits = module.fp8_paged_mqa_logits(
            q.contiguous().unsqueeze(1), kv, weights.float().contiguous(), ctx, table, sched, max_kv_len, False
        )
    except Exception as e:  # a DeepGEMM build whose contract differs: never fail the step for it
        raise failed("fp8_paged_mqa_logits", e) from e
    return indexer.mask_invisible_(logits, kv_lens, tree_mask)


# Where DeepGEMM's paged kernel beats the Triton one as a step serves them (per layer, with the step's metadata made
# once; CUDA graphs), from benchmarks/scripts/bench_indexer.py on an H100, commit 0644555
# (benchmarks/kernels/bench_indexer_h100.json; the table: benchmarks/kernels/bench_indexer_h100.md): (min tokens, max
# tokens, min context, max context) ranges in which DeepGEMM serves, Triton elsewhere. The kernel alone is faster
# everywhere measured (0.61-0.95x of Triton's time); with the in-place mask of its undefined tail (3-16 us) it ties at
# 1-8 tokens below 16k (1.00-1.02x) and wins from 16 tokens (0.64-0.97x), from 8 tokens at 16k+ (0.88-0.90x) and at 64k+
# for any batch (0.95x at batch 1).
DEEPGEMM_PAGED_WINS: tuple[tuple[int, int, int, int], ...] = (
    (16, 1 << 30, 0, 1 << 30), (8, 1 << 30, 16384, 1 << 30), (1, 1 << 30, 65536, 1 << 30))
# fp8_mqa_logits (one request's prefill chunk, keys gathered, copied to the op's layout) vs the Triton paged
# kernel as served: 396 vs 474 us for a 2048-token chunk at 8k, 2302 vs 3954 us for 4096 at 32k (H100).
DEEPGEMM_RAGGED_WINS = True


def deepgemm_wins(num_tokens: int, max_kv_len: int, ragged: bool) -> bool:
    """Is DeepGEMM measured faster than Triton for this shape? (Called inside the custom op: concrete ints.)"""
    if ragged:
        return DEEPGEMM_RAGGED_WINS
    return any(lo_t <= num_tokens <= hi_t and lo_c <= max_kv_len <= hi_c
               for lo_t, hi_t, lo_c, hi_c in DEEPGEMM_PAGED_WINS)


def extend_index_logits(
    module: ModuleType,
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    page_size: int,
    req_to_token: torch.Tensor,
    token_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
) -> torch.Tensor:
    """Prefill of ONE request through fp8_mqa_logits: its keys gathered contiguous, ks = 0, ke = kv_lens.
    Raises LibraryCallFailed if DeepGEMM fails.

    clean_logits sets everything outside [ks, ke) to -inf, which is exactly the causal visibility.
    """
    head_dim = q.shape[2]
    # The request's row as a device index: no host read, so a captured step (a verify or draft extend of one
    # request) can take this path too.
    slots = req_to_token.index_select(0, token_rows[:1])[0, :max_kv_len]
    k8, k_scale = indexer.gather_index_k(index_k, slots, page_size, head_dim)
    ks = torch.zeros_like(kv_lens, dtype=torch.int32)
    ke = kv_lens.to(torch.int32)
    try:
        return module.fp8_mqa_logits(q.contiguous(), (k8, k_scale), weights.float().contiguous(), ks, ke, True)
    except Exception as e:
        raise failed("fp8_mqa_logits", e) from e


# ---------------------------------------------------------------- dense FP8 GEMM (layers.linear)
# `fp8_gemm_nt((a e4m3 [M, K], a_scale fp32 [M, K/128]), (b e4m3 [N, K], b_scale fp32 [N/128, K/128]), d [M, N] bf16)`:
# d = a @ b^T with DeepSeek's 1x128 activation / 128x128 weight scales; the scale layout DeepGEMM wants is made
# inside it. Used only where the start-up choice gave FP8 linears to DeepGEMM (`KernelChoice.fp8_gemm`).
# Where fp8_gemm_nt beats the Triton w8a8 GEMM, timed as a decode step pays it (CUDA-graph replays over
# weight copies larger than L2; benchmarks/scripts/bench_fp8_gemm.py on an H100, commit 4b8cc62,
# benchmarks/kernels/fp8_gemm_h100.json; the tables: benchmarks/kernels/fp8_gemm_h100.md):
# - from 17 rows on, DeepGEMM is faster on every V3.2 / GLM-5 projection at M = 32, 2048 and 8192 (e.g. V3.2's
#   dense gate|up at 32 rows: 101 vs 201 us; at 8192: 3313 vs 6420 us), and on most at 128;
# - up to 16 rows it is faster only on the large weights (gate|up, down, o_proj: 98 vs 113 us, 54 vs 73,
#   49 vs 58 at M = 1), slower on the small ones (fused q_a|wk|kv_a 17.1 vs 15.4 us, q_b 22.4 vs 21.9).
FP8_GEMM_DEEPGEMM_MIN_ROWS = 17
FP8_GEMM_DEEPGEMM_MIN_WEIGHT = 96 << 20  # N x K (bytes of the e4m3 weight)


def fp8_gemm_wins(m: int, n: int, k: int) -> bool:
    """Is fp8_gemm_nt measured faster than the Triton GEMM for x [m, k] @ w [n, k]^T? (Concrete ints.)"""
    return m >= FP8_GEMM_DEEPGEMM_MIN_ROWS or n * k >= FP8_GEMM_DEEPGEMM_MIN_WEIGHT


def gemm_rows(m: int) -> int:
    """The rows fp8_gemm_nt is run with for an m-row input: m rounded up to its size class, multiples of 16 up to
    128, then 8 classes per doubling (padding under 12.5%).

    DeepGEMM picks its tiles, stages and cluster from M (the fewest waves over the SMs) and JIT-compiles each
    new choice. Mixed steps and prefill chunks come in every token count (up to 22 choices for one V3.2 projection
    at M <= 8192), and each compile mid-serving stalls the step for seconds (benchmarks/serving/ENGINE_LOOP.md).
    With classes the choices are few and fixed, and the start-up warm-up (kernels/deepgemm_warmup.py) compiles
    them all."""
    if m <= 128:
        return -(-m // 16) * 16
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _scales_fit(scales: torch.Tensor, rows: int) -> bool:
    """Activation scales [rows, groups] in a layout DeepGEMM takes: row-major, or MN-major with the column stride
    its TMA reads (rows rounded up to 4)."""
    if scales.shape[0] != rows:
        return False
    return scales.is_contiguous() or (scales.stride(0) == 1 and scales.stride(1) == -(-rows // 4) * 4)


def run_fp8_gemm(module: ModuleType, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`module.fp8_gemm_nt` on x [M, K] bf16 and an e4m3 weight, run with `gemm_rows(M)` rows (the padding rows'
    outputs are never read); raises what DeepGEMM raises. The one way minidsa calls it, so the start-up warm-up
    (kernels/deepgemm_warmup.py: its worker processes, then this process) compiles exactly the kernels serving asks
    for.
    `act`: x already quantised (e4m3 [R, K], fp32 scales [R, K/128], rows past M unread), used when it has
    `gemm_rows(M)` rows, dense e4m3 and scales row-major (which DeepGEMM transposes) or MN-major (read as they are:
    `fp8_gemm.act_buffers`); otherwise x is quantised here into `gemm_rows(M)` rows."""
    from minidsa.kernels.fp8_gemm import quant_act

    m = x.shape[0]
    rows = gemm_rows(m)
    if act is not None and act[0].shape[0] == rows and act[0].is_contiguous() and _scales_fit(act[1], rows):
        xq, xs = act
    else:
        xq, xs = quant_act(x.contiguous(), rows, mn_major=True)
    out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16, device=x.device)
    module.fp8_gemm_nt((xq, xs), (weight, scale_inv.float()), out)
    return out[:m]


def gemm_unsupported(n: int, k: int) -> str | None:
    """Why minidsa does not hand an [N, K] weight to fp8_gemm_nt (the Triton GEMM serves it), or None. K in whole
    128-blocks: the activations' 1x128 scales and the weight's 128x128 ones tile K exactly. N in 64s: what was
    measured and checked (DeepGEMM's SM90 kernel itself asserts neither, its scales being [ceil(N/128), K/128]).
    Every projection of DeepSeek-V3.2 and GLM-5 passes at tensor parallelism 1 to 8 and with the MTP layer."""
    if k % 128:
        return f"K {k} is not a multiple of 128"
    if n % 64:
        return f"N {n} is not a multiple of 64"
    return None


def fp8_gemm_nt(module: ModuleType, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """x [M, K] bf16 @ weight^T through DeepGEMM; None when it does not take this call (the caller runs Triton:
    a dtype or a weight shape it does not take, `gemm_unsupported`), LibraryCallFailed when it fails. Runs
    `gemm_rows(M)` rows (`run_fp8_gemm`)."""
    if x.dtype != torch.bfloat16 or x.shape[0] == 0 or gemm_unsupported(*weight.shape) is not None:
        return None
    try:
        return run_fp8_gemm(module, x, weight, scale_inv, act)
    except Exception as e:  # a build whose contract differs: never fail the step for it
        raise failed("fp8_gemm_nt", e) from e


# ---------------------------------------------------------------- grouped FP8 GEMMs (routed experts, prefill)
# `m_grouped_fp8_gemm_nt_contiguous((a e4m3 [M, K], a_scale fp32 [M, K/128]), (b e4m3 [E, N, K], b_scale fp32
# [E, N/128, K/128]), d [M, N] bf16, m_indices [M] int32)`: row r of a times expert m_indices[r]'s weight, with
# each expert's rows contiguous and padded to `get_mk_alignment_for_contiguous_layout()` (128 on SM90). Builds
# name it differently (the fp8/fp4 one takes e4m3 too); the first name present is used.
GROUPED_CONTIGUOUS_NAMES = ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous")
# Served from this many (token, expert) pairs per expert on (4096 tokens x top-8 / 256 experts = 128).
# H100, commit ac62761, benchmarks/scripts/bench_moe.py (benchmarks/moe/fused_moe_prefill_h100_ac62761.json), V3.2
# expert shapes, as served (quantise, gather, both GEMMs, silu * up, combine): 9.1 ms at 8192 tokens against 12.4 for
# the Triton fused MoE, 19.4 vs 24.6 at 16384; at 2048 tokens (64 pairs per expert) 6.35 vs 6.34, no gain.
MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT = 128


def grouped_contiguous(module: object) -> tuple[object, int] | None:
    """(this build's contiguous grouped FP8 GEMM, its row alignment), or None when it has none."""
    fn = next((getattr(module, n) for n in GROUPED_CONTIGUOUS_NAMES if callable(getattr(module, n, None))), None)
    align = getattr(module, "get_mk_alignment_for_contiguous_layout", None)
    if fn is None or not callable(align):
        return None
    return fn, int(align())


def run_grouped_gemm(gemm, a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     out: torch.Tensor, m_indices: torch.Tensor) -> None:
    """One contiguous grouped GEMM as minidsa calls it (activation scales MN-major, `fp8_gemm.mn_major_scales`):
    `moe_contiguous` and the start-up warm-up both call it, so the warm-up compiles what serving asks for."""
    gemm((a, a_scale), (weight, scale_inv.float()), out, m_indices)


# Tokens per grouped-GEMM pass. Every pass streams all the experts' weights (11.3 GB for DeepSeek-V3.2), so at 8192
# tokens (256 rows per expert) the GEMMs sit at the H100's compute / bandwidth ridge: the MoE as served measured 52.8%
# of the FP8 ceiling at 16384 tokens in chunks of 8192, 64.7% in one pass (69.3% at 32768; H200,
# benchmarks/moe/moe_prefill_h200_8c4b33f.json, benchmarks/moe/PREFILL_MOE.md). One 32768-token pass takes 7.8 GiB
# beside its inputs (measured); a step is only that long when max_prefill_tokens says so, and start-up measures its peak
# before sizing the KV cache.
MOE_MAX_CHUNK_TOKENS = 32768


class Building(Protocol):
    """What `moe_contiguous` needs of the start-up pool's registry (`deepgemm_warmup.Building`)."""

    def __bool__(self) -> bool: ...

    def wait_for(self, classes: list[tuple[int, ...]]) -> None: ...


def moe_contiguous_wins(num_tokens: int, top_k: int, n_experts: int) -> bool:
    """Is the DeepGEMM grouped-GEMM MoE measured faster than the Triton fused MoE at this size? (Concrete ints.)"""
    return num_tokens * top_k >= MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT * n_experts


def moe_contiguous(module: ModuleType, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_scale_inv: torch.Tensor,
                   down_scale_inv: torch.Tensor, max_chunk_tokens: int | None = None,
                   addend: torch.Tensor | None = None, building: Building | None = None) -> torch.Tensor | None:
    """The routed experts (FP8 w8a8, block scales) through DeepGEMM's contiguous grouped GEMMs, plus `addend`
    [T, H] when given; None when it does not take the call (the caller runs the Triton fused MoE),
    LibraryCallFailed when it fails. Same math as `fused_moe.fused_moe_reference`. `building`: the classes the
    start-up pool is still building (`deepgemm_warmup.building()`, None once start-up is over): the activation
    profile's call waits for its row counts there rather than compile them in this process.

    Per chunk of tokens (`max_chunk_tokens`, default MOE_MAX_CHUNK_TOKENS: it bounds the per-row buffers):
    1. `moe_layout.expert_rows`: pairs in rows grouped by expert, each expert's rows padded to DeepGEMM's alignment;
       padding rows marked -1 in `m_indices`, DeepGEMM's contract for them: on SM90 a 64-row half of a block that
       starts with padding is not multiplied (bench_moe's random router at 8192 tokens: 1.13 rows multiplied per
       pair instead of 1.24 with the padding labelled as its expert);
    2. one host sync sizes the rows exactly (prefill runs outside CUDA graphs; DeepGEMM's TMA loads every block it
       is given, even one it skips computing, so a static bound would cost ~20% more loads at 8192 tokens);
    3. `moe_layout.quant_scatter`: each token quantised once, straight into the rows of its pairs;
    4. gate|up GEMM -> `fused_moe.silu_mul` (quantised, padding rows skipped) -> down GEMM; activation scales
       handed over MN-major, the layout DeepGEMM would otherwise transpose them into per call;
    5. `fused_moe.combine_rows`: each token's k rows weighted and summed in one pass, the addend with them.
    """
    grouped = grouped_contiguous(module)
    if grouped is None or x.dtype != torch.bfloat16 or gate_up_scale_inv is None or down_scale_inv is None:
        return None
    gemm, alignment = grouped
    from minidsa.kernels import fused_moe, moe_layout

    num_tokens, top_k = topk_ids.shape
    n_experts, two_i, hidden = gate_up_proj.shape
    if hidden % 128 or two_i % 256:
        return None  # whole 128-blocks in K for both GEMMs (I = two_i / 2)
    chunk = max_chunk_tokens or MOE_MAX_CHUNK_TOKENS
    if num_tokens > chunk:
        parts = [moe_contiguous(module, x[s:s + chunk], topk_ids[s:s + chunk], topk_weights[s:s + chunk],
                                gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv, chunk,
                                None if addend is None else addend[s:s + chunk], building)
                 for s in range(0, num_tokens, chunk)]
        return None if any(p is None for p in parts) else torch.cat(parts)
    layout = moe_layout.expert_rows(topk_ids, n_experts, alignment)
    rows = int(layout.num_rows.item())
    if rows == 0:  # every pair skipped (its experts live on other ranks)
        return torch.zeros_like(x) if addend is None else addend.clone()
    if building:  # the activation profile, beside the pool: its row counts are the pool's first tasks
        building.wait_for([(rows, two_i, hidden, n_experts), (rows, hidden, two_i // 2, n_experts)])
    m_indices = layout.row_expert[:rows]
    a1, s1 = moe_layout.quant_scatter(x, layout.row_of_pair, rows)
    gate_up = torch.empty(rows, two_i, dtype=torch.bfloat16, device=x.device)
    down = torch.empty(rows, hidden, dtype=torch.bfloat16, device=x.device)
    try:
        run_grouped_gemm(gemm, a1, s1, gate_up_proj, gate_up_scale_inv, gate_up, m_indices)
        del a1, s1
        a2, s2 = fused_moe.silu_mul(gate_up, quantise=True, row_expert=m_indices, mn_major_scales=True)
        del gate_up
        run_grouped_gemm(gemm, a2, s2, down_proj, down_scale_inv, down, m_indices)
    except Exception as e:  # a build whose contract differs: never fail the step for it
        raise failed(getattr(gemm, "__name__", "the grouped GEMM"), e) from e
    # Skipped pairs (SKIP ids, expert parallelism) have no row (-1): they add nothing.
    return fused_moe.combine_rows(down, layout.row_of_pair.view(num_tokens, top_k), topk_weights, addend=addend)
