"""The exponential race of `minidsa.common.sampling` in one pass over the logits (Triton).

`race_argmax(x, temperature, keys, greedy)` returns, per row, the argmax of
    greedy rows: x
    other rows:  x / temperature - log(E),  E = exponential_noise(key, vocab id)
the same ids as `sampling.race_argmax` (the torch reference: ~25 passes over [B, V]), from one read of the
logits: the hash, the noise and both logs are computed in registers. Each program reduces a CHUNK of one row
to its best (score, id); a torch argmax over the [B, CHUNKS] partials picks the row's winner. Ties go to the
lowest id everywhere, as torch.argmax does.

The arithmetic is the reference's, operation for operation: the logs are libdevice's correctly rounded
`log` (Triton's default `tl.log` is an approximation whose error near u = 1, where the winning noise lives,
changed the chosen id in about 1 row in 256), and the division is IEEE round-to-nearest (`div_rn`).

`apply_token_mask(logits, mask)`: a grammar's packed bitmask (`sampling.TokenMask`) applied to its rows in one
pass, in place: each program reads the mask words of BLOCK tokens of one row and writes -inf only where a token
is disallowed. The torch reference (`sampling.apply_token_mask`) unpacks the whole mask first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

from minidsa.kernels.launch import pdl_launch, wait_for_producers

CHUNK = 4096  # vocab entries per program: [32, 129280] logits -> 1024 programs
BLOCK = 1024


@triton.jit
def _log(x):
    return libdevice.log(x)


if not isinstance(_log, JITFunction):  # Triton's CPU interpreter has no libdevice; its tl.log is numpy's (precise)
    @triton.jit
    def _log(x):
        return tl.log(x)


@triton.jit
def _race_kernel(x_ptr, stride_x, temperature_ptr, keys_ptr, greedy_ptr, best_ptr, best_id_ptr, vocab,
                 num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    key = tl.load(keys_ptr + row)
    key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    temperature = tl.load(temperature_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = tl.full((BLOCK,), 2147483647, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        inb = ids < vocab
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ids, mask=inb, other=float("-inf")).to(tl.float32)
        # exponential_noise: murmur3's fmix32 of (id * golden + key_lo) ^ key_hi, unsigned (logical shifts)
        h = (ids.to(tl.uint32) * 0x9E3779B1 + key_lo) ^ key_hi
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        h = h ^ (h >> 16)
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08 + 2.9802322387695312e-08  # (h24 + 1/2) / 2^24
        noise = tl.maximum(-_log(u), 2.9802322387695312e-08)  # sampling.NOISE_FLOOR: u rounds to 1 at the top
        score = tl.where(greedy, x, tl.math.div_rn(x, temperature) - _log(noise))
        score = tl.where(inb, score, float("-inf"))
        better = score > best  # strict: the first (lowest) id of a lane keeps a tie
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, best_id, 2147483647), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_id_ptr + row * num_chunks + chunk, top_id)


def race_argmax(x: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor
                ) -> torch.Tensor:
    """Sampled ids [B] int64 (see the module docstring); x [B, V] (any float dtype, last dim contiguous),
    temperature [B] fp32, keys [B] int64, greedy [B] bool."""
    b, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty(b, num_chunks, dtype=torch.float32, device=x.device)
    best_id = torch.empty(b, num_chunks, dtype=torch.int32, device=x.device)
    _race_kernel[(b, num_chunks)](x, x.stride(0), temperature, keys, greedy, best, best_id, vocab, num_chunks,
                                  CHUNK=CHUNK, BLOCK=BLOCK, **pdl_launch(x.device))
    return best_id.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()


MASK_BLOCK = 2048


@triton.jit
def _token_mask_kernel(x_ptr, stride_x, bitmask_ptr, stride_bitmask, rows_ptr, vocab, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    i = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = ids < vocab
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_bitmask + ids // 32, mask=inb, other=-1)
    allowed = ((words >> (ids % 32)) & 1) != 0  # arithmetic shift: a negative word's bit k still lands at bit 0
    row = tl.load(rows_ptr + i)
    minus_inf = tl.full((BLOCK,), float("-inf"), x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + ids, minus_inf, mask=inb & ~allowed)


def apply_token_mask(logits: torch.Tensor, mask) -> torch.Tensor:
    """In place: logits[mask.rows[i], v] = -inf where bit v of mask.bitmask[i] is 0 (`sampling.TokenMask`).
    logits [B, V] (any float dtype, last dim contiguous); returns `logits`."""
    bitmask, rows = mask.bitmask, mask.rows
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
                         f"the logits have {vocab}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_mask writes in place: the logits' and the bitmask's last dims must be contiguous")
    n = rows.numel()
    if n:
        _token_mask_kernel[(n, triton.cdiv(vocab, MASK_BLOCK))](logits, logits.stride(0), bitmask, bitmask.stride(0),
                                                                rows, vocab, BLOCK=MASK_BLOCK,
                                                                **pdl_launch(logits.device))
    return logits
