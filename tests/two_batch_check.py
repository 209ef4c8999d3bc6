"""Two-batch overlap's layer loop (`minidsa.models.two_batch.run_layers`) against the MoE layer's own exchange, in a
DP-attention group of one (gloo on CPU, NCCL on a GPU), on real routed and shared experts of the tiny preset, with a
stand-in attention stage (`OverlapCalls.attend` is injected): what is checked is the exchanges' issue / wait order,
the micro-batches' rows and the sums, not attention. On a GPU the loop can run inside a CUDA-graph capture, with the
collectives issued on NCCL's stream and waited for later."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from minidsa.common.presets import preset_config
from minidsa.common.tensor_parallel import building_with
from minidsa.config import ModelConfig
from minidsa.models.deepseek_v32 import MoE
from minidsa.models.two_batch import OverlapCalls, call_routed, run_layers


def experts_in_group(tp, layers: int, device: str) -> list[MoE]:
    """`layers` MoE layers of the tiny preset with random weights, built for DP attention over `tp`'s group."""
    raw = preset_config("tiny")
    raw.pop("initializer_range", None)
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(0)
    out = []
    with building_with(dataclasses.replace(tp, dp_attention=True)):
        for _ in range(layers):
            moe = MoE(cfg)
            for p in moe.parameters():
                if p.is_floating_point():
                    p.data.normal_(0, 0.05)
            if moe.shared_experts is not None:
                moe.shared_experts.fuse()
            out.append(moe.to(device))
    return out


def stand_in_attend(layer, h, pending, ctx, topk, caches):
    """A stage-1 stand-in: the residual add, a cheap 'attention' that mixes the rows of its own micro-batch only
    (so rows of the other micro-batch must not leak in), the shared experts; the top-k passes through, plus one."""
    h = h + pending
    x = torch.tanh(h + h.mean(0, keepdim=True))
    return h, x, layer.mlp.shared(x, None), topk + 1


def reference(moes: list[MoE], h: torch.Tensor, pending: torch.Tensor, topk: torch.Tensor, split: int):
    """The same layers as one batch per micro-batch, through the MoE layer's own exchange (`MoE._forward_dp`)."""
    outs = []
    for rows in (slice(0, split), slice(split, None)):
        hh, pp, tk = h[rows], pending[rows], topk[rows]
        for moe in moes:
            hh = hh + pp
            x = torch.tanh(hh + hh.mean(0, keepdim=True))
            pp, tk = moe(x, None, None), tk + 1
        outs.append((hh, pp, tk))
    return tuple(torch.cat(parts) for parts in zip(*outs))


def overlapped(moes: list[MoE], h: torch.Tensor, pending: torch.Tensor, topk: torch.Tensor, split: int):
    """`run_layers` over the stand-in layers, two micro-batches of `split` and the rest."""
    layers = [SimpleNamespace(exchanges_rows=True, mlp=moe) for moe in moes]
    halves = tuple(SimpleNamespace(num_tokens=n, dp_pad=None, dp_real_rows=None) for n in (split, h.shape[0] - split))
    return run_layers(layers, [None] * len(layers), halves, ["context A", "context B"], h, pending, topk, None,
                      OverlapCalls(stand_in_attend, call_routed))


def inputs(rows: int, hidden: int, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, pending = (torch.randn(rows, hidden, generator=g).to(device) for _ in range(2))
    topk = torch.randint(0, 100, (rows, 4), generator=g).to(device)
    return h, pending, topk
