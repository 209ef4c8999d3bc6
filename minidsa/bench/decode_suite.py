"""GPU decode performance suite: `minidsa bench-decode` (or `python -m minidsa.bench.decode_suite`).

Measures, in one run on one GPU, on a benchmark preset with random bf16 weights:
 (a) decode step latency and tokens/s at several batch sizes and contexts (CUDA graphs);
 (b) MBU: bytes a step must read (weights actually used + indexer keys of the whole
     context + the selected MLA entries) over the device-to-device copy bandwidth
     measured in the same run;
 (c) CUDA-graph replay vs eager at batch 1;
 (d) DSA vs dense attention (index_topk >= context) at 8k / 32k / 128k;
 (e) target-verify step vs decode step (MTP chain), and end-to-end tokens/s with
     speculation at the acceptance this run measured;
 (f) transformers on the same weights and GPU: decode tokens/s at batch 1 and 4.

Contexts are synthetic: KV pages are allocated and filled with random (valid fp8)
data instead of running long prefills; a decode step's cost does not depend on
what the cache holds. Writes a JSON file and a markdown report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING

import torch

from minidsa.bench.offline import git_commit
from minidsa.common.batch import ForwardBatch
from minidsa.common.kv_cache import CacheLayouts
from minidsa.common.plan import StepKind
from minidsa.common.presets import preset_config
from minidsa.common.tensor_parallel import TensorParallel, building_with
from minidsa.config import EngineConfig, ModelConfig, resolve
from minidsa.exec.build import choose_kernels
from minidsa.exec.memory import DoesNotFit, check_fit
from minidsa.sched.pages import PageAllocator, RowAllocator, pages_needed

if TYPE_CHECKING:
    from minidsa.exec.graphs import GraphShape, StepGraphs

# The CLI builds `minidsa bench-decode`'s flags from `add_args`: the model code (exec/runner.py, exec/graphs.py)
# is imported when the suite runs, not each time `minidsa` starts.

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- ceilings
def measure_ceilings(device: torch.device) -> dict[str, float]:
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    t = time_cuda(lambda: b.copy_(a), iters=20)
    copy_gbps = 2 * n / t / 1e9
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    k = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    t = time_cuda(lambda: m @ k, iters=10)
    tflops = 2 * 8192**3 / t / 1e12
    return {"copy_GBps": copy_gbps, "bf16_TFLOPs": tflops}


def time_cuda(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def capture_graph(fns: list, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """One CUDA graph calling each of fns in turn, warmed up on a side stream first (allocator pools, lazy
    inits and autotuning stay out of the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def graph_time(fns: list, replays: int | None = None, budget_s: float = 0.05) -> float:
    """Median seconds per call of fns replayed from one CUDA graph (no host launch cost, as in a captured
    step). `replays`: how many timed replays; None: as many as fit `budget_s` (5 to 100)."""
    graph = capture_graph(fns)
    graph.replay()
    torch.cuda.synchronize()
    if replays is None:
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        replays = int(max(5, min(100, budget_s / max(time.perf_counter() - t0, 1e-6))))
    per_call = time_cuda(graph.replay, iters=replays, warmup=0) / len(fns)
    del graph
    return per_call


# ----------------------------------------------------------------------------- byte model
def decode_bytes(cfg: ModelConfig, bs: int, ctx: int, dtype_bytes: int = 2, with_mtp: bool = False,
                 fp8_weights: bool | None = None) -> dict[str, float]:
    """Bytes one decode step must read: weights actually used, indexer keys, selected MLA entries.

    FP8 models (`fp8_weights`, default: the config's quantization) read 1 byte per projection weight plus one
    fp32 scale per 128x128 block; kv_b_proj and lm_head stay `dtype_bytes`; the indexer's weights_proj and the
    router's gate are stored in fp32 (`read_in_fp32`) and read as such.
    """
    fp8 = cfg.quantization == "fp8" if fp8_weights is None else fp8_weights
    wb = 1 + 4 / (128 * 128) if fp8 else dtype_bytes
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim + h * cfg.kv_cache_dim
            + heads * cfg.v_head_dim * h) * wb
    attn += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * dtype_bytes  # kv_b_proj
    indexer = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim) * wb \
        + h * cfg.index_n_heads * 4
    expert = 3 * h * cfg.moe_intermediate_size * wb
    # expected distinct experts hit by bs tokens choosing k of E uniformly
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** bs)
    layers = range(cfg.num_hidden_layers)
    weights = 0.0
    for i in layers:
        weights += attn + (indexer if cfg.indexer_full[i] else 0)
        if cfg.dense_layers[i]:
            weights += 3 * h * cfg.intermediate_size * wb
        else:
            weights += hit * expert + cfg.n_shared_experts * expert + e * h * 4
    weights += cfg.vocab_size * h * dtype_bytes  # lm_head (embedding: bs rows, negligible)
    full = sum(cfg.indexer_full)
    index_keys = full * bs * ctx * (cfg.index_head_dim + 4)
    mla = cfg.num_hidden_layers * bs * min(cfg.index_topk, ctx) * cfg.kv_cache_dim * dtype_bytes
    return {"weights": weights, "index_keys": index_keys, "mla": mla, "total": weights + index_keys + mla}


