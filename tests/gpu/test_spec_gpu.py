"""GPU: speculative decoding at the real shapes with every kernel library: it starts (captures every step kind), the
steady chain round reads the device from the host exactly once (trees build their tree on the host), the KV cache is sized with room for every step kind, and
nothing leaks.

Skipped without CUDA; run by `scripts/gpu_check.sh spec`. A covering set of (DeepGEMM, FlashMLA, MLA cache dtype,
chain / tree) combinations, each value at least once, plus the deployment guides' combination (MTP 3/1/4, DeepGEMM,
FlashMLA, FP8 cache). MINIDSA_SPEC_GPU_MODEL picks the preset (default bench-dsv32).
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = os.environ.get("MINIDSA_SPEC_GPU_MODEL", "bench-dsv32")
CHAIN_314 = dict(speculative_num_steps=3)
CHAIN_112 = dict(speculative_num_steps=1)
TREE = dict(speculative_num_steps=3, speculative_topk=2, speculative_num_draft_tokens=6, page_size=1)
COMBOS = {  # MINIDSA_SPEC_GPU_COMBOS (comma-separated names) runs a subset
    "guide_dg_fmla_fp8": dict(**CHAIN_314, kv_cache_dtype="fp8"),
    "chain112_nodg_fmla_bf16": dict(**CHAIN_112, use_deep_gemm=False),
    "tree_dg_nofmla_bf16": dict(**TREE, use_flash_mla=False),
    "tree_nodg_fmla_fp8": dict(**TREE, use_deep_gemm=False, kv_cache_dtype="fp8"),
}


def _syncs(fn) -> int:
    """How many synchronising CUDA calls `fn` makes (torch's sync debug mode, as warnings); prints where."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    for w in syncs:
        print(f"  sync at {w.filename}:{w.lineno}: {str(w.message)[:120]}")
    return len(syncs)


@pytest.mark.parametrize("combo", [c for c in COMBOS if c in os.environ.get("MINIDSA_SPEC_GPU_COMBOS", ",".join(COMBOS))])
def test_speculation_starts_and_syncs_once_per_round_at_real_shapes(combo):
    from minidsa import LLM, SamplingParams
    from minidsa.common.plan import StepKind

    # Automatic KV sizing (the activation reserve covers every step kind); compiled layers, graphs.
    llm = LLM(model=MODEL, progress=False, max_running_requests=16, cuda_graph_max_bs=16, max_model_len=8192,
              max_prefill_tokens=2048, **COMBOS[combo])
    eng = llm.engine
    graphs = eng.runner.graphs
    assert graphs is not None and {StepKind.VERIFY, StepKind.DRAFT_EXTEND} <= set(graphs.shapes)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=48, ignore_eos=True, detokenize=False)
    for n in (700, 1500, 2300):
        eng.add_request(torch.randint(2, 120000, (n,), generator=g).tolist(), params)
    while eng.num_waiting() or any(r.seq_len < r.prefill_len for r in eng.requests.values()):
        eng.step()  # admissions and prefills (their MTP catch-up reads the chunk's ids on the host: not a round)
    rounds = [_syncs(eng.step) for _ in range(5)]
    print(f"{combo}: host syncs per speculative round {rounds}")
    if eng.speculator.opts.topk == 1:  # a chain's round reads the device once: its tokens
        assert rounds == [1] * 5, f"{combo}: host syncs per speculative round {rounds} (want exactly 1)"
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True, detokenize=False)
    outs = llm.generate([torch.randint(2, 120000, (900,), generator=g).tolist()] * 2, sampled)
    assert all(len(o.token_ids) == 24 for o in outs)
    while eng.has_unfinished():
        eng.step()
    eng.check_no_leaks()
    assert eng.metrics().spec_verify_steps_total > 0
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
