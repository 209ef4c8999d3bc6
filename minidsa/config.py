"""Model and engine configuration.

`ModelConfig` is read from the raw `config.json` on purpose: transformers
config objects for these models have, across releases, dropped or rewritten
fields we depend on (`qk_rope_head_dim`, the indexer sharing schedule, ...).
Every rejected config raises `ConfigError` naming the field and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from minidsa.common.presets import DEFAULT_PRESET, PRESETS, is_preset, preset_config

ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}


class ConfigError(ValueError):
    """A config.json or engine argument that minidsa cannot serve."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"config field '{field_name}': {reason}")
        self.field_name = field_name


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def inv_freq(self, dim: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies for `dim` rotary dims and the factor applied to cos/sin."""
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if self.rope_type == "default":
            return 1.0 / pos_freqs, 1.0
        factor = self.factor
        if self.attention_factor is not None:
            attention_factor = self.attention_factor
        elif self.mscale and self.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
        orig = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)

    def softmax_mscale(self) -> float:
        """YaRN's mscale², folded into the MLA softmax scale."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = _yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "deepseek_v32" | "glm_moe_dsa"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    dense_layers: tuple[bool, ...]  # per main layer: dense MLP (True) or MoE
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_full: tuple[bool, ...]  # per main layer: computes its own top-k (True) or reuses the previous layer's
    indexer_rope_interleave: bool
    num_nextn_predict_layers: int
    mtp_indexer_full: bool  # the nextn layer computes its own top-k even when handed indices
    index_share_for_mtp_iteration: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    hidden_act: str = "silu"
    # From `quantization_config`: "fp8" (DeepSeek's e4m3 with 128x128 block scales, dynamic activations) or None.
    quantization: str | None = None
    fp8_pow2_scales: bool = False  # scale_fmt "ue8m0": block scales are powers of two

    @property
    def kv_cache_dim(self) -> int:
        """Per-token MLA cache width: latent + rope key (576 on the real models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale()

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def num_full_indexer_layers(self) -> int:
        return sum(self.indexer_full)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(cfg_path):
            raise ConfigError("config.json", f"not found at {cfg_path}")
        with open(cfg_path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError("config.json", f"is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(raw)
        g = _Getter(raw)
        num_layers = g.int("num_hidden_layers", minimum=1)
        num_heads = g.int("num_attention_heads", minimum=1)
        q_lora = g.get("q_lora_rank")
        if q_lora is None:
            raise ConfigError("q_lora_rank", "is null; DSA models need the low-rank query path (the indexer reads it)")
        rope_dim = g.int("qk_rope_head_dim", minimum=2)
        if rope_dim % 2:
            raise ConfigError("qk_rope_head_dim", f"must be even, got {rope_dim}")
        index_head_dim = g.int("index_head_dim", minimum=1)
        if rope_dim > index_head_dim:
            raise ConfigError("index_head_dim", f"({index_head_dim}) is smaller than qk_rope_head_dim ({rope_dim})")
        n_experts = g.int("n_routed_experts", minimum=1)
        n_group = g.int("n_group", default=1, minimum=1)
        if n_experts % n_group:
            raise ConfigError("n_group", f"{n_group} does not divide n_routed_experts {n_experts}")
        topk_group = g.int("topk_group", default=1, minimum=1)
        if topk_group > n_group:
            raise ConfigError("topk_group", f"{topk_group} exceeds n_group {n_group}")
        top_k = g.int("num_experts_per_tok", minimum=1)
        if top_k > n_experts * topk_group // n_group:
            raise ConfigError("num_experts_per_tok", f"{top_k} exceeds the experts reachable in topk_group groups")
        if n_experts // n_group < 2:
            raise ConfigError("n_group", "each group needs at least 2 experts (group score = sum of its top 2)")
        nextn = g.int("num_nextn_predict_layers", default=0, minimum=0)
        if nextn > 1:
            raise ConfigError("num_nextn_predict_layers", f"{nextn}: minidsa serves at most one MTP layer")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError("hidden_act", f"'{act}' is not supported (only silu)")
        default_interleave = arch == "glm_moe_dsa"
        indexer_full = _indexer_schedule(raw, num_layers)
        return cls(
            architecture=arch,
            vocab_size=g.int("vocab_size", minimum=1),
            hidden_size=g.int("hidden_size", minimum=1),
            intermediate_size=g.int("intermediate_size", minimum=1),
            moe_intermediate_size=g.int("moe_intermediate_size", minimum=1),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            q_lora_rank=int(q_lora),
            kv_lora_rank=g.int("kv_lora_rank", minimum=1),
            qk_nope_head_dim=g.int("qk_nope_head_dim", minimum=1),
            qk_rope_head_dim=rope_dim,
            v_head_dim=g.int("v_head_dim", minimum=1),
            n_routed_experts=n_experts,
            n_shared_experts=g.int("n_shared_experts", default=1, minimum=0),
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            dense_layers=_dense_layers(raw, num_layers),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=g.int("max_position_embeddings", minimum=1),
            index_n_heads=g.int("index_n_heads", minimum=1),
            index_head_dim=index_head_dim,
            index_topk=g.int("index_topk", minimum=1),
            indexer_full=indexer_full,
            indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", default_interleave)),
            num_nextn_predict_layers=nextn,
            mtp_indexer_full=_mtp_indexer_full(raw, num_layers),
            index_share_for_mtp_iteration=bool(raw.get("index_share_for_mtp_iteration", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            **_quantization(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope"] = {f.name: getattr(self.rope, f.name) for f in fields(self.rope)}
        return out


class _Getter:
    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def int(self, name: str, default: int | None = None, minimum: int | None = None) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise ConfigError(name, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(name, f"must be >= {minimum}, got {value}")
        return value


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURES.values() and not archs:
        return model_type
    raise ConfigError(
        "architectures",
        f"{archs or model_type!r} is not a DSA model minidsa serves (expected one of {sorted(ARCHITECTURES)})",
    )


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" not in params:
            if "rope_theta" not in raw:
                raise ConfigError("rope_theta", "is missing (neither rope_parameters nor rope_theta given)")
            params["rope_theta"] = raw["rope_theta"]
    if not isinstance(params, dict):
        raise ConfigError("rope_parameters", f"must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_parameters.rope_theta", "is missing")
    if rope_type not in ("default", "yarn"):
        raise ConfigError("rope_parameters.rope_type", f"'{rope_type}' is not supported (default or yarn)")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError("rope_parameters.original_max_position_embeddings", "is required for yarn")
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / orig
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """`quantization_config` -> ModelConfig fields; only DeepSeek's FP8 block format is served."""
    q = raw.get("quantization_config")
    if q is None:
        return {"quantization": None, "fp8_pow2_scales": False}
    if not isinstance(q, dict):
        raise ConfigError("quantization_config", f"must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError("quantization_config.quant_method", f"{method!r} is not supported (only 'fp8')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError("quantization_config.fmt", f"{q.get('fmt')!r} is not supported (only 'e4m3')")
    if list(q.get("weight_block_size") or []) != [128, 128]:
        raise ConfigError("quantization_config.weight_block_size",
                          f"{q.get('weight_block_size')!r} is not supported (only [128, 128] blocks)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError("quantization_config.activation_scheme",
                          f"{q.get('activation_scheme')!r} is not supported (only 'dynamic')")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError("quantization_config.scale_fmt", f"{scale_fmt!r} is not supported (ue8m0 or absent)")
    return {"quantization": "fp8", "fp8_pow2_scales": scale_fmt == "ue8m0"}


def _dense_layers(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    types = raw.get("mlp_layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError("mlp_layer_types", f"must list 'dense'/'sparse' for each of {num_layers} layers")
        return tuple(t == "dense" for t in types)
    k = raw.get("first_k_dense_replace", 0)
    if not isinstance(k, int) or k < 0:
        raise ConfigError("first_k_dense_replace", f"must be a non-negative integer, got {k!r}")
    return tuple(i < k for i in range(num_layers))


def indexer_schedule_from_freq(num_layers: int, freq: int, offset: int | None) -> tuple[bool, ...]:
    """Layer i is full iff max(i - offset + 1, 0) % freq == 0 (historic rule without offset: max(i-1, 0))."""
    if freq < 1:
        raise ConfigError("index_topk_freq", f"must be >= 1, got {freq}")
    if offset is None:
        return tuple(max(i - 1, 0) % freq == 0 for i in range(num_layers))
    if offset <= 0:
        raise ConfigError(
            "index_skip_topk_offset",
            f"must be > 0, got {offset}: layer 0 would reuse the top-k of a layer that does not exist",
        )
    return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers))


def _indexer_schedule(raw: dict[str, Any], num_layers: int, *, extra_layers: int = 0) -> tuple[bool, ...]:
    n = num_layers + extra_layers
    types = raw.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) < num_layers or any(t not in ("full", "shared") for t in types):
            raise ConfigError("indexer_types", f"must list 'full'/'shared' for each of {num_layers} layers")
        sched = tuple(t == "full" for t in types)
        sched = sched + (True,) * max(0, n - len(sched))
    elif (pattern := raw.get("index_topk_pattern")) is not None:
        if isinstance(pattern, str):
            if any(c not in "FS" for c in pattern):
                raise ConfigError("index_topk_pattern", f"string must contain only 'F' and 'S', got {pattern!r}")
            sched = tuple(c == "F" for c in pattern)
        elif isinstance(pattern, list) and all(p in ("full", "shared", "F", "S") for p in pattern):
            sched = tuple(p in ("full", "F") for p in pattern)
        else:
            raise ConfigError("index_topk_pattern", f"must be an F/S string or a list, got {pattern!r}")
        if len(sched) < num_layers:
            raise ConfigError("index_topk_pattern", f"has {len(sched)} entries for {num_layers} layers")
        sched = sched + (True,) * max(0, n - len(sched))
    elif (freq := raw.get("index_topk_freq")) is not None:
        if isinstance(freq, bool) or not isinstance(freq, int):
            raise ConfigError("index_topk_freq", f"must be an integer, got {freq!r}")
        offset = raw.get("index_skip_topk_offset")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise ConfigError("index_skip_topk_offset", f"must be an integer, got {offset!r}")
        sched = indexer_schedule_from_freq(n, freq, offset)
    else:
        sched = (True,) * n
    sched = sched[:n]
    if not sched[0]:
        raise ConfigError("indexer_types", "layer 0 must compute its own top-k ('full'): it has no layer to reuse")
    return sched


def _mtp_indexer_full(raw: dict[str, Any], num_layers: int) -> bool:
    """Whether the nextn layer (index num_hidden_layers) runs its own indexer even when handed top-k.

    By default it reuses the indices handed to it; a schedule that covers
    index num_hidden_layers (indexer_types / pattern entry, or the freq rule)
    decides otherwise.
    """
    types = raw.get("indexer_types") or raw.get("index_topk_pattern")
    if types is not None and len(types) <= num_layers:
        return False
    if types is None and raw.get("index_topk_freq") is None:
        return False
    return _indexer_schedule(raw, num_layers, extra_layers=1)[num_layers]


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# The accepted values of EngineConfig's string-valued choices (the CLI lists them in --help).
ENGINE_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", *DTYPES),
    "indexer_cache_dtype": ("auto", "fp8", "model"),
    "kv_cache_dtype": ("auto", "fp8"),
    "quantization": ("auto", "fp8", "none"),
    "kernel_backend": ("auto", "torch", "triton"),
    "distributed_executor_backend": ("auto", "mp", "uni"),
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError("dtype", f"'{name}' is not one of {sorted(DTYPES)}")
    return DTYPES[name]


QUANTIZATIONS = ENGINE_CHOICES["quantization"]


def _arg(default: Any, help: str, **kw: Any) -> Any:
    """An engine argument: its default and its --help text (the CLI generates each flag from the field)."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """Engine arguments, as the user gives them: the same names are the CLI flags (`--max-total-tokens`, ...) and
    the keyword arguments of `LLM(...)`. Frozen: `resolve` decides every "auto" once and returns the
    `ResolvedConfig` the engine runs from; nothing writes into either afterwards."""

    model: str | None = _arg(None, "preset (tiny, bench-dsv32, bench-glm5; NAME:LAYERS sets the layer count, e.g. "
                             "bench-dsv32:8) or checkpoint directory (default: tiny, the embedded model)")
    dtype: str = _arg("auto", "weights and activations; auto = bfloat16 on GPU, float32 on CPU")
    device: str = _arg("auto", "torch device (cpu, cuda, cuda:1, ...); auto = cuda when available")
    page_size: int = _arg(0, "KV page size in tokens, 1 or a power of two; 0 = auto (64 on GPU, 1 on CPU; 1 for "
                          "tree drafts)")
    max_running_requests: int = _arg(64, "most requests in the running batch")
    max_total_tokens: int = _arg(0, "KV cache capacity in tokens; 0 = auto (kv-cache-mem-fraction of the GPU memory "
                                 "the weights and the largest step leave, 65536 on CPU)")
    max_model_len: int = _arg(0, "longest prompt + output in tokens; 0 = auto (what the model and the KV cache allow)")
    chunked_prefill_size: int = _arg(2048, "longest prefill chunk of one request per step, in tokens")
    max_prefill_tokens: int = _arg(8192, "token budget of one prefill step")
    # The decoders of a mixed step wait for its chunks, so the cap bounds their inter-token latency (and slows
    # prefill while others decode). 192: with 64 decode rows the chunk fills the 256-token extend graph. bench-dsv32,
    # `minidsa bench`'s 256 requests, H100: ITL p99 1.81x p50 at 7419 output tok/s; at 8192, 4.55x at 7551
    # (benchmarks/serving/engine_loop_inprocess_h100_extend_graphs.json, benchmarks/serving/ENGINE_LOOP.md).
    max_mixed_prefill_tokens: int = _arg(192, "most prefill tokens a step carries beside decode rows (mixed steps): "
                                         "lower = steadier inter-token latency, slower prefill while requests "
                                         "decode")
    kv_cache_mem_fraction: float = _arg(0.85, "with max-total-tokens 0 on GPU: share of the memory free after "
                                        "loading the weights and reserving the largest step's activations that "
                                        "the KV cache takes, in (0, 1]")
    seed: int = _arg(0, "seed of the random weights (presets) and of unseeded sampling")
    indexer_cache_dtype: str = _arg("auto", "indexer key cache: fp8 (Hadamard-rotated e4m3, DeepGEMM layout) or "
                                    "model (full precision); auto = fp8 on GPU, model on CPU")
    kv_cache_dtype: str = _arg("auto", "MLA KV cache: fp8 = FlashMLA's 656-byte layout (512 e4m3 latent + 4 fp32 "
                               "scales + 64 bf16 rope; ~1.75x the tokens of bf16); auto = the model dtype")
    quantization: str = _arg("auto", "weights: auto = as the checkpoint stores them (e4m3 + block scales stay FP8), "
                             "fp8 = quantise bf16 projections to FP8 at load, none = dequantise to --dtype")
    kernel_backend: str = _arg("auto", "DSA kernels: torch (reference) or triton; auto = triton on GPU, torch on CPU")
    use_deep_gemm: bool = _arg(True, "do not use DeepGEMM's kernels even where they load")
    use_flash_mla: bool = _arg(True, "do not serve sparse MLA attention with FlashMLA's kernels even where they load")
    speculative_num_steps: int = _arg(0, "MTP draft steps per verify; 0 = no speculative decoding")
    speculative_topk: int = _arg(1, "draft branches per step (1 = a chain; > 1 = a tree, needs --page-size 1)")
    speculative_num_draft_tokens: int = _arg(0, "tree drafts: tokens verified per step; 0 = auto (num-steps + 1 "
                                             "for a chain)")
    index_share_for_mtp_iteration: bool | None = _arg(None, "whether the MTP draft reuses the indexer top-k across "
                                                      "its steps; default: what the model config says")
    speculative_simulate_accept_len: float = _arg(
        0.0, "BENCHMARKS ONLY: accept drafts so that a speculative round yields this many tokens on average "
        "(1 .. num-steps + 1); output is then not the model's. 0 = off")
    enable_prefix_caching: bool = _arg(True, "do not reuse the KV of shared prompt prefixes")
    enable_cuda_graph: bool = _arg(True, "run decode eagerly instead of replaying CUDA graphs")
    enable_compile: bool = _arg(True, "run the plain modules instead of the torch.compile'd decoder layers (prefill "
                                "and mixed steps; the CUDA graphs capture them too)")
    cuda_graph_max_bs: int = _arg(64, "largest batch captured as a CUDA graph")
    overlap_schedule: bool = _arg(True, "plan and launch each step only after the previous step's tokens reached the "
                                  "host (default: the next step is planned while the device runs the current one; "
                                  "speculative rounds and penalised requests never overlap)")
    enable_mixed_chunk: bool = _arg(True, "alternate prefill and decode steps instead of running prefill chunks in "
                                    "the decode steps' forward (mixed steps are off under speculative decoding)")
    max_queued_requests: int = _arg(4096, "waiting requests beyond this are refused (HTTP 503)")
    tensor_parallel_size: int = _arg(1, "GPUs (processes) the model is split over, one rank each; minidsa starts "
                                     "them (alias --tp)")
    enable_expert_parallel: bool = _arg(False, "with tensor parallelism, place routed experts whole "
                                        "(n_routed_experts / tp per rank) instead of splitting each expert's "
                                        "intermediate dimension")
    enable_dp_attention: bool = _arg(False, "with --tp N: data-parallel attention (each rank runs attention, the "
                                     "indexer and its own KV cache for its own requests, all heads; the ranks' "
                                     "tokens meet in each MoE layer, routed experts whole, n_routed_experts / N per "
                                     "rank; everything else replicated). Decode steps and speculative rounds "
                                     "(MTP chains) replay CUDA graphs on every rank at one batch bucket; prefill "
                                     "runs uncaptured; no overlap scheduling")
    enable_two_batch_overlap: bool = _arg(False, "with --enable-dp-attention: run each main-model step of at least "
                                          "--two-batch-overlap-min-tokens tokens on a rank (prefill chunks, decode "
                                          "and verify batches) as two micro-batches, so that one's MoE exchange "
                                          "runs while the other computes (each keeps its own shared top-k); "
                                          "experimental: not yet measured on several GPUs")
    two_batch_overlap_min_tokens: int = _arg(512, "with --enable-two-batch-overlap: the fewest tokens on a rank "
                                             "that split (fewer run whole: at decode sizes each half reads every "
                                             "weight again, 1.56x a whole step of 64 on one H200)")
    # Off until bench_allreduce.py has measured it against NCCL on the GPUs (it has not run on any yet).
    enable_custom_all_reduce: bool = _arg(False, "with tensor parallelism on GPUs that reach each other peer to "
                                          "peer, serve small all-reduces with minidsa's one-shot kernel over CUDA "
                                          "IPC buffers (NCCL above its size limit); experimental: not yet measured "
                                          "on GPUs")
    distributed_executor_backend: str = _arg("auto", "mp = one process per rank (also at --tp 1: the distributed "
                                             "code path), uni = one process; auto = mp when --tp > 1")
    tokenizer: str | None = _arg(None, "tokenizer directory or name; default: the checkpoint's, or the DeepSeek-V3 "
                                 "tokenizer for presets")
    chat_template: str | None = _arg(None, "jinja chat template FILE for chat requests, used instead of the "
                                     "checkpoint's template and DeepSeek-V3.2's encoding (the log says which "
                                     "format serves chat)")
    trust_remote_code: bool = _arg(False, "allow a checkpoint's tokenizer to run its own code")
    compile_cache_dir: str | None = _arg(None, "directory of the persistent compile cache (inductor, Triton and "
                                         "DeepGEMM kernels, torch's cache artifacts), reused by the next start with "
                                         "the same model and settings; default: $MINIDSA_CACHE_DIR, else "
                                         "$XDG_CACHE_HOME/minidsa or ~/.cache/minidsa; none = off")
    extra: dict[str, Any] = _arg({}, "not a flag: free-form settings a caller passes through", cli=False)

    def validate(self) -> "EngineConfig":
        def positive(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
                raise ConfigError(name, f"must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")

        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "max_mixed_prefill_tokens",
                     "cuda_graph_max_bs", "max_queued_requests", "speculative_topk", "tensor_parallel_size"):
            positive(name)
        for name in ("page_size", "max_total_tokens", "max_model_len", "speculative_num_steps",
                     "speculative_num_draft_tokens", "seed"):
            positive(name, allow_zero=True)
        sim = self.speculative_simulate_accept_len
        if isinstance(sim, bool) or not isinstance(sim, (int, float)) or not math.isfinite(sim) or sim < 0:
            raise ConfigError("speculative_simulate_accept_len", f"must be a number >= 0 (0 = off), got {sim!r}")
        mf = self.kv_cache_mem_fraction
        if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not 0.0 < mf <= 1.0:
            raise ConfigError("kv_cache_mem_fraction", f"must be in (0, 1], got {mf!r}")
        if self.page_size not in (0, 1) and (self.page_size & (self.page_size - 1)):
            raise ConfigError("page_size", f"must be 1 or a power of two (64 matches DeepGEMM), got {self.page_size}")
        if self.dtype != "auto":
            resolve_dtype(self.dtype)
        if self.indexer_cache_dtype not in ENGINE_CHOICES["indexer_cache_dtype"]:
            raise ConfigError("indexer_cache_dtype", f"'{self.indexer_cache_dtype}' is not auto, fp8 or model")
        if self.kv_cache_dtype not in ENGINE_CHOICES["kv_cache_dtype"]:
            raise ConfigError("kv_cache_dtype", f"'{self.kv_cache_dtype}' is not auto (the model dtype) or fp8")
        if self.quantization not in ENGINE_CHOICES["quantization"]:
            raise ConfigError("quantization", f"'{self.quantization}' is not one of {', '.join(QUANTIZATIONS)}")
        if self.kernel_backend not in ENGINE_CHOICES["kernel_backend"]:
            raise ConfigError("kernel_backend", f"'{self.kernel_backend}' is not auto, torch or triton")
        if self.distributed_executor_backend not in ENGINE_CHOICES["distributed_executor_backend"]:
            raise ConfigError("distributed_executor_backend",
                              f"'{self.distributed_executor_backend}' is not auto, mp or uni")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError("chat_template", f"'{self.chat_template}' is not a file (a jinja chat template)")
        if self.enable_two_batch_overlap:
            if not self.enable_dp_attention:
                raise ConfigError("enable_two_batch_overlap", "needs --enable-dp-attention (it overlaps the MoE "
                                  "exchange of data-parallel attention's ranks)")
            n = self.two_batch_overlap_min_tokens
            if isinstance(n, bool) or not isinstance(n, int) or n < 2:
                raise ConfigError("two_batch_overlap_min_tokens", "must be an integer >= 2 (two micro-batches of "
                                  f"at least one token), got {n!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError("distributed_executor_backend", f"uni (one process) cannot serve tensor_parallel_size "
                              f"{self.tensor_parallel_size}: use auto or mp")
        return self

    @property
    def distributed(self) -> bool:
        """Whether the engine runs through the tensor-parallel (multi-process) path."""
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend == "mp"

    def validate_parallel(self, model: "ModelConfig") -> None:
        """Clear errors for a tensor_parallel_size the model's shapes do not split into."""
        n = self.tensor_parallel_size
        if self.enable_dp_attention:
            self._validate_dp_attention(model)
            return
        if n == 1:
            return
        splits = [("num_attention_heads", model.num_attention_heads), ("vocab_size", model.vocab_size),
                  ("intermediate_size", model.intermediate_size)]
        if model.n_routed_experts:
            splits.append(("n_routed_experts", model.n_routed_experts) if self.enable_expert_parallel
                          else ("moe_intermediate_size", model.moe_intermediate_size))
            if model.n_shared_experts:
                splits.append(("moe_intermediate_size * n_shared_experts",
                               model.moe_intermediate_size * model.n_shared_experts))
        for what, size in splits:
            if size % n:
                hint = " (or --enable-expert-parallel)" if what == "moe_intermediate_size" else ""
                raise ConfigError("tensor_parallel_size", f"{n} does not divide the model's {what} ({size}){hint}")

    def _validate_dp_attention(self, model: "ModelConfig") -> None:
        """--enable-dp-attention: what it needs, and the combinations this first slice does not run yet."""
        n = self.tensor_parallel_size
        if n < 2:
            raise ConfigError("enable_dp_attention", f"needs --tp N with N >= 2 (one attention rank per GPU), got "
                              f"tensor_parallel_size {n}")
        if not model.n_routed_experts:
            raise ConfigError("enable_dp_attention", "needs a MoE model (its routed experts are what the ranks share)")
        if model.n_routed_experts % n:
            raise ConfigError("enable_dp_attention", f"--tp {n} does not divide the model's n_routed_experts "
                              f"({model.n_routed_experts}): each rank holds n_routed_experts / N whole experts")
        if self.speculative_num_steps and self.speculative_topk > 1:
            raise ConfigError("enable_dp_attention", "runs speculative decoding with chains only (speculative_topk "
                              f"1), not tree drafts (speculative_topk {self.speculative_topk})")
        if self.distributed_executor_backend == "uni":
            raise ConfigError("enable_dp_attention", "needs one process per rank: drop "
                              "--distributed-executor-backend uni")


# -- resolution: the one place every "auto" is decided ----------------------------------------------------------

# Environment variables an engine reads, all here, once (`resolve`).
CACHE_DIR_ENV = "MINIDSA_CACHE_DIR"  # the compile cache's directory when --compile-cache-dir is not given
DEEPGEMM_WORKERS_ENV = "MINIDSA_DEEPGEMM_WORKERS"  # processes compiling DeepGEMM's kernels; 0 = none
GRAMMAR_THREADS_ENV = "MINIDSA_GRAMMAR_THREADS"  # threads filling structured outputs' masks
_CACHE_OFF = ("none", "off", "")


@dataclass(frozen=True)
class SpecOptions:
    """Speculative decoding (MTP) as the engine runs it."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    share_topk_across_steps: bool  # the draft reuses its indexer top-k across draft steps (topk == 1 only)
    # Benchmarks only: verification accepts drafts so that a round yields this many tokens on average (None = off)
    simulate_accept_len: float | None = None

    @property
    def reserved_tokens(self) -> int:
        """Row positions past the cached ones a decoding request holds slots for: one round's draft steps
        (`num_steps * topk`, speculative/layout.py) or its verify (`num_draft_tokens`), whichever is more."""
        return max(self.num_steps * self.topk, self.num_draft_tokens)


def speculative_options(engine: EngineConfig, model: ModelConfig) -> SpecOptions | None:
    """The speculative engine arguments checked against each other and the model; None when speculation is off.
    `engine.page_size` must be resolved."""
    steps, topk, ndt = engine.speculative_num_steps, engine.speculative_topk, engine.speculative_num_draft_tokens
    simulate = engine.speculative_simulate_accept_len
    if steps == 0:
        if ndt or topk != 1:
            raise ConfigError("speculative_num_steps", "is 0 but speculative_topk / speculative_num_draft_tokens "
                              "are set; set speculative_num_steps >= 1 to enable MTP speculation")
        if simulate:
            raise ConfigError("speculative_simulate_accept_len", "needs speculative decoding "
                              "(speculative_num_steps >= 1)")
        return None
    if model.num_nextn_predict_layers == 0:
        raise ConfigError("speculative_num_steps", "needs a checkpoint with an MTP (nextn) layer; this one has "
                          "num_nextn_predict_layers = 0 — drop the speculative_* arguments")
    if topk == 1:
        if ndt == 0:
            ndt = steps + 1
        if ndt != steps + 1:
            raise ConfigError("speculative_num_draft_tokens", f"a chain (speculative_topk = 1) of {steps} steps "
                              f"verifies exactly {steps + 1} tokens; set it to {steps + 1} or leave it 0")
    else:
        if engine.page_size != 1:
            raise ConfigError("speculative_topk", f"tree drafts (topk {topk} > 1) need page_size 1 (got "
                              f"{engine.page_size}): compaction moves single slots; use --page-size 1 or "
                              "speculative_topk 1")
        max_nodes = topk + (steps - 1) * topk * topk
        if ndt == 0:
            raise ConfigError("speculative_num_draft_tokens", "must be set for tree drafts (speculative_topk > 1)")
        if not 2 <= ndt <= max_nodes + 1:
            raise ConfigError("speculative_num_draft_tokens", f"{ndt} is outside [2, {max_nodes + 1}] for "
                              f"{steps} steps x topk {topk}")
    if simulate:
        if not 1.0 <= simulate <= steps + 1:
            raise ConfigError("speculative_simulate_accept_len", f"{simulate} is outside [1, {steps + 1}] "
                              f"(tokens per round: 1 = no draft accepted, {steps + 1} = every draft of {steps} steps)")
        if topk != 1:
            raise ConfigError("speculative_simulate_accept_len", "simulates chains only (speculative_topk = 1)")
    share = engine.index_share_for_mtp_iteration
    if share is None:
        share = model.index_share_for_mtp_iteration and topk == 1
    if share and topk > 1:
        raise ConfigError("index_share_for_mtp_iteration", "reusing the draft's top-k across draft steps is only "
                          "valid for chains (speculative_topk = 1): tree rows are reordered between steps")
    return SpecOptions(steps, topk, ndt, bool(share), float(simulate) if simulate else None)


def resolve_model(name: str | None) -> tuple[ModelConfig, str | None, float, str]:
    """(model config, checkpoint path or None for random weights, init std, served model name)."""
    name = name or DEFAULT_PRESET
    if is_preset(name):
        try:
            raw = preset_config(name)
        except ValueError as e:
            raise ConfigError("model", str(e)) from None
        return ModelConfig.from_dict(raw), None, float(raw.get("initializer_range", 0.02)), f"minidsa-{name}"
    if os.path.isdir(name):
        return ModelConfig.from_pretrained(name), name, 0.02, os.path.basename(os.path.normpath(name))
    raise ConfigError("model", f"'{name}' is neither a preset ({', '.join(PRESETS)}, optionally "
                      "NAME:LAYERS) nor a checkpoint directory")


def compile_cache_root(configured: str | None = None) -> str | None:
    """The compile cache's directory: `configured`, else $MINIDSA_CACHE_DIR, else the user's cache dir; None when
    off ("none")."""
    root = configured if configured is not None else os.environ.get(CACHE_DIR_ENV)
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "minidsa")
    if root.strip().lower() in _CACHE_OFF:
        return None
    return os.path.abspath(os.path.expanduser(root))


def _env_int(name: str, minimum: int = 0) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return n


@dataclass(frozen=True)
class ResolvedConfig:
    """What an engine runs from: the arguments with every "auto" decided, and what follows from them. Made once by
    `resolve` (on rank 0 under tensor parallelism, and sent to the other ranks as is: plain, picklable data)."""

    args: EngineConfig  # device, dtype, page_size and indexer_cache_dtype decided (max_total_tokens / max_model_len
    # stay 0 = sized from memory by the runner, which reports what it chose)
    model: ModelConfig
    model_path: str | None  # None: random weights (a preset)
    init_std: float
    served_model_name: str
    spec: SpecOptions | None
    decode_reserve: int  # KV positions one decode step may write past a request's cached tokens
    compile_cache_dir: str | None  # None: no persistent compile cache (off, or not a GPU)
    deepgemm_jit_workers: int | None  # None: as many as the CPUs and the GPU memory allow
    grammar_threads: int

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)

    @property
    def dtype(self) -> torch.dtype:
        return resolve_dtype(self.args.dtype)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step can hold."""
        a = self.args
        return max(a.max_prefill_tokens, a.chunked_prefill_size, a.max_running_requests)

    def on_device(self, device: str) -> "ResolvedConfig":
        """The same configuration for another device (a tensor-parallel rank's GPU)."""
        return dataclasses.replace(self, args=dataclasses.replace(self.args, device=device))


def resolve(config: EngineConfig, model_config: ModelConfig | None = None, init_std: float = 0.02
            ) -> ResolvedConfig:
    """Validate `config` and decide everything it leaves open, once: ConfigError (one line, naming the field)
    for anything that cannot be served, before any weight or process exists. `model_config` (tools that build
    a model of their own shape, with random weights of `init_std`) stands in for `config.model`."""
    config.validate()
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        on_gpu = torch.device(device).type == "cuda"
    except RuntimeError as e:
        raise ConfigError("device", f"'{device}' is not a torch device: {e}") from e
    if on_gpu and not torch.cuda.is_available():
        raise ConfigError("device", f"'{device}' asked for but CUDA is not available")
    if on_gpu and config.tensor_parallel_size > torch.cuda.device_count():  # one GPU per rank: before any starts
        raise ConfigError("tensor_parallel_size", f"{config.tensor_parallel_size} needs {config.tensor_parallel_size} "
                          f"GPUs, {torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")
    args = dataclasses.replace(
        config, device=device,
        dtype=config.dtype if config.dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
        # 64 = DeepGEMM's paged indexer block; tree drafts move single slots
        page_size=config.page_size or (64 if on_gpu and config.speculative_topk == 1 else 1),
        indexer_cache_dtype=(config.indexer_cache_dtype if config.indexer_cache_dtype != "auto"
                             else "fp8" if on_gpu else "model"))
    if model_config is not None:
        model, path, name = model_config, None, "custom"
    else:
        model, path, init_std, name = resolve_model(args.model)
    args.validate_parallel(model)
    if args.enable_dp_attention:
        if launched_by_torchrun():
            raise ConfigError("enable_dp_attention", "does not run under torchrun yet: let minidsa start the ranks "
                              "(run the command without torchrun)")
        # Each rank's tokens travel back to rank 0 after its step: no step is planned before the last one's tokens
        # arrived (decided here, once; nothing writes into the configuration later)
        args = dataclasses.replace(args, overlap_schedule=False)
    spec = speculative_options(args, model)
    threads = _env_int(GRAMMAR_THREADS_ENV, minimum=1)
    cache_dir = compile_cache_root(args.compile_cache_dir) if on_gpu else None
    return ResolvedConfig(
        args=args, model=model, model_path=path, init_std=init_std, served_model_name=name, spec=spec,
        decode_reserve=spec.reserved_tokens if spec is not None else 1, compile_cache_dir=cache_dir,
        deepgemm_jit_workers=_env_int(DEEPGEMM_WORKERS_ENV), grammar_threads=threads or 1)


def launched_by_torchrun() -> bool:
    """Whether a launcher (torchrun) started every rank (RANK / WORLD_SIZE set, more than one rank)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def make_engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """EngineConfig from keyword arguments; ConfigError naming an unknown one."""
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ConfigError(unknown[0], f"is not an engine argument (known: {', '.join(sorted(names))})")
    return EngineConfig(model=model, **engine_args)
