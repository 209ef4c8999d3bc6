"""Checkpoint loading: safetensors shards -> DeepseekV32ForCausalLM.

Handles per-expert tensor names (stacked into `experts.gate_up_proj` /
`experts.down_proj`), the MTP layer at `model.layers.{num_hidden_layers}`,
fp8 block-scaled weights (`weight` e4m3 + `weight_scale_inv` per 128x128
block, dequantised on load), and bf16 / fp32 checkpoints. Missing or
unexpected tensors raise `CheckpointError` listing them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from minidsa.config import ModelConfig
from minidsa.kernels.fp8 import dequant_block as dequant_fp8_block
from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM, Rotary

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the model its config describes, or a shard that cannot be read."""


@contextlib.contextmanager
def _open_shard(file: str) -> Iterator[Any]:
    """safe_open, with unreadable / truncated / corrupt shards reported as CheckpointError naming the file."""
    try:
        handle = safe_open(file, "pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint shard {file}: {e}") from e
    with handle as f:
        yield f


def _read_tensor(f: Any, file: str, name: str) -> torch.Tensor:
    """f.get_tensor(name), with a tensor missing from its shard or a truncated shard reported as CheckpointError."""
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot read tensor {name} from checkpoint shard {file}: {e}") from e


def checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> shard file, from the index file if present, else every *.safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {index}: {type(e).__name__}: {e}") from e
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not os.path.exists(shard):
                raise CheckpointError(f"shard {os.path.basename(shard)} named in {index} is missing")
        return files
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    files = {}
    for shard in shards:
        full = os.path.join(path, shard)
        with _open_shard(full) as f:
            for name in f.keys():
                files[name] = full
    return files


class _Plan:
    """Where each checkpoint tensor goes in the model, and what is expected/ignored."""

    def __init__(self, model: DeepseekV32ForCausalLM, config: ModelConfig):
        self.config = config
        self.params = dict(model.named_parameters())
        self.params.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
        self.n_layers = config.num_hidden_layers
        self.mtp_index = config.num_hidden_layers  # nextn layer position in the checkpoint

    def ignore_reason(self, name: str) -> str | None:
        m = _LAYER_RE.match(name)
        if name.endswith("rotary_emb.inv_freq"):
            return "rotary tables are recomputed"
        if not m:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        if layer < self.n_layers and not self.config.indexer_full[layer] and rest.startswith("self_attn.indexer."):
            return "indexer tensors on a shared top-k layer"
        if layer == self.mtp_index:
            if self.config.num_nextn_predict_layers == 0:
                return "MTP (nextn) layer weights, but config has num_nextn_predict_layers = 0"
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                return "the MTP layer shares embed_tokens and lm_head with the main model"
        return None


def load_checkpoint(model: DeepseekV32ForCausalLM, path: str, dtype: torch.dtype, device: torch.device,
                    progress: bool = True) -> None:
    """Fill `model` (possibly on the meta device) from the checkpoint at `path`."""
    config = model.config
    files = checkpoint_files(path)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.rotary = Rotary(config).to(device)
    plan = _Plan(model, config)
    loaded: set[str] = set()
    expert_slices: dict[str, set] = defaultdict(set)
    ignored: dict[str, list[str]] = defaultdict(list)
    unexpected: list[str] = []
    inter = config.moe_intermediate_size

    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in files.items():
        if name.endswith(".weight_scale_inv"):
            continue
        by_file[file].append(name)

    bar = tqdm(total=sum(len(v) for v in by_file.values()), desc="Loading weights", unit="tensor",
               disable=not progress)
    try:
        _load_shards(by_file, files, plan, loaded, expert_slices, ignored, unexpected, inter, bar)
    except BaseException:
        bar.leave = False  # an error: erase the half-drawn bar, so the error message stands alone
        raise
    finally:
        bar.close()
    _check_complete(path, plan, loaded, expert_slices, ignored, unexpected)
    _finish(model, dtype)


