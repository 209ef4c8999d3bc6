"""DeepGEMM's per-step inputs in one launch (kernels/deepgemm_step.py) against `step_inputs_reference` (the torch
functions a step ran before), on CPU through Triton's interpreter; the custom op; the sm_90 compile.

Same set-up as tests/test_kernels.py: kernels imported interpreted (or the file re-runs itself in a child process),
new torch.empty outputs poisoned. Integer outputs: compared exactly.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import (SPILL_CHECK, compile_for_h100, import_kernels_interpreted,  # noqa: E402
                           poison_new_tensors, run_file_interpreted)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import deepgemm, deepgemm_step  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_deepgemm_step_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_new_tensors(monkeypatch)


def _step(seed: int, tokens: int, requests: int, width: int, max_kv_len: int):
    """A req_to_token table of random slots, `tokens` query tokens of `requests` of its rows (in order, as a batch
    holds them), each seeing up to past max_kv_len (the clamp)."""
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 1 << 20, (12, width), generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(12, generator=g)[:requests]
    token_req = torch.randint(0, requests, (tokens,), generator=g).sort().values
    kv_lens = torch.randint(1, max_kv_len + 9, (tokens,), generator=g)
    return req_to_token, req_pool_indices, token_req, kv_lens


@in_this_process
@pytest.mark.parametrize("tokens,requests,width,max_kv_len,tree_width,page_size,num_sms", [
    (1, 1, 256, 256, 0, 64, 132),      # decode at batch 1
    (5, 5, 1024, 1000, 0, 64, 132),    # decode, contexts past the clamp
    (70, 9, 2048, 2048, 4, 64, 132),   # verify with a tree: more segments than SMs, more tokens than a block
    (40, 4, 4096, 4000, 0, 32, 7),     # SM100's page size, few SMs: SMs share rows
    (3, 3, 96, 90, 2, 1, 16),          # one-slot pages, fewer segments than SMs
    (0, 1, 256, 256, 0, 64, 132),      # no tokens: an all-zero schedule
])
def test_step_inputs_match_reference(tokens, requests, width, max_kv_len, tree_width, page_size, num_sms):
    args = (*_step(tokens * width + page_size, tokens, requests, width, max_kv_len), tree_width, max_kv_len,
            page_size, num_sms)
    want = deepgemm_step.step_inputs_reference(*args)
    for got in (deepgemm_step.step_inputs(*args), torch.ops.minidsa.deepgemm_step_inputs(*args)):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    # The reference is the functions a step ran before: DeepGEMM's (N, 1) lengths and paged_schedule.
    ctx = want[1]
    assert torch.equal(ctx, deepgemm.context_lens_2d((args[3] + tree_width).clamp(max=max_kv_len)))
    assert torch.equal(want[3], deepgemm.paged_schedule(ctx, num_sms))


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import deepgemm_step
sig = {"r2t_ptr": "*i32", "req_idx_ptr": "*i64", "token_req_ptr": "*i64", "kv_lens_ptr": "*i64", "rows_ptr": "*i64",
       "ctx_ptr": "*i32", "table_ptr": "*i32", "sched_ptr": "*i32", "num_tokens": "i32", "num_blocks": "i32",
       "stride_r2t": "i32", "stride_table": "i32", "tree_width": "i32", "max_kv_len": "i32", "page_size": "i32",
       "num_sms": "i32", "SPLIT": "constexpr", "BLOCK_PAGES": "constexpr", "BLOCK_TOKENS": "constexpr",
       "BLOCK_SMS": "constexpr", "PDL": "constexpr"}
compile_without_spills(ASTSource(deepgemm_step._step_inputs_kernel, sig, constexprs={
    "SPLIT": 256, "BLOCK_PAGES": deepgemm_step.BLOCK_PAGES, "BLOCK_TOKENS": deepgemm_step.BLOCK_TOKENS,
    "BLOCK_SMS": 256, "PDL": True}), 4)
print("compiled")
"""


def test_step_inputs_kernel_compiles_for_h100_without_spills():
    """Compiled for sm_90 (an H100's 132 SMs: 256 schedule lanes), 0 spill bytes by ptxas's count."""
    compile_for_h100(_COMPILE_FOR_H100, "_step_inputs_kernel")
