"""Checkpoint loading: safetensors shards -> DeepseekV32ForCausalLM.

Handles per-expert tensor names (stacked into `experts.gate_up_proj` /
`experts.down_proj`), the MTP layer at `model.layers.{num_hidden_layers}`,
fp8 block-scaled weights (`weight` e4m3 + `weight_scale_inv` per 128x128
block: kept FP8, or dequantised where the model serves a projection in high
precision), and bf16 / fp32 checkpoints (optionally quantised to FP8 at load).
Missing or unexpected tensors raise `CheckpointError` listing them. Random
weights (`init_random_weights`) are drawn directly in the serving formats.

Tensors reach their parameters' loaders as lazy `CheckpointTensor`s: a
tensor-parallel parameter narrows one to its slice and only that slice is read
from the file (safetensors `get_slice`); another rank's routed experts (expert
parallelism) are not read at all.
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

from torch import nn

from minidsa.config import QUANTIZATIONS, ConfigError, ModelConfig
from minidsa.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, block_scale_shape, quant_block
from minidsa.models.layers.linear import WeightLoadError, default_weight_loader, set_gemm
from minidsa.models.deepseek_v32 import (DeepseekV32ForCausalLM, RMSNorm, Rotary, set_fp32_gemv, set_mla_absorb,
                                         set_head_norm, set_norm_quant, set_router, set_swiglu_quant)

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
SCALE_SUFFIX = "weight_scale_inv"


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


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointTensor:
    """A checkpoint tensor not read yet: `narrow` it to the part wanted, `materialize` reads just that part."""

    def __init__(self, handle: Any, file: str, name: str, ranges: tuple[tuple[int, int], ...] | None = None):
        self._handle, self.file, self.name = handle, file, name
        try:
            self._slice = handle.get_slice(name)
            full = tuple(self._slice.get_shape())
            self.dtype = _SAFETENSORS_DTYPES[self._slice.get_dtype()]
        except (SafetensorError, OSError, RuntimeError, KeyError) as e:
            raise CheckpointError(f"cannot read tensor {name} from checkpoint shard {file}: {e}") from e
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in full)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        dim = dim % len(self._ranges)
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise CheckpointError(f"slice [{start}, {start + length}) of dimension {dim} is outside tensor "
                                  f"{self.name} of shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        out = CheckpointTensor.__new__(CheckpointTensor)
        out.__dict__.update(self.__dict__)
        out._ranges = tuple(ranges)
        return out

    def materialize(self) -> torch.Tensor:
        try:
            if not self._ranges:
                return self._handle.get_tensor(self.name)
            return self._slice[tuple(slice(start, stop) for start, stop in self._ranges)]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read tensor {self.name} from checkpoint shard {self.file}: {e}") from e


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


def load_checkpoint(model: DeepseekV32ForCausalLM, path: str, device: torch.device, progress: bool = True,
                    files: dict[str, str] | None = None) -> None:
    """Fill `model` (on the meta device, parameters already in their serving formats) from the checkpoint.

    Each checkpoint tensor goes through its parameter's `weight_loader` with the tensor's block scales when it
    is stored as e4m3; the parameter converts (keeps e4m3, quantises, or dequantises) to its own format.
    """
    config = model.config
    files = files if files is not None else checkpoint_files(path)
    materialize(model, device)
    plan = _Plan(model, config)
    loaded: set[str] = set()
    expert_slices: dict[str, set] = defaultdict(set)
    ignored: dict[str, list[str]] = defaultdict(list)
    unexpected: list[str] = []

    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in files.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] + "weight" not in files:
                unexpected.append(name)  # a scale without its weight
            continue
        by_file[file].append(name)

    bar = tqdm(total=sum(len(v) for v in by_file.values()), desc="Loading weights", unit="tensor",
               disable=not progress)
    try:
        _load_shards(by_file, files, plan, loaded, expert_slices, ignored, unexpected, bar)
    except BaseException:
        bar.leave = False  # an error: erase the half-drawn bar, so the error message stands alone
        raise
    finally:
        bar.close()
    _check_complete(path, plan, loaded, expert_slices, ignored, unexpected)


def _load_shards(by_file: dict[str, list[str]], files: dict[str, str], plan: "_Plan", loaded: set[str],
                 expert_slices: dict[str, set], ignored: dict[str, list[str]], unexpected: list[str],
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
                m = _EXPERT_RE.match(name)
                target = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}" if m else name
                param = plan.params.get(target)
                if param is None or target.endswith(SCALE_SUFFIX):
                    unexpected.append(name)
                    continue
                if m:
                    e = int(m.group(2))
                    if e >= getattr(param, "num_experts", param.shape[0]):
                        unexpected.append(name)
                        continue
                    if e not in getattr(param, "local_experts", range(param.shape[0])):
                        expert_slices[target].add((e, m.group(3)))  # another rank's: not read here
                        continue
                tensor = CheckpointTensor(f, file, name)
                scale = None
                if tensor.dtype == torch.float8_e4m3fn:
                    scale_name = name[: -len("weight")] + SCALE_SUFFIX
                    if scale_name not in files:
                        raise CheckpointError(f"fp8 tensor {name} has no {scale_name}")
                    if files[scale_name] == file and scale_name in keys:
                        scale = _read_tensor(f, file, scale_name)
                    else:
                        with _open_shard(files[scale_name]) as g:
                            scale = _read_tensor(g, files[scale_name], scale_name)
                loader = getattr(param, "weight_loader", None) or default_weight_loader
                try:
                    if m:
                        loader(param, tensor, scale, name, expert=e, shard=m.group(3).removesuffix("_proj"))
                        expert_slices[target].add((e, m.group(3)))
                    else:
                        loader(param, tensor, scale, name)
                        loaded.add(name)
                except WeightLoadError as err:
                    raise CheckpointError(str(err)) from None


def _check_complete(path: str, plan: "_Plan", loaded: set[str], expert_slices: dict[str, set],
                    ignored: dict[str, list[str]], unexpected: list[str]) -> None:
    for reason, names in ignored.items():
        logger.info("ignored %d checkpoint tensors (%s), e.g. %s", len(names), reason, names[0])
    missing = []
    for name, param in plan.params.items():
        if name.endswith("_scale_inv"):
            continue  # written with its weight
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            kinds = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            want = {(e, k) for e in range(getattr(param, "num_experts", param.shape[0])) for k in kinds}
            have = expert_slices.get(name, set())
            if name in loaded:  # stored stacked, as minidsa names it
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


def fp8_modules(model: DeepseekV32ForCausalLM, quantization: str, files: dict[str, str] | None) -> list[str]:
    """Switch the modules served in FP8 to e4m3 + block scales (on the meta device); returns their names.

    "none": no module. "fp8": every projection DeepSeek's recipe stores in FP8 (`Linear.quantizable`, routed
    experts). "auto": as stored: with a checkpoint, the projections it stores with a `weight_scale_inv`
    (experts by expert 0's gate_proj); random weights follow the config's `quantization_config`.
    """
    config = model.config
    if quantization not in QUANTIZATIONS:
        raise ConfigError("quantization", f"'{quantization}' is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none" or (quantization == "auto" and files is None and config.quantization != "fp8"):
        return []
    def stored_in_fp8(module: str) -> bool:
        weight = f"{module}.0.gate_proj.weight" if module.endswith(".experts") else f"{module}.weight"
        # The MTP layer sits at model.layers.{num_hidden_layers} in model and checkpoint alike.
        return weight[: -len("weight")] + SCALE_SUFFIX in files

    which = stored_in_fp8 if quantization == "auto" and files is not None else None
    try:
        return model.make_fp8_(which, pow2_scale=config.fp8_pow2_scales)
    except ValueError as e:
        raise ConfigError("quantization", str(e)) from None


def serving_dtypes_(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every high-precision parameter the serving dtype, before it is allocated (FP8 weights and their
    fp32 scales, and the router's fp32 correction bias, keep theirs). Parameters the model only ever reads in fp32
    (`read_in_fp32`: the router's gate, the indexer's head weights) are stored in fp32, so that no step casts
    them (at decode, a cast kernel per layer writing twice the weight's bytes)."""
    for name, p in model.named_parameters():
        if p.dtype == FP8_DTYPE or name.endswith("_scale_inv"):
            continue
        want = torch.float32 if getattr(p, "read_in_fp32", False) else dtype
        if p.dtype != want:
            p.data = torch.empty_like(p, dtype=want)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate a meta module's parameters and buffers (uninitialised) on `device`, in their current dtypes.

    Not `Module.to_empty`: moving off the meta device makes new Parameter objects, and these keep the old
    ones' attributes (their `weight_loader`).
    """
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
                new.__dict__.update(p.__dict__)
                mod._parameters[name] = new
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty_like(b, device=device)


def build_model(config: ModelConfig, path: str | None, dtype: torch.dtype, device: torch.device,
                seed: int = 0, init_std: float = 0.02, progress: bool = True, quantization: str = "auto",
                gemm: str = "torch", moe_gemm: str | None = None, router: str = "torch",
                norm_quant: str = "torch", mla_absorb: str = "torch",
                fp32_gemv: str = "torch", head_norm: str = "torch") -> DeepseekV32ForCausalLM:
    """A model with weights from `path`, or random weights (deterministic in `seed`) when path is None.

    Built on the meta device, given its serving formats (FP8 per `quantization`, see `fp8_modules`; the rest
    in `dtype`), then allocated on `device` and filled: never a full high-precision copy of an FP8 weight.
    `gemm` (one of `layers.linear.GEMMS`) serves the FP8 projections, `moe_gemm` (default: `gemm`) the routed
    experts (`layers.linear.set_gemm`); `router` ("torch" or "triton") selects the experts (`set_router`);
    `norm_quant` ("torch" or "triton"): whether the norms before FP8 linears quantise for them (`set_norm_quant`),
    and SwiGLU's product for an FP8 down projection (`set_swiglu_quant`);
    `mla_absorb` ("torch" or "triton") runs the attention's W_UK / W_UV products (`set_mla_absorb`); `fp32_gemv`
    ("torch" or "triton") the indexers' head weights and the routers' gates (`set_fp32_gemv`); `head_norm` ("torch"
    or "triton") the norms outside the decoder layers (`set_head_norm`).
    """
    files = checkpoint_files(path) if path is not None else None
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    fp8 = fp8_modules(model, quantization, files)
    serving_dtypes_(model, dtype)
    with torch.no_grad():
        if path is None:
            init_random_weights(model, seed, init_std, device, progress=progress)
        else:
            load_checkpoint(model, path, device, progress=progress, files=files)
            # Random ones are drawn in the serving dtype already (`init_random_weights`).
            for p in model.parameters():
                if getattr(p, "read_in_fp32", False) and dtype != torch.float32:
                    p.copy_(p.to(dtype))  # the serving dtype's values, as every other high-precision weight holds
    model.rotary = Rotary(config, device)
    set_gemm(model, gemm, moe_gemm)
    set_router(model, router)
    set_norm_quant(model, norm_quant)
    set_mla_absorb(model, mla_absorb)
    set_swiglu_quant(model, norm_quant)
    set_fp32_gemv(model, fp32_gemv)
    set_head_norm(model, head_norm)
    model.fuse_projections()
    if fp8:
        logger.info("FP8 block-scaled weights in %d modules (GEMM: %s)", len(fp8), gemm)
    return model.eval()


INIT_CHUNK_ELEMS = 1 << 24  # random FP8 weights are drawn and quantised this many values at a time


@torch.no_grad()
def init_random_weights(model: DeepseekV32ForCausalLM, seed: int, std: float, device: torch.device | None = None,
                        chunk_elems: int = INIT_CHUNK_ELEMS, progress: bool = False) -> None:
    """Deterministic random weights: the same seed gives the same model on the same device type.

    A meta model is allocated piece by piece (embedding, each layer, head) and filled in its serving format;
    FP8 weights are drawn `chunk_elems` values at a time and quantised, so building never holds more than
    the final weights plus one chunk's temporaries.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    backbone = model.model
    # Parameters stored in fp32 because they are read in fp32 (`serving_dtypes_`) are drawn in the serving dtype,
    # as a checkpoint ships them: the same random model as when they were stored in it.
    drawn_dtype = backbone.embed_tokens.weight.dtype
    units = [backbone.embed_tokens, *backbone.layers, backbone.norm, model.lm_head]
    # A bar on a terminal only (disable=None): 61 real-shape layers take a while on a GPU.
    for unit in tqdm(units, desc="Random weights", unit="module", disable=None if progress else True, leave=False):
        materialize(unit, device)
        for mod in unit.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if pname.endswith("_scale_inv"):
                    continue  # drawn with its weight
                full = getattr(p, "full_shape", None)
                if full is not None and tuple(full) != tuple(p.shape):  # a tensor-parallel shard
                    _random_shard_(mod, p, tuple(full), std, gen, chunk_elems)
                elif p.dtype == FP8_DTYPE:
                    _random_fp8_(p, getattr(mod, f"{pname}_scale_inv"), std, gen, chunk_elems, mod.pow2_scale)
                elif pname == "weight" and isinstance(mod, (RMSNorm, nn.LayerNorm)):
                    p.fill_(1.0)
                elif pname == "bias":
                    p.zero_()
                elif getattr(p, "read_in_fp32", False):
                    p.copy_(torch.empty_like(p, dtype=drawn_dtype).normal_(0.0, std, generator=gen))
                else:
                    p.normal_(0.0, std, generator=gen)
    materialize(model, device)  # anything outside the units (none today)
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            bias = mod.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=gen, device=device) * 0.1)


