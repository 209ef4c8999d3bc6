"""What an engine needs in device memory (or RAM on a CPU), decided before anything large is allocated.

Two checks, at two moments:
- `check_fit`, before the weights load: the weights (exact: the model is built on the meta device in its serving
  formats and its bytes are counted), the smallest KV cache worth serving with, and a first estimate of the
  activations, against what the device has free. A model that cannot fit fails here in one line, with the sizes and
  what to change, instead of minutes later in an allocation's traceback.
- `ModelRunner._activation_reserve` (exec/runner.py), after the weights load and before the KV cache is sized (GPU,
  automatic KV sizing): the largest step of every kind the engine will run is run once, eagerly, on a one-page
  scratch cache, and its peak is measured; the CUDA graphs' buffers are added. The KV cache then takes a share of
  what remains, so a prefill chunk, a speculative verify or a draft extend never meets an out-of-memory error
  mid-serving.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from minidsa.config import ConfigError, ModelConfig, ResolvedConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Above the measured peaks: the caching allocator's fragmentation, cuBLAS / NCCL workspaces, the CUDA context.
ACTIVATION_MARGIN_BYTES = 1 << 30
ACTIVATION_MARGIN_FRACTION = 0.02
# Tokens of the smallest KV cache worth serving with when max_model_len is left automatic.
MIN_KV_TOKENS = 4096


class DoesNotFit(ConfigError):
    """The model cannot run on this device with these settings; the message says by how much and what to change."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.field_name = "memory"


def weight_bytes(model_config: ModelConfig, model_path: str | None, dtype: torch.dtype, quantization: str,
                 ranks: int = 1, dp_attention: bool = False) -> int:
    """Bytes of the weights one of `ranks` ranks holds as served (FP8 where they will be FP8), counted on a meta-device
    model: a 1/N share of everything under tensor parallelism; under DP attention a 1/N share of the routed experts
    and everything else whole (attention, dense MLPs, shared experts, embeddings and lm_head are replicated)."""
    from minidsa.models.deepseek_v32 import DeepseekV32ForCausalLM
    from minidsa.models.loader import checkpoint_files, fp8_modules, serving_dtypes_

    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(model_config)
    fp8_modules(model, quantization, checkpoint_files(model_path) if model_path is not None else None)
    serving_dtypes_(model, dtype)
    total = routed = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = t.numel() * t.element_size()
        total += size
        routed += size if ".experts." in f".{name}" else 0  # MoE.experts (not shared_experts)
    if dp_attention:
        return routed // ranks + total - routed
    return total // ranks


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes free for this engine, what they are) on a CUDA device or in host RAM; (0, why) when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device} ({torch.cuda.get_device_name(device)})"
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of RAM available"
    except (ValueError, OSError, AttributeError):
        return 0, "unknown (no sysconf on this platform)"


def step_activation_estimate(model_config: ModelConfig, tokens: int, context: int, logit_rows: int,
                             dtype: torch.dtype) -> int:
    """A rough upper bound of one step's activations, from the model's shapes (before anything can be measured):
    the indexer's fp32 logits over the context and the top-k select's copy of them, the MoE's per-pair buffers,
    MLA's per-head queries and outputs, the dense MLP, and the sampled rows' fp32 logits."""
    m, e = model_config, torch.empty(0, dtype=dtype).element_size()
    indexer = 2 * tokens * context * 4
    moe = tokens * m.num_experts_per_tok * (3 * m.moe_intermediate_size + m.hidden_size) * e
    mla = tokens * m.num_attention_heads * (2 * m.kv_cache_dim + m.kv_lora_rank + m.qk_head_dim) * e
    dense = tokens * 3 * m.intermediate_size * e
    hidden = 6 * tokens * m.hidden_size * e
    logits = 3 * logit_rows * m.vocab_size * 4
    return indexer + max(moe, dense) + mla + hidden + logits


@dataclass(frozen=True)
class FitReport:
    weights: int
    min_kv: int
    activations: int
    available: int
    where: str

    @property
    def needed(self) -> int:
        return self.weights + self.min_kv + self.activations


def check_fit(resolved: ResolvedConfig, kv_bytes_per_token: int) -> FitReport:
    """Raise DoesNotFit (one line) when the weights + the smallest useful KV cache (all of a given max_total_tokens)
    + the activations cannot fit in what the device (or RAM) has free."""
    config, model_config, decode_reserve = resolved.args, resolved.model, resolved.decode_reserve
    device, dtype = resolved.device, resolved.dtype
    weights = weight_bytes(model_config, resolved.model_path, dtype, config.quantization,
                           config.tensor_parallel_size, config.enable_dp_attention)
    longest = config.max_model_len or min(model_config.max_position_embeddings, MIN_KV_TOKENS)
    # A given max_total_tokens is allocated as given (not sized from what is free): all of it must fit.
    kv_tokens = max(longest + decode_reserve, config.max_total_tokens)
    min_kv = kv_tokens * kv_bytes_per_token
    step_tokens = resolved.step_tokens
    activations = step_activation_estimate(model_config, step_tokens, longest,
                                           config.max_running_requests * decode_reserve, dtype)
    available, where = available_bytes(device)
    report = FitReport(weights, min_kv, activations, available, where)
    if available and report.needed > available:
        hints = []
        if config.max_total_tokens > longest + decode_reserve:
            hints.append("a smaller --max-total-tokens (or none: the KV cache is then sized from free memory)")
        if config.max_model_len == 0 or config.max_model_len > MIN_KV_TOKENS:
            hints.append("a smaller --max-model-len")
        if config.max_prefill_tokens > 2048:
            hints.append("a smaller --max-prefill-tokens")
        hints.append("more GPUs (--tp)" if device.type == "cuda" else "a GPU, or the tiny preset")
        raise DoesNotFit(
            f"the model does not fit: it needs {report.needed / GiB:.1f} GiB (weights {weights / GiB:.1f}, KV cache "
            f"for {kv_tokens} tokens {min_kv / GiB:.2f}, activations about {activations / GiB:.2f}), "
            f"{available / GiB:.1f} GiB {where}; try {', '.join(hints)}")
    logger.info("memory: weights %.2f GiB, KV cache of at least %.2f GiB, activations about %.2f GiB; %.1f GiB %s",
                weights / GiB, min_kv / GiB, activations / GiB, available / GiB, where)
    return report


def graph_buffer_bytes(model_config: ModelConfig, dtype: torch.dtype, max_bs: int, tokens_per_req: list[int],
                       logit_rows_per_req: list[int], extend_tokens: int, max_requests: int) -> int:
    """Bytes of the CUDA graphs' per-kind input and output buffers (graphs.StepGraphs): per kind, its largest
    bucket's tokens (ids, positions, ..., hidden in and out, top-k) and logits rows."""
    e = torch.empty(0, dtype=dtype).element_size()
    per_token = 2 * model_config.hidden_size * e + model_config.index_topk * 4 + 8 * 8
    per_row = model_config.vocab_size * 4
    total = 0
    for t, r in zip(tokens_per_req, logit_rows_per_req):
        total += max_bs * (t * per_token + r * per_row)
    if extend_tokens:
        total += extend_tokens * per_token + min(extend_tokens, max_requests) * per_row
    return total


def margin_bytes(total_device_bytes: int) -> int:
    return ACTIVATION_MARGIN_BYTES + int(ACTIVATION_MARGIN_FRACTION * total_device_bytes)
