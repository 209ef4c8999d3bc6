"""Bias-free linear layers, high precision or FP8 block-scaled (w8a8), and the fusion of same-input ones.

An FP8 `Linear` keeps `weight` e4m3 `[out, in]` and `weight_scale_inv` fp32 `[ceil(out/128), ceil(in/128)]`
(DeepSeek's checkpoint format) on every device; activations are quantised per token per 128 channels at
run time and the GEMM accumulates in fp32 (`kernels.fp8`). Which GEMM serves FP8 layers (`GEMMS`) is a
plain attribute set once when the model is built (`set_gemm`, from the engine's `KernelChoice.fp8_gemm` and
`.moe_gemm`), so compiled code sees a constant.

Each parameter carries a `weight_loader(param, tensor, scale_inv=None)` (nano-vllm style): the loader
hands it the checkpoint tensor (and the tensor's block scales when it is stored as e4m3) and the
parameter writes itself in its own format, quantising a high-precision tensor into an FP8 parameter,
dequantising an e4m3 tensor into a high-precision one, or copying. The tensor may be a lazy
`models.loader.CheckpointTensor` (read on `as_tensor`): tensor-parallel parameters (layers/parallel.py) narrow
it to their slice first, so a rank reads only its part of the checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidsa.kernels.fp8 import (FP8_BLOCK, FP8_DTYPE, block_scale_shape, dequant_block, quant_block,
                                 w8a8_block_matmul_reference)

GEMMS = ("torch", "triton", "deepgemm")  # torch = the reference (CPU, and the tests' oracle)
# An input already quantised for an FP8 GEMM: (e4m3 [M, K], fp32 scales [M, ceil(K/128)]), the values
# `fp8.quant_act_per_token_group` gives (made by the norm before the GEMM: `norm_quant.rmsnorm_quant`).
QuantizedInput = tuple[torch.Tensor, torch.Tensor]


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit the parameter it is loaded into."""


def as_tensor(loaded):
    """A checkpoint tensor as a torch tensor: lazy ones (`CheckpointTensor`, anything with `materialize`) are
    read now."""
    return loaded if loaded is None or isinstance(loaded, torch.Tensor) else loaded.materialize()


def load_block_scaled(weight: torch.Tensor, scale: torch.Tensor | None, loaded: torch.Tensor,
                      loaded_scale: torch.Tensor | None, name: str, pow2_scale: bool = False) -> None:
    """Write a checkpoint tensor (e4m3 + `loaded_scale`, or high precision) into `weight` (+ `scale` when FP8).

    `weight` / `scale` may be views into bigger parameters (one expert's rows of a stacked tensor).
    """
    if tuple(weight.shape) != tuple(loaded.shape):
        raise WeightLoadError(f"tensor {name} has shape {tuple(loaded.shape)}, the config implies {tuple(weight.shape)}")
    stored_fp8 = loaded.dtype == FP8_DTYPE
    if stored_fp8:
        if loaded_scale is None:
            raise WeightLoadError(f"tensor {name} is float8_e4m3fn but its weight_scale_inv is missing")
        want = (*loaded.shape[:-2], *block_scale_shape(*loaded.shape[-2:]))
        if tuple(loaded_scale.shape) != want:
            raise WeightLoadError(f"{name}'s weight_scale_inv has shape {tuple(loaded_scale.shape)}, "
                                  f"its {tuple(loaded.shape)} weight in 128x128 blocks needs {want}")
    loaded, loaded_scale = as_tensor(loaded), as_tensor(loaded_scale)
    if scale is None:  # a high-precision parameter
        weight.copy_(dequant_block(loaded.to(weight.device), loaded_scale.to(weight.device)) if stored_fp8 else loaded)
        return
    if stored_fp8:
        weight.copy_(loaded)
        scale.copy_(loaded_scale)
    else:  # quantise at load (quantization="fp8" over a bf16 / fp32 checkpoint)
        q, s = quant_block(loaded.to(weight.device), pow2_scale=pow2_scale)
        weight.copy_(q)
        scale.copy_(s)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, scale_inv: torch.Tensor | None = None,
                          name: str = "") -> None:
    """High-precision parameters (norms, embeddings, router): shape-checked copy, dequantising an e4m3 tensor."""
    load_block_scaled(param.data, None, loaded, scale_inv, name or "tensor")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, gemm: str,
               x_quantized: QuantizedInput | None = None) -> torch.Tensor:
    """x [..., K] @ e4m3 weight [N, K]^T, w8a8 with 128-blocks, in x's dtype, by the chosen GEMM. `x_quantized`
    (x as 2-D rows, already quantised) spares the GEMM quantising x where it would in a launch of its own."""
    if gemm == "torch":
        return w8a8_block_matmul_reference(x, weight, scale_inv, out_dtype=x.dtype)
    lead = x.shape[:-1]
    x_q, x_scale = x_quantized if x_quantized is not None else (None, None)
    y = torch.ops.minidsa.fp8_linear(x.reshape(-1, x.shape[-1]), weight, scale_inv, gemm == "deepgemm", x_q, x_scale)
    return y.view(*lead, weight.shape[0])


