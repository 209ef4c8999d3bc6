"""A minimal paged-cache driver for model-level tests (no scheduler, no sampling).

It owns the KV memory (caches, req->token table, page and row allocators) for one model and runs prefill
(optionally chunked) and greedy decode steps for several requests at once, the way the engine does.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from minidsa.attention.backend import DSABackend
from minidsa.common.batch import ForwardBatch
from minidsa.config import ModelConfig
from minidsa.common.kv_cache import IndexerLayout, KVCache, MLALayout, ReqToTokenTable, slots_of
from minidsa.sched.pages import PageAllocator, RowAllocator, pages_needed
from minidsa.common.plan import StepKind
from minidsa.attention.topk_recording import TopkRecorder
from minidsa.kernels.fp8 import quant_block
from minidsa.models.layers.linear import Linear


class PagedDriver:
    def __init__(self, model, config: ModelConfig, page_size: int = 1, num_pages: int = 0,
                 max_reqs: int = 8, max_len: int = 256, indexer_fp8: bool = False, dtype=torch.float32,
                 kv_cache_dtype: str = "auto", kernels=None):
        self.model, self.config, self.page_size = model, config, page_size
        num_pages = num_pages or (max_reqs * pages_needed(max_len, page_size) + 1)
        self.alloc = PageAllocator(num_pages, page_size)
        self.rows = RowAllocator(max_reqs)
        self.table = ReqToTokenTable(max_reqs, max_len, "cpu")
        layers = list(config.indexer_full) + [True] * config.num_nextn_predict_layers
        mla = MLALayout.for_model(config.kv_lora_rank, config.qk_rope_head_dim, dtype, kv_cache_dtype)
        index = IndexerLayout(config.index_head_dim, dtype, indexer_fp8, page_size)
        self.kv = KVCache(config.num_layers_with_mtp, num_pages, mla, index, "cpu", layers)
        self.attn = DSABackend(self.kv, self.table.req_to_token, config.index_topk, kernels)
        self.topk = TopkRecorder(self.attn)  # call self.topk.start() to record
        self.reqs: list[dict] = []
        self.last_topk: dict[int, torch.Tensor] = {}  # layer -> positions of the last step, when recording

    def add(self, tokens: list[int], reserve: int) -> int:
        row = self.rows.alloc()
        pages = self.alloc.alloc(pages_needed(len(tokens) + reserve, self.page_size))
        self.table.write(row, 0, slots_of(pages, 0, len(tokens) + reserve, self.page_size))
        self.reqs.append(dict(row=row, pages=pages, tokens=list(tokens), done=0))
        return len(self.reqs) - 1

    def _step(self, kind, ids, idx, prefix, extend, logits="last"):
        loc = torch.cat([self.table.req_to_token[self.reqs[i]["row"], p:p + n].long()
                         for i, p, n in zip(idx, prefix, extend)])
        batch = ForwardBatch.build(kind, ids, [self.reqs[i]["row"] for i in idx], prefix, extend, loc, "cpu",
                                   logits=logits)
        if self.topk.records is not None:
            self.topk.records = []
        with torch.no_grad():
            out = self.model(batch, self.attn)
        self.last_topk = dict(self.topk.records or [])
        return out, batch

    def prefill(self, idx: list[int], chunk: int = 0, logits: str = "last"):
        """Prefill the pending tokens of requests `idx` together; with `chunk`, at most that many per request per call."""
        outs = []
        while True:
            ids, prefix, extend, which = [], [], [], []
            for i in idx:
                r = self.reqs[i]
                n = len(r["tokens"]) - r["done"]
                if chunk:
                    n = min(n, chunk)
                if n > 0:
                    ids += r["tokens"][r["done"]:r["done"] + n]
                    prefix.append(r["done"])
                    extend.append(n)
                    which.append(i)
            if not which:
                return outs
            out, batch = self._step(StepKind.EXTEND, ids, which, prefix, extend, logits)
            for i, n in zip(which, extend):
                self.reqs[i]["done"] += n
            outs.append((which, out, batch, self.last_topk))

    def decode(self, idx: list[int], next_tokens: list[int]):
        for i, t in zip(idx, next_tokens):
            self.reqs[i]["tokens"].append(t)
        prefix = [self.reqs[i]["done"] for i in idx]
        out, batch = self._step(StepKind.DECODE, next_tokens, idx, prefix, [1] * len(idx))
        for i in idx:
            self.reqs[i]["done"] += 1
        return out

    def release_all(self):
        for r in self.reqs:
            self.alloc.free(r["pages"])
            self.rows.free(r["row"])
        self.reqs = []
        self.alloc.check_all_free()
        self.rows.check_all_free()


# Tokens of the compiled path's warm-up steps on CPU (Triton's interpreter): a GPU engine warms up to its step budget.
CPU_WARMUP_TOKENS = 11


def static_fast_paths(runner, spec_layout=None, compile_backend=None) -> None:
    """`ModelRunner.prepare_fast_paths` on CPU, from the runner's public pieces: batches go through the step
    graphs' static, padded buffers (run eagerly: nothing is captured without a GPU), and with the engine's
    enable_compile the step functions are compiled with `compile_backend` (e.g. "aot_eager", a recording
    backend; None: not compiled) and the uncaptured compiled path is warmed up, as on a GPU."""
    assert runner.config.enable_cuda_graph, "the engine serves without graphs"
    compiles = runner.config.enable_compile and compile_backend is not None
    run_main, run_mtp = runner.step_functions(runner.compile_layer(compile_backend) if compiles else None)
    runner.use_graphs(runner.build_graphs(spec_layout, run_main, run_mtp), warm_up_tokens=CPU_WARMUP_TOKENS)


def count_replays(graphs) -> dict[StepKind, int]:
    """Replays per step kind from now on (wraps StepGraphs.replay on this instance)."""
    counts = {kind: 0 for kind in graphs.shapes}
    replay = graphs.replay

    def counted(batch, *args, **kwargs):
        counts[batch.kind] += 1
        return replay(batch, *args, **kwargs)

    graphs.replay = counted
    return counts


def compile_without_probing(runner, monkeypatch, library) -> list[set[str]]:
    """Compile and capture `runner`'s steps on CPU (aot_eager, through the graphs' static buffers) with
    `library.probe` (an optional kernel library: kernels/deepgemm, kernels/flashmla) failing if anything calls it
    after start-up, i.e. from inside a step; returns each traced graph's op targets."""
    from torch._dynamo.backends.debugging import aot_eager

    def no_probe_after_start_up(device):
        raise AssertionError(f"{library.__name__}.probe called after start-up (inside a step)")

    monkeypatch.setattr(library, "probe", no_probe_after_start_up)
    traced: list[set[str]] = []

    def backend(gm, example_inputs):
        traced.append({str(n.target) for n in gm.graph.nodes})
        return aot_eager(gm, example_inputs)

    static_fast_paths(runner, None, backend)
    return traced


