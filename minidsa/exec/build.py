"""The one start-up recipe every rank runs: from a `ResolvedConfig` and the kernel choice made for it
(`choose_kernels`, once, on the engine's process), the runner (model, caches), the sampler, the speculator and the
worker that owns them. One process calls `start_local_worker`; tensor-parallel ranks build their runner
(`parallel.ranks.RankModelRunner`) and hand it to `build_worker`, the same way on every rank."""

from __future__ import annotations

import logging

from minidsa.attention import select
from minidsa.common.sampling import Sampler, race_for, token_mask_for
from minidsa.config import ConfigError, ResolvedConfig
from minidsa.exec.compile_cache import CompileCache
from minidsa.exec.runner import ModelRunner
from minidsa.exec.worker import Worker
from minidsa.speculative.mtp import MTPSpeculator

logger = logging.getLogger(__name__)


def choose_kernels(resolved: ResolvedConfig) -> select.KernelChoice:
    """Which implementation serves each kernel (attention/select.py), decided once per engine before any weight or
    rank exists; ConfigError when an override in the environment names what this machine cannot run."""
    args, model = resolved.args, resolved.model
    if resolved.compile_cache_dir is not None:  # the library probes below may compile: into the persistent cache
        CompileCache.activate_dirs(resolved.compile_cache_dir)
    # attention heads on each rank: split by TP, all of them under DP attention
    heads_per_rank = model.num_attention_heads // (1 if args.enable_dp_attention else args.tensor_parallel_size)
    try:
        return select.select_kernels(args.device, args.kernel_backend, args.use_deep_gemm, args.use_flash_mla,
                                     select.IndexerShape(model.index_n_heads, model.index_head_dim, args.page_size,
                                                         args.indexer_cache_dtype == "fp8"),
                                     select.RouterShape(model.n_routed_experts, model.n_group),
                                     heads_per_rank)
    except ValueError as e:
        raise ConfigError("kernel_backend", str(e)) from e


def build_worker(runner: ModelRunner, resolved: ResolvedConfig, worker_cls: type[Worker] = Worker) -> Worker:
    """A worker around a built runner: its sampler (host RNG seeded by the engine seed, so every tensor-parallel
    rank draws the same keys) and, when speculation is on, its speculator."""
    sampler = Sampler(resolved.model.vocab_size, runner.device, resolved.args.seed, race_for(runner.kernels.sample),
                      token_mask_for(runner.kernels.sample))
    speculator = None
    if resolved.spec is not None:
        speculator = MTPSpeculator(runner, resolved.spec, sampler, seed=resolved.args.seed)
        if resolved.spec.simulate_accept_len:
            logger.warning("speculative decoding SIMULATES an acceptance length of %.2f tokens per round "
                           "(--speculative-simulate-accept-len, benchmarks only): outputs are not the model's",
                           resolved.spec.simulate_accept_len)
    return worker_cls(runner, sampler, speculator)


def start_local_worker(resolved: ResolvedConfig, kernels: select.KernelChoice, progress: bool = True) -> Worker:
    """The worker of an engine in one process (no process group)."""
    return build_worker(ModelRunner(resolved, kernels, progress), resolved)
