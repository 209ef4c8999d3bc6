"""One Triton pass that samples a token per row: the exponential race of `minidsa.sampling` without its
[B, V] temporaries.

`sampling.sample` without top-k / top-p / min-p computes softmax(logits / T), the hashed Exp(1) noise E and
argmax(p / E) as ~25 elementwise and reduction kernels over [B, V] fp32 (at batch 32 and V 129280 about 0.3 ms
a decode step, outside the CUDA graph). Here each program reads its row's logits once and keeps the running
argmax of x / T - log E, which orders the vocabulary as p / E does (p = exp(x / T - max) / Z, and log is
increasing), with the same noise bits (`sampling.exponential_noise`). Greedy rows take the argmax of the raw
logits. Ties go to the lowest vocabulary id, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _fmix32(h):
    """murmur3's finaliser on values in [0, 2^32) held as int64 (products masked back to 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _sample_rows_kernel(logits_ptr, stride_l, temperature_ptr, keys_ptr, greedy_ptr, out_ptr, vocab,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row)
    key_lo = key & 0xFFFFFFFF
    key_hi = (key >> 32) & 0xFFFFFFFF
    greedy = tl.load(greedy_ptr + row) != 0
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        v = start + tl.arange(0, BLOCK)
        mask = v < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + v, mask=mask, other=float("-inf")).to(tl.float32)
        h = _fmix32((((v.to(tl.int64) * 0x9E3779B1) + key_lo) & 0xFFFFFFFF) ^ key_hi)
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08 + 2.9802322387695312e-08  # (0, 1): 2^-24, 2^-25
        score = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
        score = tl.where(mask, score, float("-inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0).to(tl.int64) + start
        take = m > best  # strictly: an equal score in a later block loses, as in torch.argmax
        best_id = tl.where(take, i, best_id)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_id)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor
                ) -> torch.Tensor:
    """logits [B, V] (any float dtype), temperature [B] fp32, keys [B] int64, greedy [B] bool -> ids [B] int64."""
    batch, vocab = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        _sample_rows_kernel[(batch,)](logits, logits.stride(0), temperature.float().contiguous(),
                                      keys.contiguous(), greedy.contiguous(), out, vocab, BLOCK=2048,
                                      num_warps=8)
    return out