def random_fp8_linear(in_features: int, rows: int, generator: torch.Generator, gemm: str = "torch") -> Linear:
    """An FP8 Linear [rows, in_features] of random block-quantised weights (std 0.05 before quantisation), served by
    `gemm`."""
    lin = Linear(in_features, rows)
    lin.make_fp8_()
    q, s = quant_block(torch.randn(rows, in_features, generator=generator) * 0.05)
    lin.weight.data.copy_(q)
    lin.weight_scale_inv.data.copy_(s)
    lin.gemm = gemm
    return lin


async def read_sse(resp) -> list[dict | str]:
    """All SSE data payloads of an aiohttp response, parsed ('[DONE]' kept as the string)."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def experts_checkpoint(path, experts: int = 5) -> str:
    """config.json alone (resolve reads nothing else): the tiny preset with `experts` routed experts (5: two ranks
    cannot hold them whole; the 4 heads still split)."""
    from minidsa.common.presets import preset_config

    cfg = dict(preset_config("tiny"), n_routed_experts=experts, n_group=1, topk_group=1)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def pretend_gpus_and_forbid_ranks(monkeypatch, gpus: int) -> None:
    """minidsa sees `gpus` CUDA GPUs, and starting a tensor-parallel rank fails the test (bad input must be refused
    before any rank starts)."""
    from minidsa.parallel import ranks

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(ranks, "start_ranks", no_ranks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


def ranks_run(monkeypatch, tmp_path, hook: str) -> None:
    """Tensor-parallel ranks > 0 started from now on run tests/`hook` (which ends by running minidsa.parallel) instead
    of `python -m minidsa.parallel`: the rank launcher's interpreter becomes a script that execs it."""
    script = tmp_path / f"python_{hook}"
    rank_main = os.path.join(os.path.dirname(os.path.abspath(__file__)), hook)
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{rank_main}"\n')
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
