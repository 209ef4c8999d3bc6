"""ModelRunner: decides HOW a batch runs. Owns the model, the KV caches, the req_to_token table and the DSA backend.

The worker (worker.py) builds a `ForwardBatch` from a step plan and hands it here. `forward` /
`forward_mtp` are the entry points: a batch whose shape has a captured CUDA graph (decode, target
verify, the draft's steps and its padded draft extend; see graphs.py) replays it; any other batch
(prefill chunks, mixed steps, decode batches past the largest bucket) runs the uncaptured path, chosen
once in `prepare_fast_paths`. With `enable_compile` on a GPU both run the model through torch.compile
(one dynamic-shape graph per decoder-layer kind, reused by every layer of that kind, every step kind
and every batch shape; no graph breaks; the DSA kernels are custom ops, opaque to it), warmed up at
start-up; otherwise the uncaptured path is `forward_eager` / `forward_mtp_eager`, the plain reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from minidsa.attention.backend import DSABackend
from minidsa.attention.select import KernelChoice, load_libraries
from minidsa.common.batch import ForwardBatch
from minidsa.common.kv_cache import CacheLayouts, KVCache, ReqToTokenTable
from minidsa.common.plan import StepKind
from minidsa.config import ConfigError, ResolvedConfig
from minidsa.exec.compile_cache import CompileCache, CompileStats, count_entries
from minidsa.exec.graphs import DEFAULT_BUCKETS, EXTEND_TOKEN_BUCKETS, GraphShape, StepGraphs
from minidsa.exec.memory import MIN_KV_TOKENS, DoesNotFit, GiB, graph_buffer_bytes, margin_bytes
from minidsa.exec.startup import StartupPhases
from minidsa.kernels.deepgemm import LOGITS_ALIGN
from minidsa.models.deepseek_v32 import MoE, ModelOutput, RunLayer, call_layer, deepgemm_experts
from minidsa.models.two_batch import OverlapCalls, call_attend, call_routed
from minidsa.models.layers.linear import deepgemm_weights
from minidsa.models.loader import build_model
from minidsa.sched.pages import KVCapacity, pages_needed
from minidsa.speculative.layout import SpecLayout

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
# Context buckets of the decode-like graphs (plus the table width): indexer rows span the bucket.
CTX_BUCKETS = [4096, 16384, 65536]


def warm_up_shapes(tokens: int, page_size: int, max_model_len: int, table_width: int
                   ) -> list[tuple[list[int], int]]:
    """The (extend lengths per request, context) batches of the start-up warm-up (`_warm_up_uncaptured`).

    First the general shape, odd sizes (see there), then one-token and one-page variants, then a ladder of
    single-request extends, halving down to ~16 tokens, each an odd count and a multiple of 16. The kernels
    inside the layer pick tiles by size class (`fused_moe.tile_config` by pairs per expert, the FP8 GEMM's
    BLOCK_M), and Triton specialises integer arguments divisible by 16, so each class compiles kernels the first
    time it runs (DeepGEMM's GEMM classes have their own warm-up, `_warm_up_deepgemm`). Compiled mid-serving, that
    time lands in requests' TTFT; the ladder pays it at start-up instead (the disk caches keep it). What it cost
    before the ladder: benchmarks/serving/NOTES.md.
    """
    n = max(3, tokens - 4)
    n -= 1 - n % 2  # odd
    # Short contexts (one page) too: their key widths are aligned (`_aligned_keys`), so they share the general
    # graph, but the kernels inside meet other size classes.
    context = max(3, min(max(n, 4 * page_size + 1), max_model_len, table_width))
    context -= 1 - context % 2
    shapes = [([n, 2, 2], context), ([n], context), ([1], context)]
    if page_size >= 3 and context > page_size:
        shapes += [([n, 2], 3), ([1], 3)]
    m = n
    while m >= 8:
        shapes += [([min(-(-m // 16) * 16, tokens // 16 * 16)], context)]
        shapes += [([m | 1], context)] if m != n else []  # n: traced above
        m //= 2
    return shapes


def decode_graph_shapes(spec_layout: SpecLayout | None) -> list[GraphShape]:
    """The decode-like step kinds to capture: plain decode, or the speculator's verify / draft / draft extend (with a
    speculator every decode step is a speculative round). Chains are causal (no tree mask); trees carry one."""
    if spec_layout is None:
        return [GraphShape(StepKind.DECODE, 1, 0, logits_per_req=1)]
    nd, k, chain = spec_layout.num_draft_tokens, spec_layout.topk, spec_layout.topk == 1
    shapes = [GraphShape(StepKind.VERIFY, nd, 0 if chain else nd),
              GraphShape(StepKind.DRAFT_EXTEND, nd, 0, logits_per_req=1)]
    if spec_layout.num_steps > 1:
        shapes.append(GraphShape(StepKind.DRAFT, k, 0 if chain else spec_layout.draft_width))
    return shapes


def _compiled(fn: Callable, backend: str | Callable) -> Callable:
    """`fn` (a layer or a layer's stage) through torch.compile, as `ModelRunner.compile_layer` says."""
    # Dynamo keys its cache on the code object and guards on the layer's type and attributes: several
    # engines in one process (tests, notebooks, the benchmark suite) outgrow the default limit of 8, a hard
    # error with fullgraph.
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    # No runtime autotuning of pointwise kernels (up to 6 configs each, timed at first launch, for every graph):
    # it was the largest part of a cold start, and serving measured no slower without it
    # (benchmarks/startup/NOTES.md); reductions keep theirs.
    options = {"triton.autotune_pointwise": False} if backend == "inductor" else None
    return torch.compile(fn, dynamic=True, fullgraph=True, backend=backend, options=options)


def _weights_detail(model: torch.nn.Module, path: str | None) -> str:
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return f"{size / 2**30:.1f} GiB, {'from ' + path if path else 'random'}"


# The indexer-logits width (max_kv_len) of batches through the compiled layer is a multiple of this, as the
# decode graphs' context buckets are: DeepGEMM's paged logits rows are LOGITS_ALIGN-aligned, so an unaligned width
# makes the layer guard on alignment (a second graph per layer kind), and a one-page width (short prompts) on a
# block table one wide (a third). Wider rows only add key columns that kv_lens masks.
KEY_ALIGN = LOGITS_ALIGN


def _aligned_keys(batch: ForwardBatch, table_width: int) -> ForwardBatch:
    """The batch with its indexer-logits width rounded up to KEY_ALIGN (the table width is a multiple of it)."""
    width = min(-(-max(batch.max_kv_len, 1) // KEY_ALIGN) * KEY_ALIGN, table_width)
    return batch if batch.max_kv_len == width else dataclasses.replace(batch, max_kv_len=width)


def layer_tracing():
    """The symbolic-size settings every call of a compiled layer runs under (Dynamo reads them when it traces,
    inside a step: set once per step, not per layer, ~15 us each).
    - No duck sizing: sizes merely equal at the first trace (the batch and DeepGEMM's block-table width, both 64
      at the largest bucket; req_to_token's rows and a batch) would share one symbol, a guard every other batch
      fails.
    - Size-oblivious: a size that is 1 at the first trace stays a symbol, so one-token batches and one-page
      caches share the graph (the layer avoids ops that treat one row apart: einsum, `x[idx] = v`, reshape of a
      transposed product)."""
    return torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True)


def mark_fixed_dims(attn: DSABackend) -> None:
    """The dims of `attn`'s persistent tensors that the model fixes are static for the compiled layer (no symbol
    to trace or guard); those the engine's sizing sets stay symbolic, so the activation profile's one-page
    scratch cache and the engine's cache share one graph."""
    for t, sized in attn.persistent_tensors():
        for dim in range(t.dim()):
            if dim not in sized:
                torch._dynamo.mark_static(t, dim)


class ModelRunner:
    def __init__(self, resolved: ResolvedConfig, kernels: KernelChoice, progress: bool = True):
        """Builds the model (weights in their serving formats), sizes and allocates the KV cache. What it decides
        is its own (`kv_capacity`, `max_model_len`): nothing is written into the configuration."""
        self.resolved = resolved
        self.config = config = resolved.args
        self.model_config = model_config = resolved.model
        decode_reserve = resolved.decode_reserve
        self.device = resolved.device
        self.dtype = resolved.dtype
        self.page_size = config.page_size
        self.progress = progress
        self.startup = StartupPhases()
        try:  # before loading weights: a layout the model's shapes cannot take fails fast
            layouts = CacheLayouts.for_model(model_config, self.dtype, config.kv_cache_dtype,
                                             config.indexer_cache_dtype == "fp8", self.page_size)
        except ValueError as e:
            raise ConfigError("kv_cache_dtype", str(e)) from e
        self.mla_layout, self.index_layout = layouts.mla, layouts.index
        self.compile_cache: CompileCache | None = None
        root = resolved.compile_cache_dir  # the tools already write there: resolve() pointed them at it
        self.kernels = kernels
        self.libraries = load_libraries(self.kernels, self.device)
        with self.startup.phase("weights") as phase:
            self.model = build_model(model_config, resolved.model_path, self.dtype, self.device, seed=config.seed,
                                     init_std=resolved.init_std, progress=progress, quantization=config.quantization,
                                     gemm=self.kernels.fp8_gemm, moe_gemm=self.kernels.moe_gemm,
                                     router=self.kernels.router, norm_quant=self.kernels.norm_quant,
                                     mla_absorb=self.kernels.mla_absorb, fp32_gemv=self.kernels.fp32_gemv,
                                     head_norm=self.kernels.head_norm)
            phase.detail = _weights_detail(self.model, resolved.model_path)
        # The start-up's scratch steps (activation profile, warm-up) put their tokens at positions 0 .. step_tokens - 1,
        # past max_position_embeddings where a step holds more tokens than the model has positions (a tiny model).
        self.model.rotary.cover(self.step_tokens)
        if root is not None:
            self.compile_cache = CompileCache.for_engine(config, model_config, self.device, root)
        # The engine's compiled decoder layer (a GPU, compile and graphs on). The activation profile below runs
        # it first, so torch.compile traces beside DeepGEMM's pool instead of after it, in the capture.
        self.layer: RunLayer | None = None
        self.overlap: OverlapCalls | None = None  # two-batch overlap's stages, compiled (None: uncompiled)
        self.compiled = False
        if self.device.type == "cuda" and config.enable_compile and config.enable_cuda_graph:
            if self.compile_cache is not None:
                with self.startup.phase("compile cache") as phase:
                    phase.detail = self.compile_cache.load()
            self.layer = self.compile_layer("inductor")
            if config.enable_two_batch_overlap:
                self.overlap = self.compile_overlap("inductor")
        num_layers = model_config.num_layers_with_mtp
        indexer_layers = list(layouts.indexer_layers)
        self._indexer_layers = indexer_layers
        self.kv_bytes_per_token = layouts.bytes_per_token
        # DeepGEMM's GEMM kernels compile in a pool of processes (tens of seconds of nvcc on a fresh machine),
        # beside the activation profile that sizes the KV cache (the classes of its steps dealt out first; until
        # one is built, the Triton GEMM serves it). The pool stops before the KV cache is sized, as its CUDA
        # contexts hold free memory; the warm-up in `prepare_fast_paths` loads the kernels.
        self._gemm_jit = None
        if self.device.type == "cuda":
            from minidsa.kernels.deepgemm_warmup import GemmWarmUp

            # Without speculation the MTP layer never runs (no profile, warm-up or step reaches it): its shape of
            # its own (eh_proj) would be compiled for nothing.
            idle = None if self._mtp_catches_up else self.model.mtp_layer
            self._gemm_jit = GemmWarmUp.for_weights(deepgemm_weights(self.model, idle),
                                                    deepgemm_experts(self.model, idle),
                                                    self.step_tokens, self.device, self.libraries.deepgemm,
                                                    share=config.tensor_parallel_size,
                                                    workers=resolved.deepgemm_jit_workers)
        reserve = None
        if self.device.type == "cuda" and not config.max_total_tokens:
            reserve = self._profile_beside_pool(progress)
        if self._gemm_jit is not None:
            with self.startup.phase("DeepGEMM JIT") as phase:
                phase.detail = self._gemm_jit.compile_in_pool(progress)  # the rest of the pool, or all of it
        kv_start = time.perf_counter()
        total_tokens = config.max_total_tokens or self._auto_kv_tokens(reserve)
        num_pages = pages_needed(total_tokens, self.page_size) + 1  # + the reserved dummy page
        self.num_pages = num_pages
        capacity = (num_pages - 1) * self.page_size

        # Longest request: fits alone in the cache with room for one decode step's new positions.
        limit = min(model_config.max_position_embeddings, capacity - decode_reserve)
        if limit < 2:
            raise ConfigError("max_total_tokens", f"{total_tokens} leaves no room for a request")
        if config.max_model_len > limit:
            raise ConfigError("max_model_len", f"{config.max_model_len} exceeds what fits: {limit} "
                              f"(max_position_embeddings {model_config.max_position_embeddings}, "
                              f"KV capacity {capacity} tokens minus {decode_reserve} decode positions)")
        self.max_model_len = config.max_model_len or limit
        row_align = math.lcm(self.page_size, KEY_ALIGN)  # every key width the compiled layer sees fits a row
        table_width = -(-(self.max_model_len + decode_reserve) // row_align) * row_align
        self.model.rotary.cover(table_width)  # every row position a step can have (draft tokens past max_model_len)
        self.req_to_token_table = ReqToTokenTable(config.max_running_requests, table_width, self.device)
        self.kv_cache = KVCache(num_layers, num_pages, self.mla_layout, self.index_layout, self.device,
                                indexer_layers)
        self.startup.record("KV cache", time.perf_counter() - kv_start,
                            f"{capacity} tokens, {self.kv_bytes_per_token * capacity / 2**30:.1f} GiB")
        self.attn = DSABackend(self.kv_cache, self.req_to_token_table.req_to_token, model_config.index_topk,
                               self.kernels, self.libraries)
        self.table_width = table_width
        mark_fixed_dims(self.attn)
        self.graphs: StepGraphs | None = None
        self._idle_batches: dict[StepKind, ForwardBatch] = {}  # `idle_batch(kind, in_graph=True)`
        # How a batch without a captured graph runs (prefill chunks, mixed steps, oversized decode batches):
        # the plain modules, or the compiled layer once `prepare_fast_paths` compiled it. Chosen there, once.
        self._run_uncaptured: Callable[[ForwardBatch], ModelOutput] = self.forward_eager
        self._run_mtp_uncaptured: Callable[[ForwardBatch, torch.Tensor, torch.Tensor | None], ModelOutput] = \
            self.forward_mtp_eager
        logger.info("KV cache: %d tokens in %d pages of %d (%d bytes per token, MLA %s); max_model_len %d",
                    capacity, num_pages - 1, self.page_size, self.kv_bytes_per_token, self.mla_layout.kind,
                    self.max_model_len)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step can hold (DeepGEMM's row classes and the warm-up go up to it)."""
        return self.resolved.step_tokens

    @property
    def req_to_token(self) -> torch.Tensor:
        """[num_rows, width] int32: row position -> KV slot, one row per running request."""
        return self.req_to_token_table.req_to_token

    @property
    def num_rows(self) -> int:
        """Rows of req_to_token: the most requests that can run at once."""
        return self.req_to_token.shape[0]

    @property
    def kv_capacity(self) -> KVCapacity:
        """What the control plane allocates (sched/pages.py): KV pages (page 0 the dummy page) and rows."""
        return KVCapacity(self.num_pages, self.page_size, self.num_rows)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of slots `src` to slots `dst`: the MLA and indexer caches of every layer."""
        self.attn.kv_move(src, dst)

    def _auto_kv_tokens(self, reserve: int | None) -> int:
        """KV tokens from the free memory, less `reserve` (`_activation_reserve`'s bytes; None off CUDA)."""
        if self.device.type != "cuda":
            return CPU_DEFAULT_MAX_TOTAL_TOKENS
        per_token = self.kv_bytes_per_token  # from the layouts (fp8 MLA: 1.6-1.8x the tokens of bf16)
        decode_reserve = self.resolved.decode_reserve
        free, _ = torch.cuda.mem_get_info(self.device)
        # The KV cache takes a share of what the weights and the activation reserve leave, so other tenants of
        # the GPU and the allocator's fragmentation keep some room.
        budget = int(max(free - reserve, 0) * self.config.kv_cache_mem_fraction)
        # Never more than every request slot filled to the longest context could use.
        longest = self.config.max_model_len or self.model_config.max_position_embeddings
        tokens = min(budget // per_token, self.config.max_running_requests * (longest + 2 * self.page_size))
        # On a coarse grid (under 1.6% less): free memory differs by megabytes from one start to the next, and the
        # cache's page count is a static shape of the compiled layers, so an exact count would miss the persistent
        # compile cache on every start.
        step = max(self.page_size, 1 << max(tokens.bit_length() - 7, 0))
        tokens = tokens // step * step
        needed = (self.config.max_model_len or min(longest, MIN_KV_TOKENS)) + decode_reserve
        if tokens < needed:
            raise DoesNotFit(
                f"the KV cache does not fit: {free / GiB:.1f} GiB free after the weights, {reserve / GiB:.1f} GiB "
                f"reserved for activations and CUDA graphs, {budget / GiB:.2f} GiB left for the KV cache "
                f"(kv_cache_mem_fraction {self.config.kv_cache_mem_fraction}) = {tokens} tokens, {needed} needed; "
                f"try a smaller --max-prefill-tokens / --max-running-requests / --max-model-len, or more GPUs")
        logger.info("KV cache sized automatically: %.1f GiB free after the weights, %.2f GiB reserved for the largest "
                    "step of each kind and the CUDA graphs' buffers, %.1f%% of the rest", free / GiB, reserve / GiB,
                    100 * self.config.kv_cache_mem_fraction)
        return tokens

    def _profile_beside_pool(self, progress: bool) -> int:
        """`_activation_reserve` while DeepGEMM's pool (if any) compiles. The workers' CUDA contexts hold GPU
        memory meanwhile: a profile that runs out of it runs again once the pool has ended."""
        jit = self._gemm_jit
        free, _ = torch.cuda.mem_get_info(self.device)  # what the KV cache can have, before the workers start

        def profile() -> int:
            with self._compiling_phase("activation profile") as phase, \
                    (jit.beside_pool() if jit is not None else contextlib.nullcontext()):
                reserve, phase.detail = self._activation_reserve(free)
            return reserve

        try:
            if jit is not None:
                jit.start_pool(self._profile_rows(), progress)
            try:
                return profile()
            except torch.cuda.OutOfMemoryError:
                if jit is None or jit.pool is None:
                    raise
            torch.cuda.empty_cache()
            logger.warning("the activation profile ran out of GPU memory beside DeepGEMM's compile processes; it "
                           "runs again after them")
            with self.startup.phase("DeepGEMM JIT") as phase:
                phase.detail = jit.finish_pool()
            return profile()
        except BaseException:
            if jit is not None:
                jit.abort_pool()
            raise

    @property
    def _mtp_catches_up(self) -> bool:
        """Speculation is on: the MTP layer runs over every prefill after the main model."""
        return self.resolved.decode_reserve > 1 and self.model.mtp_layer is not None

    def _profile_rows(self) -> list[int]:
        """Token counts of `_activation_reserve`'s steps: the largest prefill, the largest decode-like step."""
        return [self.step_tokens, self.resolved.decode_reserve * self.config.max_running_requests]

    def profile_steps(self, free: int, layer: RunLayer | None) -> tuple[int, dict[str, Callable[[], None]]]:
        """The activation profile's steps, on a one-page scratch cache at the longest context the KV cache could
        give them (`free`: bytes free after the weights), and that context: "prefill", the largest prefill step
        (and the MTP layer's catch-up over it when speculation is on), then "decode", the largest decode-like step
        (a speculative verify: every request's draft tokens, logits for each). Every position maps to the dummy
        slot 0."""
        cfg, mc, dev, decode_reserve = self.config, self.model_config, self.device, self.resolved.decode_reserve
        context = min(mc.max_position_embeddings, cfg.max_model_len or mc.max_position_embeddings,
                      max(free // self.kv_bytes_per_token, 2))
        row_align = math.lcm(self.page_size, KEY_ALIGN)  # a key width the compiled layer takes (`_aligned_keys`)
        context = -(-(context + decode_reserve) // row_align) * row_align
        scratch_rows = ReqToTokenTable(1, context, dev)
        scratch = KVCache(mc.num_layers_with_mtp, 1, self.mla_layout, self.index_layout, dev, self._indexer_layers)
        attn = DSABackend(scratch, scratch_rows.req_to_token, mc.index_topk, self.kernels, self.libraries)
        mark_fixed_dims(attn)
        with_mtp = self._mtp_catches_up

        def scratch_batch(lens: list[int], logits: str) -> ForwardBatch:
            n = sum(lens)
            return ForwardBatch.build(StepKind.EXTEND, torch.arange(n, device=dev) % mc.vocab_size, [0] * len(lens),
                                      [0] * len(lens), lens, torch.zeros(n, dtype=torch.int64, device=dev), dev,
                                      logits=logits, kv_lens=torch.ones(n, dtype=torch.int64, device=dev),
                                      max_kv_len=context)

        @torch.no_grad()
        def prefill() -> None:
            batch = scratch_batch([self.step_tokens], "last")
            with layer_tracing():
                out = self.model(batch, attn, layer)
                if with_mtp:
                    self.model.forward_mtp(batch, attn, out.hidden, out.topk, layer)

        @torch.no_grad()
        def decode_like() -> None:
            with layer_tracing():
                self.model(scratch_batch([decode_reserve] * cfg.max_running_requests, "all"), attn, layer)

        return context, {"prefill": prefill, "decode": decode_like}

    @torch.no_grad()
    def _activation_reserve(self, free: int) -> tuple[int, str]:
        """Bytes the steps need beside the weights and the KV cache, measured, and the start-up log's detail:
        `profile_steps` run once each, through the layer uncaptured steps run (`self.layer`: torch.compile traces
        it here, largest step first, as `_warm_up_uncaptured` needs); their peaks (graphs have their own pool,
        uncaptured steps the allocator's cache: both are counted), the CUDA graphs' per-kind buffers and a margin
        are reserved. The steps do not wait for DeepGEMM's pool: a dense GEMM class it has not built yet runs on the
        Triton GEMM (`GemmWarmUp.beside_pool`; the same output buffer, no workspace: the same peak); only the MoE of
        the largest step waits for its grouped-GEMM row count, which the pool builds first."""
        cfg, mc, dev, decode_reserve = self.config, self.model_config, self.device, self.resolved.decode_reserve
        _, total = torch.cuda.mem_get_info(dev)

        def peak(run) -> int:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            run()
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base

        context, steps = self.profile_steps(free, self.layer)
        peaks = {name: peak(run) for name, run in steps.items()}
        del steps
        step_tokens, decode_rows, with_mtp = self.step_tokens, cfg.max_running_requests, self._mtp_catches_up
        torch.cuda.empty_cache()
        nd, logit_rows = decode_reserve, (decode_reserve if decode_reserve > 1 else 1)
        kinds_tokens, kinds_rows = ([nd, nd, 1], [logit_rows, 1, 1]) if with_mtp else ([1], [1])
        buffers = graph_buffer_bytes(mc, self.dtype, min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
                                     kinds_tokens, kinds_rows, max(b for b in EXTEND_TOKEN_BUCKETS
                                                                   if b <= step_tokens)
                                     if cfg.enable_cuda_graph and not cfg.enable_dp_attention else 0,
                                     cfg.max_running_requests) if cfg.enable_cuda_graph else 0
        reserve = peaks["prefill"] + peaks["decode"] + buffers + margin_bytes(total)
        logger.info("activation reserve %.2f GiB: prefill step of %d tokens at context %d %.2f GiB%s, decode-like "
                    "step of %d x %d tokens %.2f GiB, CUDA graph buffers %.2f GiB, margin %.2f GiB", reserve / GiB,
                    step_tokens, context, peaks["prefill"] / GiB, " (with the MTP catch-up)" if with_mtp else "",
                    decode_rows, decode_reserve, peaks["decode"] / GiB, buffers / GiB, margin_bytes(total) / GiB)
        return reserve, f"{reserve / GiB:.2f} GiB reserved"

    # -- compile and graphs -------------------------------------------------------
    def prepare_fast_paths(self, spec_layout: SpecLayout | None) -> None:
        """torch.compile and CUDA-graph capture (a GPU only), once, after the speculator (if any) fixed its step
        shapes: the step functions (`step_functions`), the graphs over them (`build_graphs`), routed and warmed up
        (`use_graphs`). Tests compose the same pieces on CPU (tests/harness.py: `static_fast_paths`)."""
        cfg = self.config
        if self.device.type != "cuda":
            if cfg.enable_cuda_graph or cfg.enable_compile:
                logger.info("CUDA graphs and torch.compile skipped: device is %s (they need a CUDA GPU)",
                            self.device)
            return
        step_tokens = self.step_tokens
        self._warm_up_deepgemm(step_tokens)
        if not cfg.enable_cuda_graph:
            logger.info("CUDA graphs disabled (enable_cuda_graph=False): decode runs eagerly, uncompiled "
                        "(torch.compile serves the captured steps)")
            return
        run_main, run_mtp = self.step_functions(self.layer, self.overlap)
        # torch.compile traced the layer in the activation profile; what the capture and the warm-up still
        # compile (new guards, other kernels) their lines say.
        with self._compiling_phase("capture") as phase:
            graphs = self.build_graphs(spec_layout, run_main, run_mtp)
            phase.detail = f"{len(graphs.static)} CUDA graphs"
        self.use_graphs(graphs, warm_up_tokens=step_tokens)
        if self.compile_cache is not None and self.compiled:
            with self.startup.phase("compile cache save") as phase:
                phase.detail = self.compile_cache.save()

    def build_graphs(self, spec_layout: SpecLayout | None, run_main: Callable[[ForwardBatch], ModelOutput],
                     run_mtp: Callable[..., ModelOutput]) -> StepGraphs:
        """The step graphs this engine serves with (decode or the speculator's kinds, and EXTEND), over the step
        functions given: CUDA graphs captured on a GPU; elsewhere their static, padded buffers run eagerly."""
        cfg = self.config
        shapes = decode_graph_shapes(spec_layout)
        limit = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        buckets = [b for b in DEFAULT_BUCKETS if b <= limit] or [1]
        if buckets[-1] < limit:
            buckets.append(limit)
        # Under DP attention prefill chunks and mixed steps run uncaptured (a step whose ranks do not all decode
        # runs every rank uncaptured: `parallel.dp_attention.step_graph`), so no EXTEND graph is captured
        extend_buckets = [] if cfg.enable_dp_attention else \
            [b for b in EXTEND_TOKEN_BUCKETS if b <= self.step_tokens]
        if extend_buckets:  # prefill chunks and mixed steps up to a bucket's tokens
            shapes.append(GraphShape(StepKind.EXTEND, 0, 0))
        if cfg.enable_two_batch_overlap:
            least = cfg.two_batch_overlap_min_tokens
            logger.info("two-batch overlap: main-model steps of %d tokens or more on a rank (graphs: %s) run their MoE "
                        "layers as two micro-batches", least,
                        ", ".join(f"{s.kind.name.lower()} from {max(2, -(-least // s.tokens_per_req))} requests"
                                  for s in shapes if not s.mtp and s.tokens_per_req))
        return StepGraphs(run_main, run_mtp, shapes, buckets, self.table_width, self.model_config.hidden_size,
                          self.dtype, self.device, capture=self.device.type == "cuda", ctx_buckets=CTX_BUCKETS,
                          extend_buckets=extend_buckets, max_requests=cfg.max_running_requests,
                          two_batch_min=cfg.two_batch_overlap_min_tokens if cfg.enable_two_batch_overlap else 0)

    def use_graphs(self, graphs: StepGraphs, warm_up_tokens: int) -> None:
        """Serve batches through `graphs` from now on. When their step functions are compiled, batches without a
        graph (prefill chunks, mixed steps, oversized decode batches) run the same compiled layer, warmed up here
        over steps of up to `warm_up_tokens` tokens: the first real prefill must not compile mid-serving."""
        self.graphs = graphs
        if not self.compiled:
            return
        run_main, run_mtp = graphs.run_main, graphs.run_mtp
        width = self.table_width
        self._run_uncaptured = lambda batch: run_main(_aligned_keys(batch, width))
        self._run_mtp_uncaptured = lambda batch, hidden, topk: run_mtp(_aligned_keys(batch, width), hidden, topk)
        with self._compiling_phase("warm-up") as phase:
            # under speculation the MTP layer catches up after every prefill: its uncaptured path is warmed up too
            shapes = self._warm_up_uncaptured(StepKind.DRAFT_EXTEND in graphs.shapes, warm_up_tokens)
            phase.detail = f"{len(shapes)} prefill / mixed shapes"

    @contextlib.contextmanager
    def _compiling_phase(self, name: str):
        """A start-up phase that may compile: its line adds what torch.compile and Triton did meanwhile."""
        triton_dir = os.environ.get("TRITON_CACHE_DIR") if self.compile_cache is not None else None
        before, kernels = CompileStats.now(), count_entries(triton_dir)
        with self.startup.phase(name) as phase:
            yield phase
            done = CompileStats.now().since(before).describe()
            if triton_dir:
                done += f", {count_entries(triton_dir) - kernels} Triton kernels compiled"
            phase.detail = f"{phase.detail}; {done}" if phase.detail else done

    def compile_layer(self, backend: str | Callable) -> RunLayer:
        """`call_layer` through torch.compile with `backend` ("inductor" on a GPU; tests hand in recording ones).

        Regional compilation: torch.compile compiles one decoder layer, not the unrolled forward; every layer of
        a kind (dense / MoE, own / shared top-k, MTP) reuses that graph, so start-up does not grow with depth.
        The embedding, the layer loop and the head run eagerly around them, inside the same CUDA graph capture.
        dynamic=True, with size-oblivious sizes (`layer_tracing`): one graph per layer kind serves every batch
        and context bucket, captured or not, one-token batches included (Dynamo's 0/1 specialisation would trace
        each kind twice), and every cache of the same layouts (the activation profile's scratch cache, then the
        engine's: `mark_fixed_dims`). What varies per batch reaches the layer as symbolic sizes and ints:
        request-sized tensors stay outside it (`DSABackend.index_metadata`), and shape-dependent kernel choices
        are made inside the opaque custom ops, so they add no guards. fullgraph=True: a graph break is an error
        here, not a silent slowdown.
        """
        logger.info("torch.compile (%s): one decoder layer per layer kind, reused by every layer", backend)
        return _compiled(call_layer, backend)

    def compile_overlap(self, backend: str | Callable) -> OverlapCalls:
        """Two-batch overlap's stages of a MoE layer through torch.compile, as `compile_layer` compiles the whole
        layer (the collectives between them run eagerly: models/two_batch.py)."""
        logger.info("torch.compile (%s): two-batch overlap's stages of a MoE layer", backend)
        return OverlapCalls(_compiled(call_attend, backend), _compiled(call_routed, backend))

    def step_functions(self, layer: RunLayer | None = None, overlap: OverlapCalls | None = None):
        """(run_main(batch), run_mtp(batch, hidden_prev, prev_topk=None)) through `layer` (a `compile_layer`),
        or the plain modules (None); two-batch overlap's stages through `overlap` (`compile_overlap`; None: the
        plain stages)."""
        if layer is None:
            return self.forward_eager, self.forward_mtp_eager
        self.compiled = True

        @torch.no_grad()
        def run_main(batch: ForwardBatch, layers: list[int] | None = None) -> ModelOutput:
            with layer_tracing():
                return self.model(batch, self.attn, layer, layers, overlap)

        @torch.no_grad()
        def run_mtp(batch: ForwardBatch, hidden_prev: torch.Tensor, prev_topk: torch.Tensor | None = None
                    ) -> ModelOutput:
            with layer_tracing():
                return self.model.forward_mtp(batch, self.attn, hidden_prev, prev_topk, layer)

        return run_main, run_mtp

    def _warm_up_deepgemm(self, step_tokens: int) -> None:
        """DeepGEMM's dense FP8 GEMM JIT-compiles per tile choice, and the choice follows the rows: every row
        class a step can bring (`deepgemm.gemm_rows`, up to `step_tokens`) runs once here, per weight shape,
        so no prefill or mixed step compiles one mid-serving (seconds each). The pool of processes started in
        `__init__` compiled them: this loads them (and compiles what it left)."""
        if self._gemm_jit is None:
            return
        with self.startup.phase("DeepGEMM") as phase:
            phase.detail = self._gemm_jit.load()

    def _warm_up_uncaptured(self, with_mtp: bool, tokens: int) -> list[tuple[list[int], int]]:
        """Run the uncaptured compiled path once per shape class it will meet, so that Dynamo / inductor (and the
        kernels' JIT) are paid at start-up, not by the first prefill: a mixed step (a long run beside two short
        rows), a single request, a one-token extend (its kernels meet other size classes); with speculation, the
        MTP layer over the same shapes, handed the main model's top-k as after a prefill.

        `tokens`: the most tokens a step can hold. Inductor picks 32-bit indexing for a kernel when the sizes of
        the first trace allow it and guards on that (a [tokens, heads, 576] query of the real models passes 2^31
        elements near 29k tokens): when the activation profile did not trace the layer (a fixed KV size skips
        it), running the largest step here makes a later one compile nothing. Duck sizing is off while the layer
        traces (`layer_tracing`), but odd token counts and contexts (the model's widths are even) and three
        requests still keep a trace from meeting an equality no real batch has. The batches only touch the
        reserved dummy slot (`_scratch_extend_batch`), through one layer of each kind (`one_layer_per_kind`)."""
        shapes = warm_up_shapes(tokens, self.page_size, self.max_model_len, self.table_width)
        layers = self.model.one_layer_per_kind()  # what compiles is the same for every layer of a kind
        start = time.perf_counter()
        for lens, ctx in tqdm(shapes, desc="Warm-up", unit="shape", disable=None if self.progress else True,
                              leave=False):
            batch = self._scratch_extend_batch(lens, ctx)
            self.graphs.run_main(_aligned_keys(batch, self.table_width), layers)
            if self.config.enable_dp_attention and (lens, ctx) == shapes[0]:
                # DP attention: a step whose ranks' row counts differ reaches the MoE layers with its padding and
                # real rows (`ForwardBatch.dp_pad`, `dp_real_rows`): the layer's other graph, traced here (every
                # rank alike: no padding, every gathered row real)
                n, ranks = batch.num_tokens, self.config.tensor_parallel_size
                uneven = dataclasses.replace(batch, dp_tokens=(n,) * ranks,
                                             dp_pad=torch.empty(0, dtype=torch.int64, device=self.device),
                                             dp_real_rows=torch.arange(n * ranks, device=self.device))
                self.graphs.run_main(_aligned_keys(uneven, self.table_width), layers)
            if with_mtp and self.model.mtp_layer is not None:
                hidden = self.idle_hidden(batch.num_tokens)
                topk = torch.zeros(batch.num_tokens, self.model_config.index_topk, dtype=torch.int32,
                                   device=self.device)
                self._run_mtp_uncaptured(dataclasses.replace(batch, kind=StepKind.DRAFT_EXTEND), hidden, topk)
                if self.config.enable_dp_attention and (lens, ctx) == shapes[0]:
                    # DP attention runs a speculative round uncaptured beside a prefilling rank: the MTP layer's
                    # MoE with either row layout, and its draft forwards compute their own top-k (none handed)
                    for dp_batch, handed in ((uneven, topk), (batch, None), (uneven, None)):
                        self._run_mtp_uncaptured(dataclasses.replace(dp_batch, kind=StepKind.DRAFT_EXTEND), hidden,
                                                 handed)
        if self.overlap is not None:
            self.warm_up_overlap(shapes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.debug("compiled prefill / mixed path warmed up in %.1f s (extends of %s tokens per request, with "
                     "contexts)", time.perf_counter() - start, shapes)
        return shapes

    @torch.no_grad()
    def warm_up_overlap(self, shapes: list[tuple[list[int], int]]) -> None:
        """Two-batch overlap's compiled stages (`self.overlap`) over the warm-up's shapes, on the first MoE layer of
        each kind, as a split step calls them: the routed experts with and without padding rows among the gathered
        ones. They hold no collective (the exchange runs between them), so each rank warms its own up alone."""
        model, stages = self.model, self.overlap
        main = model.main_layers
        for i in model.one_layer_per_kind():
            layer = main[i]
            if not isinstance(layer.mlp, MoE):  # (under DP attention every MoE layer exchanges rows)
                continue
            for lens, ctx in shapes:
                batch = self._scratch_extend_batch(lens, ctx)
                n = batch.num_tokens
                h, pending = self.idle_hidden(n), self.idle_hidden(n)
                # after the first layer a micro-batch carries the previous layer's top-k, as the served ones do
                topk = None if i == 0 else torch.zeros(n, self.model_config.index_topk, dtype=torch.int32,
                                                       device=self.device)
                with layer_tracing():
                    _, x, _, _ = stages.attend(layer, h, pending, model.layer_context(batch, self.attn), topk,
                                               self.attn.layer_caches[i])
                    gathered = torch.cat([x, x])  # two ranks' rows, one of them padding in the second call
                    for real in (None, torch.arange(n, device=self.device)):
                        stages.routed(layer.mlp, gathered, real)

    def idle_batch(self, kind: StepKind, in_graph: bool = False) -> ForwardBatch:
        """What a DP-attention rank with nothing to run in one of a step's forwards runs, so that its MoE layers still
        join the other ranks': a one-token batch that touches no request's cache (the dummy slot 0), EXTEND for the
        main model, DRAFT_EXTEND for the MTP layer; `in_graph`: an empty batch of `kind` (the graph it replays then
        runs padding rows only, at the dummy slot)."""
        if in_graph:
            if kind not in self._idle_batches:  # made once: its tensors are only read (copied into graph inputs)
                nothing = torch.zeros(0, dtype=torch.int64, device=self.device)
                self._idle_batches[kind] = ForwardBatch.build(kind, nothing, [], [], [], nothing, self.device,
                                                              max_kv_len=1)
            return self._idle_batches[kind]
        batch = self._scratch_extend_batch([1], 1)
        return dataclasses.replace(batch, kind=StepKind.DRAFT_EXTEND) if kind.runs_mtp else batch

    def idle_hidden(self, tokens: int) -> torch.Tensor:
        return torch.zeros(tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)

    def _scratch_extend_batch(self, lens: list[int], context: int) -> ForwardBatch:
        """An EXTEND batch of len(lens) requests and `context` key positions that touches no request's cache:
        every token writes the reserved dummy slot 0 and sees only row position 0 of req_to_token row 0 (a read,
        as CUDA-graph padding rows do)."""
        num_tokens = sum(lens)
        dev = self.device
        ids = torch.arange(num_tokens, device=dev) % self.model_config.vocab_size
        return ForwardBatch.build(StepKind.EXTEND, ids, [0] * len(lens), [0] * len(lens), lens,
                                  torch.zeros(num_tokens, dtype=torch.int64, device=dev), dev,
                                  kv_lens=torch.ones(num_tokens, dtype=torch.int64, device=dev),
                                  max_kv_len=min(context, self.table_width))

    @property
    def has_draft_extend_graph(self) -> bool:
        """Draft extends replay a captured graph, which takes every request padded to num_draft_tokens tokens."""
        return self.graphs is not None and StepKind.DRAFT_EXTEND in self.graphs.shapes

    def has_graph(self, batch: ForwardBatch) -> bool:
        """A captured graph of the batch's kind takes it (else it runs uncaptured)."""
        return self.graphs is not None and self.graphs.key_for(batch) is not None

    # -- execution --------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Run the main model on a batch (EXTEND, DECODE, VERIFY): a captured graph when one fits, else uncaptured."""
        assert not batch.kind.runs_mtp, f"a {batch.kind.name} batch runs the MTP layer (forward_mtp)"
        if batch.dp_tokens is not None:  # DP attention: rank 0 chose for every rank (the MoE exchanges must match)
            if batch.dp_graph is not None:
                return self.graphs.replay(batch, key=(batch.kind, *batch.dp_graph))
            return self._run_uncaptured(batch)
        if self.has_graph(batch):
            return self.graphs.replay(batch)
        return self._run_uncaptured(batch)

    @torch.no_grad()
    def forward_eager(self, batch: ForwardBatch) -> ModelOutput:
        return self.model(batch, self.attn)

    @torch.no_grad()
    def token_logprobs(self, hidden: torch.Tensor, rows: list[int], targets: list[int], k: int,
                       chunk: int = 256) -> tuple[list[float], list[dict[int, float]]]:
        """Log-probability of targets[i] after the token at hidden[rows[i]] (a last-layer state before the final
        norm), and the k likeliest tokens there. Chunked: [chunk, vocab] fp32 at a time, whatever the prompt."""
        idx = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device).unsqueeze(1)
        values: list[float] = []
        tops: list[dict[int, float]] = []
        for s in range(0, len(rows), chunk):
            logp = torch.log_softmax(self.model.logits(self.model.model.norm(hidden[idx[s:s + chunk]])), dim=-1)
            values += logp.gather(1, tgt[s:s + chunk]).squeeze(1).tolist()
            if k:
                top = logp.topk(k, dim=-1)
                tops += [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
            else:
                tops += [{} for _ in range(logp.shape[0])]
        return values, tops

    def forward_mtp(self, batch: ForwardBatch, hidden_prev: torch.Tensor,
                    prev_topk: torch.Tensor | None = None) -> ModelOutput:
        """Run the MTP layer on a DRAFT or DRAFT_EXTEND batch. Graph-captured draft steps take no handed top-k: the
        layer computes its own (the gating rule's fallback), which is exact, only not shared."""
        assert batch.kind.runs_mtp, f"a {batch.kind.name} batch runs the main model (forward)"
        if batch.dp_tokens is not None:  # DP attention: rank 0 chose for every rank (the MoE exchanges must match)
            if batch.dp_graph is not None:
                return self.graphs.replay(batch, hidden_prev, key=(batch.kind, *batch.dp_graph))
            return self._run_mtp_uncaptured(batch, hidden_prev, prev_topk)
        if self.has_graph(batch):
            return self.graphs.replay(batch, hidden_prev)
        return self._run_mtp_uncaptured(batch, hidden_prev, prev_topk)

    @torch.no_grad()
    def forward_mtp_eager(self, batch: ForwardBatch, hidden_prev: torch.Tensor,
                          prev_topk: torch.Tensor | None = None) -> ModelOutput:
        return self.model.forward_mtp(batch, self.attn, hidden_prev, prev_topk)