class Linear(nn.Module):
    """y = x W^T. High precision, or FP8 block-scaled once `make_fp8_` was called (before the weights load).

    `quantizable`: whether DeepSeek's FP8 recipe stores this projection as e4m3 (False for the ones shipped in
    high precision, and for kv_b_proj, which MLA absorption uses dequantised).
    """

    def __init__(self, in_features: int, out_features: int, quantizable: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizable = quantizable
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_weight
        self.register_parameter("weight_scale_inv", None)
        self.gemm = "torch"
        self.pow2_scale = False

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def make_fp8_(self, pow2_scale: bool = False) -> None:
        """Switch to e4m3 + block scales (empty, on the weight's device: meant for the meta device, before loading)."""
        device = self.weight.device
        self.weight.data = torch.empty(self.out_features, self.in_features, dtype=FP8_DTYPE, device=device)
        rows, cols = block_scale_shape(self.out_features, self.in_features)
        self.weight_scale_inv = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32, device=device),
                                             requires_grad=False)
        # Scales arrive with their weight (the checkpoint names them together): the weight's loader writes both.
        self.weight_scale_inv.weight_loader = None
        self.pow2_scale = pow2_scale

    def load_weight(self, param: torch.Tensor, loaded: torch.Tensor, scale_inv: torch.Tensor | None = None,
                    name: str = "") -> None:
        scale = None if self.weight_scale_inv is None else self.weight_scale_inv.data
        load_block_scaled(param.data, scale, loaded, scale_inv, name or "weight", self.pow2_scale)

    def forward(self, x: torch.Tensor, x_quantized: QuantizedInput | None = None) -> torch.Tensor:
        """`x_quantized`: x already quantised for an FP8 weight (ignored by a high-precision one)."""
        if self.weight_scale_inv is None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.gemm, x_quantized)

    def extra_repr(self) -> str:
        kind = f"fp8 e4m3 128x128 blocks, gemm={self.gemm}" if self.is_fp8 else str(self.weight.dtype)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class FusedLinear(nn.Module):
    """Several bias-free projections of one input as one GEMM (one launch; better bandwidth on small outputs).

    The weight is the members' weights stacked by rows. FP8 scales stack per 128-row block, so in FP8 every
    member but the last starts and ends on a 128-row boundary: a member of another height is padded with
    zero rows (callers order members so the odd one is last: q_a | wk | kv_a has no padding at the real
    shapes). The members' parameters are re-pointed as views into the fused tensors, so the checkpoint
    names and state_dict stay, and an in-place load into either is seen by both. Built once the weights
    are final; its tensors are non-persistent buffers.
    """

    def __init__(self, *linears: Linear):
        super().__init__()
        fp8 = {lin.is_fp8 for lin in linears}
        # A checkpoint storing some members in FP8 and others not: no fusion, the members run one by one
        # (held outside the module tree so state_dict does not list them twice).
        self._separate = tuple(linears) if len(fp8) > 1 else ()
        self.is_fp8 = linears[0].is_fp8
        self.gemm = linears[0].gemm
        if self._separate:
            self.register_buffer("weight", None, persistent=False)
            self.register_buffer("weight_scale_inv", None, persistent=False)
            self.slices = ()
            return
        starts, pieces, scale_pieces = [], [], []
        row = 0
        for i, lin in enumerate(linears):
            w = lin.weight.data
            starts.append(row)
            pad = 0
            if self.is_fp8 and i < len(linears) - 1:
                pad = -w.shape[0] % FP8_BLOCK
            pieces.append(w)
            if pad:
                pieces.append(w.new_zeros(pad, w.shape[1]))
            if self.is_fp8:
                scale_pieces.append(lin.weight_scale_inv.data)
            row += w.shape[0] + pad
        weight = torch.cat(pieces, 0)
        scale = torch.cat(scale_pieces, 0) if self.is_fp8 else None
        for lin, start in zip(linears, starts):
            rows = lin.weight.shape[0]
            lin.weight.data = weight[start:start + rows]
            if scale is not None:
                lin.weight_scale_inv.data = scale[start // FP8_BLOCK:start // FP8_BLOCK + lin.weight_scale_inv.shape[0]]
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("weight_scale_inv", scale, persistent=False)
        self.slices = tuple((start, lin.weight.shape[0]) for lin, start in zip(linears, starts))

    def forward(self, x: torch.Tensor, x_quantized: QuantizedInput | None = None) -> tuple[torch.Tensor, ...]:
        """One output per member (views into one GEMM result). `x_quantized`: as `Linear.forward`."""
        if self._separate:
            return tuple(lin(x, x_quantized) for lin in self._separate)
        if self.weight_scale_inv is None:
            y = F.linear(x, self.weight)
        else:
            y = fp8_linear(x, self.weight, self.weight_scale_inv, self.gemm, x_quantized)
        return tuple(y[..., start:start + rows] for start, rows in self.slices)


def set_gemm(model: nn.Module, gemm: str, moe_gemm: str | None = None) -> None:
    """Which GEMM serves every FP8 layer of `model` (decided once, at build time): `gemm` the linears, `moe_gemm`
    (default: `gemm`) every other module with a `gemm` attribute, i.e. the routed experts
    (`models.deepseek_v32.Experts`, whose fused MoE op takes DeepGEMM's grouped GEMMs or not)."""
    moe_gemm = gemm if moe_gemm is None else moe_gemm
    for name in (gemm, moe_gemm):
        if name not in GEMMS:
            raise ValueError(f"FP8 GEMM {name!r} is not one of {GEMMS}")
    for mod in model.modules():
        if isinstance(mod, (Linear, FusedLinear)):
            mod.gemm = gemm
        elif hasattr(mod, "gemm"):
            mod.gemm = moe_gemm


def modules_outside(model: nn.Module, skip: nn.Module | None) -> list[nn.Module]:
    """model's modules, those inside `skip` (a submodule that never runs, e.g. the MTP layer without speculation)
    left out."""
    skipped = set() if skip is None else {id(m) for m in skip.modules()}
    return [m for m in model.modules() if id(m) not in skipped]


def deepgemm_weights(model: nn.Module, skip: nn.Module | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(e4m3 weight, scales) of every FP8 projection `set_gemm` gave to DeepGEMM (fused ones as one), those inside
    `skip` left out (`modules_outside`)."""
    mods = [m for m in modules_outside(model, skip) if isinstance(m, (Linear, FusedLinear)) and m.gemm == "deepgemm"
            and m.weight is not None and getattr(m, "weight_scale_inv", None) is not None]
    # A member of a FusedLinear holds a view of the fused weight and never runs alone.
    fused = {m.weight.untyped_storage().data_ptr() for m in mods if isinstance(m, FusedLinear)}
    return [(m.weight, m.weight_scale_inv) for m in mods
            if isinstance(m, FusedLinear) or m.weight.untyped_storage().data_ptr() not in fused]