def _random_shard_(mod: nn.Module, param: torch.Tensor, full: tuple[int, ...], std: float, gen: torch.Generator,
                   chunk_elems: int) -> None:
    """A shard's random values: the whole tensor drawn as one process draws it (same order, same generator),
    then loaded like a checkpoint tensor (the parameter keeps its slice). Experts one at a time, as
    `_random_fp8_` goes, so the temporary is one expert."""
    loader, dev = param.weight_loader, param.device
    if param.dtype != FP8_DTYPE:
        loader(param, torch.empty(full, dtype=param.dtype, device=dev).normal_(0.0, std, generator=gen))
        return
    pow2 = mod.pow2_scale
    if len(full) == 2:
        weight = torch.empty(full, dtype=FP8_DTYPE, device=dev)
        scale = torch.empty(block_scale_shape(*full), dtype=torch.float32, device=dev)
        _random_fp8_(weight, scale, std, gen, chunk_elems, pow2)
        loader(param, weight, scale)
        return
    experts, rows, cols = full
    gate_up = param is mod.gate_up_proj
    for e in range(experts):
        weight = torch.empty(rows, cols, dtype=FP8_DTYPE, device=dev)
        scale = torch.empty(block_scale_shape(rows, cols), dtype=torch.float32, device=dev)
        _random_fp8_(weight, scale, std, gen, chunk_elems, pow2)
        if gate_up:
            half, half_blocks = rows // 2, rows // 2 // FP8_BLOCK
            loader(param, weight[:half], scale[:half_blocks], expert=e, shard="gate")
            loader(param, weight[half:], scale[half_blocks:], expert=e, shard="up")
        else:
            loader(param, weight, scale, expert=e, shard="down")


def _random_fp8_(weight: torch.Tensor, scale: torch.Tensor, std: float, gen: torch.Generator, chunk_elems: int,
                 pow2_scale: bool) -> None:
    """normal(0, std) values quantised to e4m3 + block scales, 128-row blocks at a time (bounded temporaries)."""
    rows, cols = weight.shape[-2:]
    w3, s3 = weight.view(-1, rows, cols), scale.view(-1, *scale.shape[-2:])
    step = max(FP8_BLOCK, chunk_elems // max(cols, 1) // FP8_BLOCK * FP8_BLOCK)
    for i in range(w3.shape[0]):
        for r in range(0, rows, step):
            n = min(step, rows - r)
            values = torch.empty(n, cols, dtype=torch.float32, device=weight.device).normal_(0.0, std, generator=gen)
            q, s = quant_block(values, pow2_scale=pow2_scale)
            del values
            w3[i, r:r + n] = q
            s3[i, r // FP8_BLOCK:r // FP8_BLOCK + s.shape[0]] = s