# ----------------------------------------------------------------------------- synthetic contexts
class Bench:
    def __init__(self, preset: str, max_context: int, max_batch_tokens: int, max_bs: int, index_topk: int | None = None,
                 spec_steps: int = 0, compile: bool = True, kv_cache_dtype: str = "auto",
                 distributed_executor_backend: str = "uni", use_flash_mla: bool = True,
                 rank: TensorParallel | None = None, device: str = "cuda"):
        """`rank`: build one rank's share of a tensor-parallel (or DP-attention) model of `rank.size` ranks in this
        one process, its kernels chosen for that rank's shapes; its collectives are whatever `rank` does without a
        process group (benchmarks/scripts/bench_rank_shapes.py: skipped, or stood in for by local rows)."""
        raw = preset_config(preset)
        init_std = raw.pop("initializer_range", 0.02)
        if index_topk is not None:
            raw["index_topk"] = index_topk
        self.model_config = ModelConfig.from_dict(raw)
        self.spec_nd = spec_steps + 1 if spec_steps else 0
        cfg = EngineConfig(model=None, dtype="bfloat16", device=device, page_size=64,
                           max_running_requests=max_bs, max_total_tokens=max_batch_tokens + 64 * (max_bs + 2),
                           max_model_len=max_context + 64, indexer_cache_dtype="fp8", kernel_backend="auto",
                           kv_cache_dtype=kv_cache_dtype, use_flash_mla=use_flash_mla,
                           enable_cuda_graph=False, enable_compile=False,
                           distributed_executor_backend=distributed_executor_backend)
        # "mp": tensor_parallel_size 1 through the distributed path (a process group of one, its collectives
        # inside the graphs): what it costs beside "uni"
        # Rows with room for verify batches of up to 64 tokens past each context
        resolved = dataclasses.replace(resolve(cfg, self.model_config, init_std), decode_reserve=64)
        # As the engine does: one line, not the allocator's traceback, when the KV cache asked for cannot fit.
        try:
            check_fit(resolved, CacheLayouts.for_model(self.model_config, resolved.dtype, kv_cache_dtype, True,
                                                       cfg.page_size).bytes_per_token)
        except DoesNotFit as e:
            raise DoesNotFit(f"{e} (here max_total_tokens is --kv-tokens {max_batch_tokens} plus "
                             f"{cfg.max_total_tokens - max_batch_tokens} tokens of room)") from None
        if rank is not None:  # the kernels a rank of that group would choose (e.g. FlashMLA for its heads per rank)
            resolved = dataclasses.replace(resolved, args=dataclasses.replace(
                resolved.args, tensor_parallel_size=rank.size, distributed_executor_backend="mp",
                enable_expert_parallel=rank.expert_parallel, enable_dp_attention=rank.dp_attention))
        kernels = choose_kernels(resolved)
        if rank is not None:
            from minidsa.exec.runner import ModelRunner

            with building_with(rank):
                self.runner = ModelRunner(resolved, kernels, progress=False)
        elif distributed_executor_backend == "mp":
            from minidsa.parallel.launch import single_rank_group
            from minidsa.parallel.ranks import RankModelRunner

            self.runner = RankModelRunner(single_rank_group(cfg.device), resolved, kernels, progress=False)
        else:
            from minidsa.exec.runner import ModelRunner

            self.runner = ModelRunner(resolved, kernels, progress=False)
        self.device = self.runner.device
        # The engine's host-side bookkeeping of the runner's KV memory, for the synthetic contexts.
        capacity = self.runner.kv_capacity
        self.pages = PageAllocator(capacity.num_pages, capacity.page_size)
        self.rows = RowAllocator(capacity.num_rows)
        # The engine's own step functions: the whole forward through torch.compile (one dynamic graph
        # per step kind, shared by every graph below), or plain eager modules.
        self.compile = compile
        layer = (self.runner.layer or self.runner.compile_layer("inductor")) if compile else None
        self.run_main, self.run_mtp = self.runner.step_functions(layer)
        self._fill_cache()

    def _fill_cache(self):
        kv = self.runner.kv_cache
        if kv.mla_fp8:  # e4m3 latents of N(0, 1) values (scale 1), bf16 rope
            for layer_cache in kv.mla:
                latent, scales, rope = kv.mla_layout.fp8_views(layer_cache)
                for part in latent.split(1 << 20):
                    part.copy_(torch.randn(part.shape, device=part.device, dtype=torch.bfloat16))
                scales.fill_(1.0)
                rope.normal_(0, 1)
        else:
            kv.mla_buffer.normal_(0, 1)
        ps, d = kv.page_size, kv.index_head_dim
        for layer_buf in kv.index_buffer:
            keys = layer_buf[:, : ps * d]
            keys.copy_(torch.randn(keys.shape, device=keys.device, dtype=torch.bfloat16)
                       .to(torch.float8_e4m3fn).view(torch.uint8))
            layer_buf[:, ps * d:].view(torch.float32).fill_(0.05)

    def contexts(self, bs: int, ctx: int):
        """Rows of `bs` requests holding `ctx` cached tokens each (+ room for one decode/verify step)."""
        r = self.runner
        ps = r.page_size
        rows, pages = [], []
        for _ in range(bs):
            row = self.rows.alloc()
            pg = self.pages.alloc(pages_needed(ctx + 16, ps))
            slots = torch.tensor([p * ps + o for p in pg for o in range(ps)][: ctx + 16], dtype=torch.int64)
            r.req_to_token_table.write(row, 0, slots)
            rows.append(row)
            pages.append(pg)
        return rows, pages

    def release(self, rows, pages):
        for row, pg in zip(rows, pages):
            self.pages.free(pg)
            self.rows.free(row)

    def decode_batch(self, rows, ctx) -> ForwardBatch:
        r2t = self.runner.req_to_token
        loc = r2t[torch.tensor(rows, device=self.device), ctx].long()
        ids = torch.randint(2, 1000, (len(rows),)).tolist()
        return ForwardBatch.build(StepKind.DECODE, ids, rows, [ctx] * len(rows), [1] * len(rows), loc, self.device)

    def verify_batch(self, rows, ctx, nd) -> ForwardBatch:
        r2t = self.runner.req_to_token
        bs = len(rows)
        loc = torch.cat([r2t[r, ctx:ctx + nd].long() for r in rows])
        mask = torch.tril(torch.ones(nd, nd, dtype=torch.bool)).repeat(bs, 1)
        pos = torch.tensor([ctx + j for _ in rows for j in range(nd)])
        kv = torch.full((bs * nd,), ctx)
        ids = torch.randint(2, 1000, (bs * nd,)).tolist()
        return ForwardBatch.build(StepKind.VERIFY, ids, rows, [ctx] * bs, [nd] * bs, loc, self.device,
                                  logits="all", positions=pos, kv_lens=kv, tree_mask=mask, max_kv_len=ctx + nd)

    def graphs(self, shapes: list[GraphShape], buckets: list[int], max_kv_len: int,
               compiled: bool = True) -> StepGraphs:
        from minidsa.exec.graphs import StepGraphs

        r = self.runner
        run_main, run_mtp = (self.run_main, self.run_mtp) if compiled else r.step_functions(None)
        return StepGraphs(run_main, run_mtp, shapes, buckets, max_kv_len, self.model_config.hidden_size, r.dtype,
                          r.device, capture=True)


