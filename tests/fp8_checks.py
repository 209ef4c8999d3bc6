"""Kernels that quantise to e4m3 against their torch references: shared by the CPU (interpreted) and GPU tests."""

from __future__ import annotations

import torch

from minidsa.kernels import reference as ref


def _signed_code(x8: torch.Tensor) -> torch.Tensor:
    """e4m3 values as integers in value order (+0 and -0 alike): adjacent values differ by one."""
    b = x8.view(torch.uint8).int()
    return torch.where(b >= 0x80, -(b - 0x80), b)


def assert_quant_index_q_matches(q: torch.Tensor, weights: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor],
                                 hadamard: torch.Tensor | None = None,
                                 rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> None:
    """`got` is a kernel's (e4m3 q, scaled weights) for `reference.quant_index_q(q, weights, hadamard, *rope)`.

    - The rope (cos, sin, interleave) is the reference's bit for bit (the same fp32 operations, then q's dtype):
      what follows holds for the rotated q.

    - The power-of-two scales are the reference's exactly: weights * scale equal (weights must be non-zero).
    - Each e4m3 value rounds the exact rotation (x @ H in float64) give or take the fp32 rotation's error,
      whatever its summation order (at most D * 2^-24 * sum_i |x_i H_ij|, doubled here): where that interval
      holds an e4m3 rounding boundary either neighbour is right, everywhere else only the one value.
    - So a kernel and torch differ only there: by one e4m3 step, in at most 1 value in 10^4 (and 1).
    """
    num_tokens, num_heads, d = q.shape
    assert (weights != 0).all(), "a zero weight hides its scale"
    want_q8, want_w = ref.quant_index_q(q, weights, hadamard, *(rope or ()))
    if rope is not None:
        cos, sin, interleave = rope
        q = ref.rope_leading(q, cos.unsqueeze(1), sin.unsqueeze(1), interleave)
    got_q8, got_w = got
    assert got_q8.dtype == torch.float8_e4m3fn and got_q8.shape == q.shape
    assert got_w.dtype == torch.float32 and got_w.shape == (num_tokens, num_heads)
    assert torch.equal(got_w, want_w)

    had = (hadamard if hadamard is not None else ref.hadamard_matrix(d, str(q.device))).double()
    _, scale = ref.quant_fp8_ue8m0(ref.hadamard_rotate(q, hadamard))
    exact = q.double() @ had
    err = 2 * d * 2.0**-24 * (q.double().abs() @ had.abs())
    scale = scale.double().unsqueeze(-1)

    def e4m3(v: torch.Tensor) -> torch.Tensor:  # monotone: a value between two inputs rounds between their codes
        return (v / scale).float().clamp(-ref.FP8_MAX, ref.FP8_MAX).to(torch.float8_e4m3fn)

    lo, hi, code = _signed_code(e4m3(exact - err)), _signed_code(e4m3(exact + err)), _signed_code(got_q8)
    outside = (code < lo) | (code > hi)
    assert not outside.any(), f"{int(outside.sum())} values off their exact rounding, first at {outside.nonzero()[0]}"
    step = (code - _signed_code(want_q8)).abs()
    assert step.max() <= 1 and int((step > 0).sum()) <= q.numel() // 10_000 + 1, int((step > 0).sum())