def _load_shards(by_file: dict[str, list[str]], files: dict[str, str], plan: "_Plan", loaded: set[str],
                 expert_slices: dict[str, set], ignored: dict[str, list[str]], unexpected: list[str], inter: int,
                 bar: Any) -> None:
    for file, names in sorted(by_file.items()):
        with _open_shard(file) as f:
            keys = set(f.keys())
            for name in sorted(names):
                bar.update(1)
                reason = plan.ignore_reason(name)
                if reason is not None:
                    ignored[reason].append(name)
                    continue
                tensor = _read_tensor(f, file, name)
                if tensor.dtype == torch.float8_e4m3fn:
                    scale_name = name[: -len("weight")] + "weight_scale_inv"
                    if scale_name not in files:
                        raise CheckpointError(f"fp8 tensor {name} has no {scale_name}")
                    scale_file = files[scale_name]
                    if scale_file == file and scale_name in keys:
                        scale = _read_tensor(f, file, scale_name)
                    else:
                        with _open_shard(scale_file) as g:
                            scale = _read_tensor(g, scale_file, scale_name)
                    tensor = dequant_fp8_block(tensor, scale)
                m = _EXPERT_RE.match(name)
                if m:
                    target = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"
                    if target not in plan.params:
                        unexpected.append(name)
                        continue
                    e = int(m.group(2))
                    param = plan.params[target]
                    if e >= param.shape[0]:
                        unexpected.append(name)
                        continue
                    dst = {"gate_proj": param.data[e, :inter], "up_proj": param.data[e, inter:],
                           "down_proj": param.data[e]}[m.group(3)]
                    _copy(dst, tensor, name)
                    expert_slices[target].add((e, m.group(3)))
                    continue
                if name not in plan.params:
                    unexpected.append(name)
                    continue
                param = plan.params[name]
                _copy(param.data, tensor, name)
                loaded.add(name)


def _check_complete(path: str, plan: "_Plan", loaded: set[str], expert_slices: dict[str, set],
                    ignored: dict[str, list[str]], unexpected: list[str]) -> None:
    for reason, names in ignored.items():
        logger.info("ignored %d checkpoint tensors (%s), e.g. %s", len(names), reason, names[0])
    missing = []
    for name, param in plan.params.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            kinds = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            want = {(e, k) for e in range(param.shape[0]) for k in kinds}
            have = expert_slices.get(name, set())
            if name in loaded:
                continue
            for e, k in sorted(want - have):
                missing.append(f"{name.rsplit('.', 1)[0]}.{e}.{k}.weight")
        elif name not in loaded:
            missing.append(name)
    if missing or unexpected:
        missing = _summarise_missing_layers(missing, plan)
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors: {', '.join(missing[:30])}" + (" ..." if len(missing) > 30 else ""))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors: {', '.join(unexpected[:30])}"
                         + (" ..." if len(unexpected) > 30 else ""))
        raise CheckpointError(f"checkpoint {path} does not match its config: " + "; ".join(parts))


def _summarise_missing_layers(missing: list[str], plan: _Plan) -> list[str]:
    """Collapse a layer that is absent as a whole into one entry (clearer than 40 names)."""
    per_layer: dict[int, list[str]] = defaultdict(list)
    for name in missing:
        m = _LAYER_RE.match(name)
        if m:
            per_layer[int(m.group(1))].append(name)
    out = [n for n in missing if not _LAYER_RE.match(n)]
    for layer, names in sorted(per_layer.items()):
        total = sum(1 for n in plan.params if n.startswith(f"model.layers.{layer}."))
        if len(names) >= total:
            what = " (the MTP / nextn layer)" if layer == plan.mtp_index else ""
            out.append(f"model.layers.{layer}.* (the whole layer{what})")
        else:
            out.extend(names)
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _finish(model: DeepseekV32ForCausalLM, dtype: torch.dtype) -> None:
    """Cast to the serving dtype, keeping the router's correction bias in fp32; fuse shared-input projections."""
    for name, p in model.named_parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    model.fuse_projections()


def build_model(config: ModelConfig, path: str | None, dtype: torch.dtype, device: torch.device,
                seed: int = 0, init_std: float = 0.02, progress: bool = True) -> DeepseekV32ForCausalLM:
    """A model with weights from `path`, or random weights (deterministic in `seed`) when path is None."""
    if path is None:
        with torch.device(device):
            model = DeepseekV32ForCausalLM(config)
        init_random_weights(model, seed, init_std)
        _finish(model, dtype)
        return model.eval()
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    with torch.no_grad():
        load_checkpoint(model, path, dtype, device, progress=progress)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: DeepseekV32ForCausalLM, seed: int, std: float) -> None:
    """Deterministic random weights: the same seed gives the same model on the same device type."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            bias = mod.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=gen, device=device) * 0.1)