def graph_shape(kind: StepKind, tokens_per_req: int = 1, tree_width: int = 0) -> GraphShape:
    """The shape of a captured step kind (exec/graphs.py)."""
    from minidsa.exec.graphs import GraphShape

    return GraphShape(kind, tokens_per_req, tree_width)


def _graph_decode_ms(bench: Bench, bs: int, ctx: int, iters: int) -> float:
    rows, pages = bench.contexts(bs, ctx)
    g = bench.graphs([graph_shape(StepKind.DECODE)], [bs], max_kv_len=ctx + 64)
    batch = bench.decode_batch(rows, ctx)
    ms = time_cuda(lambda: g.replay(batch), iters=iters) * 1e3
    bench.release(rows, pages)
    return ms


def profile_step(graphs: StepGraphs, batch: ForwardBatch, iters: int) -> dict:
    """Where a replayed decode step's time goes: GPU kernels (CUPTI sees inside graph replays) vs the step."""
    from torch.profiler import ProfilerActivity, profile

    step = time_cuda(lambda: graphs.replay(batch), iters=iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graphs.replay(batch)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(ev.name, [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    total_us = sum(v[1] for v in kernels.values()) / iters
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"step_us": step * 1e6, "kernel_us": total_us, "kernels_per_step": sum(v[0] for v in kernels.values()) / iters,
            "top": [{"name": n[:90], "per_step": c / iters, "us_per_step": t / iters} for n, (c, t) in top[:100]]}


def run_suite(args) -> dict:
    dev = torch.device("cuda")
    result: dict = {"device": torch.cuda.get_device_name(dev), "date": dt.date.today().isoformat(),
                    "commit": git_commit() or "unknown", "torch": torch.__version__, "preset": args.preset}
    result["ceilings"] = ceil = measure_ceilings(dev)
    logger.info("ceilings: %s", ceil)
    bench = Bench(args.preset, max_context=max(args.contexts + args.dense_contexts), max_batch_tokens=args.kv_tokens,
                  max_bs=max(args.batches + [8]), compile=not args.no_compile,
                  distributed_executor_backend=args.distributed_executor_backend)
    result["distributed_executor_backend"] = args.distributed_executor_backend
    cfg = bench.model_config
    result["kernels"] = bench.runner.kernels.describe()
    decode = graph_shape(StepKind.DECODE)

    # (a) + (b): graph decode over batch x context
    rows_a = []
    for ctx in args.contexts:
        graphs = bench.graphs([decode], sorted(set(args.batches)), max_kv_len=ctx + 64)
        for bs in args.batches:
            if bs * (ctx + 64) > args.kv_tokens:
                rows_a.append({"bs": bs, "ctx": ctx, "skipped": "KV capacity"})
                continue
            rows, pages = bench.contexts(bs, ctx)
            batch = bench.decode_batch(rows, ctx)
            t = time_cuda(lambda: graphs.replay(batch), iters=args.iters)
            by = decode_bytes(cfg, bs, ctx)
            rows_a.append({"bs": bs, "ctx": ctx, "step_ms": t * 1e3, "tok_s": bs / t,
                           "bytes_GB": by["total"] / 1e9, "MBU": by["total"] / t / 1e9 / ceil["copy_GBps"]})
            bench.release(rows, pages)
        graphs = None
        torch.cuda.empty_cache()
    result["decode"] = rows_a

    # (c) graphs vs eager, batch 1; and what torch.compile adds inside the graph
    ctx = args.contexts[0]
    rows, pages = bench.contexts(1, ctx)
    batch = bench.decode_batch(rows, ctx)
    graphs = bench.graphs([decode], [1], max_kv_len=ctx + 64)
    t_graph = time_cuda(lambda: graphs.replay(batch), iters=args.iters)
    plain = bench.graphs([decode], [1], max_kv_len=ctx + 64, compiled=False) if bench.compile else graphs
    t_plain = time_cuda(lambda: plain.replay(batch), iters=args.iters)
    t_eager = time_cuda(lambda: bench.runner.forward_eager(batch), iters=max(5, args.iters // 4))
    result["graph_vs_eager"] = {"ctx": ctx, "compiled": bench.compile, "graph_ms": t_graph * 1e3,
                                "graph_uncompiled_ms": t_plain * 1e3, "eager_ms": t_eager * 1e3,
                                "speedup": t_eager / t_graph, "compile_speedup": t_plain / t_graph}
    if args.profile:
        result["profile"] = {"compiled": profile_step(graphs, batch, args.profile)}
        if bench.compile:
            result["profile"]["uncompiled"] = profile_step(plain, batch, args.profile)
    bench.release(rows, pages)
    graphs = plain = None

    # (e) verify vs decode (chain of nd tokens per request)
    nd = args.spec_steps + 1
    rows_e = []
    for bs in (1, 8) if "verify" not in args.skip else ():
        rows, pages = bench.contexts(bs, ctx)
        graphs = bench.graphs([decode, graph_shape(StepKind.VERIFY, nd, nd)], [bs], max_kv_len=ctx + 64)
        db = bench.decode_batch(rows, ctx)  # built once: the timing is the replay, as for verify below
        t_dec = time_cuda(lambda: graphs.replay(db), iters=args.iters)
        vb = bench.verify_batch(rows, ctx, nd)
        t_ver = time_cuda(lambda: graphs.replay(vb), iters=args.iters)
        rows_e.append({"bs": bs, "ctx": ctx, "tokens_verified": nd, "decode_ms": t_dec * 1e3,
                       "verify_ms": t_ver * 1e3, "ratio": t_ver / t_dec})
        bench.release(rows, pages)
        graphs = None
    result["verify_vs_decode"] = rows_e

    # (d) DSA vs dense: the same shapes with index_topk >= context. DSA rows on this engine; dense
    # ones on an engine per context whose index_topk just covers it (every cached token selected).
    dense_rows = [(bs, ctx) for ctx in args.dense_contexts for bs in args.dense_batches
                  if bs * (ctx + 64) <= args.kv_tokens and bs <= bench.runner.config.max_running_requests
                  and "dense" not in args.skip]
    dsa_ms = {}
    for bs, ctx in dense_rows:
        dsa_ms[bs, ctx] = _graph_decode_ms(bench, bs, ctx, args.iters)
    if hasattr(bench.runner, "close"):  # a RankModelRunner: leave its process group (one per process)
        bench.runner.close()
    bench = None
    torch.cuda.empty_cache()
    rows_d = []
    for ctx in args.dense_contexts:
        batches = [bs for bs, c in dense_rows if c == ctx]
        if not batches:
            continue
        dense = Bench(args.preset, max_context=ctx, max_batch_tokens=max(batches) * (ctx + 64), max_bs=max(batches),
                      index_topk=ctx + 64, compile=not args.no_compile)
        for bs in batches:
            ms = _graph_decode_ms(dense, bs, ctx, args.iters)
            rows_d.append({"bs": bs, "ctx": ctx, "dsa_ms": dsa_ms[bs, ctx], "dense_ms": ms,
                           "dense_over_dsa": ms / dsa_ms[bs, ctx]})
        dense = None
        torch.cuda.empty_cache()
    result["dsa_vs_dense"] = rows_d

    # (e, end to end) speculative decoding through the engine, acceptance as measured
    if "spec" not in args.skip:
        result["speculative_e2e"] = _spec_e2e(args)

    # (f) transformers on the same weights
    if "hf" not in args.skip:
        result["transformers"] = _transformers(args, result)
    return result


def _spec_e2e(args) -> dict:
    from minidsa import LLM, SamplingParams

    out = {}
    prompts = [list(range(100 + i, 100 + i + 512)) for i in range(args.e2e_requests)]
    params = SamplingParams(max_tokens=args.e2e_tokens, ignore_eos=True, detokenize=False)
    for name, extra in (("plain", {}), ("mtp", {"speculative_num_steps": args.spec_steps})):
        llm = None
        try:
            llm = LLM(model=args.preset, max_running_requests=args.e2e_requests, max_total_tokens=65536,
                      max_model_len=4096, progress=False,
                      distributed_executor_backend=args.distributed_executor_backend, **extra)
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            toks = sum(len(o.token_ids) for o in outs)
            m = llm.engine.metrics()
            entry = {"tok_s": toks / elapsed, "tokens": toks, "seconds": elapsed}
            if extra:
                entry["accepted_per_verify"] = ((m.spec_accepted_tokens_total + m.spec_verify_steps_total)
                                                / max(1, m.spec_verify_steps_total))
                entry["acceptance_rate"] = m.spec_accepted_tokens_total / max(1, m.spec_draft_tokens_total)
            out[name] = entry
            out.setdefault("outputs", {})[name] = [o.token_ids for o in outs]
        except Exception as e:  # recorded, not hidden: the table says what failed
            logger.exception("speculative e2e (%s) failed", name)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        if llm is not None:
            llm.close()
        del llm
        torch.cuda.empty_cache()
    outs = out.pop("outputs", {})
    if "plain" in outs and "mtp" in outs:
        out["lossless"] = outs["plain"] == outs["mtp"]
        # bf16 + random weights: where does each prompt first differ (near-tied logits flip)?
        out["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(p, m)) if a != b), None)
                                   for p, m in zip(outs["plain"], outs["mtp"])]
    return out


def _transformers(args, result) -> dict:
    """HF transformers decode tokens/s with our weights copied in, batch 1 and 4."""
    out: dict = {}
    try:
        import transformers
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    except Exception as e:
        return {"error": f"transformers import: {e}"}
    out["version"] = transformers.__version__
    raw = preset_config(args.preset)
    if raw["architectures"][0] != "DeepseekV32ForCausalLM":
        return {"error": "transformers comparison implemented for bench-dsv32"}
    raw.pop("initializer_range", None)
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")}
    hf_cfg = DeepseekV32Config(**keep)
    from minidsa.models.loader import build_model

    ours_cfg = ModelConfig.from_dict(preset_config(args.preset))
    # HF's modules are bf16: our random weights drawn in bf16 (quantization="none"), not FP8.
    ours = build_model(ours_cfg, None, torch.bfloat16, torch.device("cuda"), seed=0, init_std=0.02, progress=False,
                       quantization="none")
    state = {k: v for k, v in ours.state_dict().items()
             if not k.startswith(f"model.layers.{ours_cfg.num_hidden_layers}.")}
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = DeepseekV32ForCausalLM(hf_cfg)
    torch.set_default_dtype(torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    del ours, state
    torch.cuda.empty_cache()
    out["unloaded"] = {"missing": list(missing)[:5], "unexpected": list(unexpected)[:5]}
    hf.eval()
    rows = []
    for ctx in args.hf_contexts:
        for bs in (1, 4):
            entry = {"bs": bs, "ctx": ctx}
            try:
                ids = torch.randint(2, 1000, (bs, ctx), device="cuda")
                with torch.no_grad():
                    def gen(n):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                        torch.cuda.synchronize()
                        return time.perf_counter() - t0
                    gen(2)
                    t1, tn = gen(1), gen(1 + args.hf_tokens)
                per_token = (tn - t1) / args.hf_tokens
                entry.update(decode_ms=per_token * 1e3, tok_s=bs / per_token)
                ours = [r for r in result.get("decode", []) if r.get("bs") == bs and r.get("ctx") == ctx]
                if ours and "tok_s" in ours[0]:
                    entry["minidsa_tok_s"] = ours[0]["tok_s"]
                    entry["minidsa_over_hf"] = ours[0]["tok_s"] / entry["tok_s"]
            except torch.cuda.OutOfMemoryError as e:
                entry["error"] = f"OOM: {str(e).splitlines()[0][:120]}"
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
            rows.append(entry)
    out["rows"] = rows
    hf = None
    torch.cuda.empty_cache()
    return out


def to_markdown(r: dict) -> str:
    c = r["ceilings"]
    lines = [f"# minidsa decode benchmarks ({r['preset']})", "",
             f"Device: {r['device']} — date {r['date']} — commit {r['commit']} — torch {r['torch']}",
             f"Kernels: {r.get('kernels', '?')}",
             f"Ceilings measured in this run: device-to-device copy {c['copy_GBps']:.0f} GB/s "
             f"(read + write), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s", "",
             "## (a, b) Decode step with CUDA graphs; MBU = bytes that must be read / time / copy bandwidth", "",
             "| batch | context | step ms | tokens/s | GB read | MBU |", "|---|---|---|---|---|---|"]
    for x in r.get("decode", []):
        if "skipped" in x:
            lines.append(f"| {x['bs']} | {x['ctx']} | skipped ({x['skipped']}) | | | |")
        else:
            lines.append(f"| {x['bs']} | {x['ctx']} | {x['step_ms']:.3f} | {x['tok_s']:.0f} | {x['bytes_GB']:.2f} "
                         f"| {x['MBU']:.1%} |")
    g = r.get("graph_vs_eager")
    if g:
        lines += ["", "## (c) CUDA graph replay vs eager, batch 1", "",
                  f"context {g['ctx']}: graph {g['graph_ms']:.3f} ms, eager {g['eager_ms']:.3f} ms — "
                  f"**{g['speedup']:.1f}x**"]
        if g.get("compiled"):
            lines += ["", f"torch.compile inside the graph: {g['graph_ms']:.3f} ms vs {g['graph_uncompiled_ms']:.3f} ms "
                      f"for a graph of the uncompiled modules — {g['compile_speedup']:.2f}x"]
    for name, pr in r.get("profile", {}).items():
        lines += ["", f"### Batch-1 decode graph profile ({name}): step {pr['step_us']:.0f} us, kernels "
                  f"{pr['kernel_us']:.0f} us, {pr['kernels_per_step']:.0f} kernels per step", "",
                  "| kernel | per step | us per step |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['per_step']:.0f} | {k['us_per_step']:.1f} |" for k in pr["top"][:25]]
    lines += ["", "## (d) DSA vs dense attention (same model, index_topk >= context)", "",
              "| batch | context | DSA ms | dense ms | dense / DSA |", "|---|---|---|---|---|"]
    for x in r.get("dsa_vs_dense", []):
        lines.append(f"| {x['bs']} | {x['ctx']} | {x['dsa_ms']:.3f} | {x['dense_ms']:.3f} | {x['dense_over_dsa']:.2f}x |")
    lines += ["", "## (e) Target verify vs decode step (MTP chain), graphs", "",
              "| batch | context | tokens verified | decode ms | verify ms | verify / decode |",
              "|---|---|---|---|---|---|"]
    for x in r.get("verify_vs_decode", []):
        lines.append(f"| {x['bs']} | {x['ctx']} | {x['tokens_verified']} | {x['decode_ms']:.3f} | "
                     f"{x['verify_ms']:.3f} | {x['ratio']:.2f} |")
    s = r.get("speculative_e2e", {})
    if s:
        lines += ["", "End to end through the engine (random weights, so the MTP draft rarely agrees):", ""]
        for k, v in s.items():
            lines.append(f"- {k}: {json.dumps(v) if not isinstance(v, dict) else ', '.join(f'{a}={_fmt(b)}' for a, b in v.items())}")
    t = r.get("transformers", {})
    lines += ["", f"## (f) transformers {t.get('version', '')} on the same weights (bf16, same GPU)", ""]
    if "error" in t:
        lines.append(f"error: {t['error']}")
    else:
        lines += ["| batch | context | HF decode ms/token | HF tokens/s | minidsa tokens/s | ratio |",
                  "|---|---|---|---|---|---|"]
        for x in t.get("rows", []):
            if "error" in x:
                lines.append(f"| {x['bs']} | {x['ctx']} | {x['error']} | | | |")
            else:
                lines.append(f"| {x['bs']} | {x['ctx']} | {x['decode_ms']:.2f} | {x['tok_s']:.1f} | "
                             f"{_fmt(x.get('minidsa_tok_s'))} | {_fmt(x.get('minidsa_over_hf'))}{'x' if 'minidsa_over_hf' in x else ''} |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="bench-dsv32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--dense-contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--dense-batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--kv-tokens", type=int, default=4_300_000, help="KV capacity for the sweep (tokens)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--e2e-requests", type=int, default=4)
    p.add_argument("--e2e-tokens", type=int, default=64)
    p.add_argument("--hf-contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--hf-tokens", type=int, default=16)
    p.add_argument("--skip", nargs="*", default=[], choices=["verify", "dense", "spec", "hf"],
                   help="leave parts out of a quick run: verify (verify vs decode step), dense (DSA vs dense "
                        "attention), spec (speculative end to end), hf (transformers)")
    p.add_argument("--no-compile", action="store_true", help="graphs of the eager modules (no torch.compile)")
    p.add_argument("--distributed-executor-backend", choices=("uni", "mp"), default="uni",
                   help="mp: the model runs through the tensor-parallel path at size 1 (a process group of one, "
                        "collectives in the graphs), to compare with uni (one plain process)")
    p.add_argument("--profile", type=int, default=0, metavar="ITERS",
                   help="profile the batch-1 decode graph over ITERS replays (kernel table in the JSON)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)


def run(args: argparse.Namespace) -> int:
    """The suite with the flags of `add_args` (`minidsa bench-decode`); prints the markdown report."""
    if not torch.cuda.is_available():
        print("the decode suite needs a CUDA GPU; nothing measured")
        return 2
    r = run_suite(args)
    md = to_markdown(r)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minidsa.bench.decode_suite", description=__doc__.splitlines()[0])
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
