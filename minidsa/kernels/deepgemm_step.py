"""DeepGEMM's per-step inputs in one Triton launch: the query tokens' req_to_token rows, their context lengths,
the paged kernel's block table and its SM schedule.

`step_inputs_reference` is the contract: `ForwardBatch.token_rows`, `deepgemm.step_context_lens`,
`deepgemm.block_table` and `deepgemm.paged_schedule`, as `DSABackend.index_metadata` made them once per forward.

Why: in torch they are ~30 small kernels per step (an index for the rows; clamp and cast for the lengths; arange,
multiply, gather, divide and cast for the table; and for the schedule a cumsum, a searchsorted and some fifteen
elementwise kernels). Each is 1-3 us plus a launch gap in the step's CUDA graph, on an H100 at decode batch 1 as
long as a decoder layer's attention: glue the GPU waits on. Here one launch of T + 1 programs: program t < T writes
token t's row, length and table row; program T the schedule (which needs every token's length, so one program
computes it from the lengths itself instead of waiting for the others).

The schedule program cuts each token's visible length into SCHEDULE_SPLIT_KV-key segments, sums them (`total`),
and for each SM s starts at segment s * (total // num_sms) + min(s, total % num_sms): its row is the number of
rows whose running segment count ends at or before that start (the searchsorted of `paged_schedule`), its segment
the start less the last such end. Integer arithmetic throughout: the same values as the reference, exactly.
"""

from __future__ import annotations

import torch

from minidsa.kernels import deepgemm
from minidsa.kernels.launch import pdl_launch, wait_for_producers
from minidsa.kernels.triton_compat import tl, triton

BLOCK_PAGES = 256  # block table columns per loop iteration of a token's program
BLOCK_TOKENS = 32  # tokens per loop iteration of the schedule program ([SMs, BLOCK_TOKENS] compares in registers)


def step_inputs_reference(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, token_req: torch.Tensor,
                          kv_lens: torch.Tensor, tree_width: int, max_kv_len: int, page_size: int, num_sms: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token rows [T] int64, context lengths [T, 1] int32, block table [T, ceil(max_kv_len / page_size)] int32,
    schedule [num_sms + 1, 2] int32). `tree_width`: the step's tree mask width (0: causal), which every token's
    visible end adds."""
    rows = req_pool_indices[token_req]
    ctx = deepgemm.context_lens_2d((kv_lens + tree_width).clamp(max=max_kv_len))
    return (rows, ctx, deepgemm.block_table(req_to_token, rows, max_kv_len, page_size),
            deepgemm.paged_schedule(ctx, num_sms))


@triton.jit
def _step_inputs_kernel(
    r2t_ptr, req_idx_ptr, token_req_ptr, kv_lens_ptr, rows_ptr, ctx_ptr, table_ptr, sched_ptr,
    num_tokens, num_blocks, stride_r2t, stride_table, tree_width, max_kv_len, page_size, num_sms,
    SPLIT: tl.constexpr, BLOCK_PAGES: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_SMS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        row = tl.load(req_idx_ptr + tl.load(token_req_ptr + t))
        tl.store(rows_ptr + t, row.to(tl.int64))
        vis = tl.minimum(tl.load(kv_lens_ptr + t).to(tl.int32) + tree_width, max_kv_len)
        tl.store(ctx_ptr + t, vis)
        r2t_row = r2t_ptr + row.to(tl.int64) * stride_r2t
        for start in range(0, num_blocks, BLOCK_PAGES):
            j = start + tl.arange(0, BLOCK_PAGES)
            ok = j < num_blocks
            slot = tl.load(r2t_row + j.to(tl.int64) * page_size, mask=ok, other=0)
            tl.store(table_ptr + t * stride_table + j, (slot // page_size).to(tl.int32), mask=ok)
    else:
        # Slots and lengths are non-negative: Triton's truncating division is the reference's floor division.
        # Lengths in int32 (a context fits), so every loop-carried count is int32.
        total = 0
        for start in range(0, num_tokens, BLOCK_TOKENS):
            i = start + tl.arange(0, BLOCK_TOKENS)
            vis = tl.minimum(tl.load(kv_lens_ptr + i, mask=i < num_tokens, other=0).to(tl.int32) + tree_width,
                             max_kv_len)
            total += tl.sum(tl.where(i < num_tokens, (vis + SPLIT - 1) // SPLIT, 0), axis=0)
        s = tl.arange(0, BLOCK_SMS)
        sm_start = s * (total // num_sms) + tl.minimum(s, total % num_sms)
        count = tl.zeros((BLOCK_SMS,), tl.int32)  # rows ending at or before each SM's start
        before = tl.zeros((BLOCK_SMS,), tl.int32)  # the last such end (0 if none)
        ended = 0  # segments of the rows before this block
        for start in range(0, num_tokens, BLOCK_TOKENS):
            i = start + tl.arange(0, BLOCK_TOKENS)
            vis = tl.minimum(tl.load(kv_lens_ptr + i, mask=i < num_tokens, other=0).to(tl.int32) + tree_width,
                             max_kv_len)
            segments = tl.where(i < num_tokens, (vis + SPLIT - 1) // SPLIT, 0)
            ends = ended + tl.cumsum(segments, axis=0)
            done = (ends[None, :] <= sm_start[:, None]) & (i < num_tokens)[None, :]
            count += tl.sum(done.to(tl.int32), axis=1)
            before = tl.maximum(before, tl.max(tl.where(done, ends[None, :], 0), axis=1))
            ended += tl.sum(segments, axis=0)
        segment = tl.where(count < num_tokens, sm_start - before, 0)
        ok = s <= num_sms
        tl.store(sched_ptr + 2 * s, count, mask=ok)
        tl.store(sched_ptr + 2 * s + 1, segment, mask=ok)


def step_inputs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, token_req: torch.Tensor,
                kv_lens: torch.Tensor, tree_width: int, max_kv_len: int, page_size: int, num_sms: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`step_inputs_reference` in one launch."""
    num_tokens = token_req.shape[0]
    num_blocks = -(-max_kv_len // page_size)
    dev = kv_lens.device
    rows = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    ctx = torch.empty(num_tokens, 1, dtype=torch.int32, device=dev)
    table = torch.empty(num_tokens, num_blocks, dtype=torch.int32, device=dev)
    schedule = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=dev)
    kv_lens = kv_lens if kv_lens.is_contiguous() else kv_lens.contiguous()
    _step_inputs_kernel[(num_tokens + 1,)](
        req_to_token, req_pool_indices, token_req, kv_lens, rows, ctx, table, schedule,
        num_tokens, num_blocks, req_to_token.stride(0), table.stride(0), tree_width, max_kv_len, page_size, num_sms,
        SPLIT=deepgemm.SCHEDULE_SPLIT_KV, BLOCK_PAGES=BLOCK_PAGES, BLOCK_TOKENS=BLOCK_TOKENS,
        BLOCK_SMS=triton.next_power_of_2(num_sms + 1), num_warps=4, **pdl_launch(req_to_token.device),
    )
    return rows, ctx, table, schedule
