"""FP8 block-scaled formats (DeepSeek's recipe) and their pure-torch reference math.

Weights: e4m3 `[N, K]` with one fp32 `weight_scale_inv` per 128x128 block, shape
`[ceil(N/128), ceil(K/128)]`; the real value is `weight * scale` (the checkpoints'
name says "inv": it is what the stored weight is multiplied by).

Activations (w8a8): quantised at run time per token per 128-channel group: e4m3
`[T, K]` plus fp32 scales `[T, ceil(K/128)]`. A GEMM accumulates in fp32:
`acc += dot(a_blk, w_blk) * a_scale[t, kb] * w_scale[nb, kb]`.

These functions are the oracle of the fast kernels and the CPU path.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def block_scale_shape(rows: int, cols: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return -(-rows // block), -(-cols // block)


def dequant_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight [..., R, C] with scales [..., ceil(R/b), ceil(C/b)] -> `dtype` (leading dims broadcast)."""
    rows, cols = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]
    return (weight.float() * s).to(dtype)


def quant_block(weight: torch.Tensor, block: int = FP8_BLOCK, pow2_scale: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A high-precision weight [..., R, C] -> (e4m3 weight, fp32 scale_inv [..., ceil(R/b), ceil(C/b)]).

    One scale per block = amax / 448 (rounded up to a power of two with `pow2_scale`, the "ue8m0" format);
    an all-zero block gets scale 1.
    """
    rows, cols = weight.shape[-2:]
    rb, cb = block_scale_shape(rows, cols, block)
    lead = weight.shape[:-2]
    padded = weight.new_zeros(*lead, rb * block, cb * block, dtype=torch.float32)
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.view(*lead, rb, block, cb, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rb, cb]
    scale = _scale_from_amax(amax, pow2_scale)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, rb * block, cb * block)[..., :rows, :cols].contiguous(), scale


def quant_act_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK, pow2_scale: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (e4m3 [T, K], fp32 scales [T, ceil(K/group)]), one scale per token per group."""
    tokens, k = x.shape
    groups = -(-k // group)
    padded = x.new_zeros(tokens, groups * group, dtype=torch.float32)
    padded[:, :k] = x.float()
    g = padded.view(tokens, groups, group)
    scale = _scale_from_amax(g.abs().amax(-1), pow2_scale)
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(tokens, groups * group)[:, :k].contiguous(), scale


def w8a8_block_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T for an e4m3 block-scaled W [N, K]: x quantised per token per 128 channels, fp32 accumulate."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k = x2.shape[1]
    xq, xs = quant_act_per_token_group(x2)
    a = xq.float() * xs.repeat_interleave(FP8_BLOCK, 1)[:, :k]
    y = a @ dequant_block(weight, scale_inv).t()
    return y.to(out_dtype or x.dtype).view(*lead, weight.shape[0])


def _scale_from_amax(amax: torch.Tensor, pow2_scale: bool) -> torch.Tensor:
    scale = amax.float() / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale
