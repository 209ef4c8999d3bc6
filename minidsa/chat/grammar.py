"""Structured outputs: a request's `response_format` as a grammar over token ids, and each request's place in it.

The library is xgrammar (github.com/mlc-ai/xgrammar). It is maintained, compiles JSON Schemas into pushdown
automata over the model's vocabulary, and fills a packed token bitmask per request: most tokens' verdicts are
precomputed per grammar state, a few microseconds per mask for typical JSON. It rolls back by tokens, which a
speculative verify needs, and it ships a GPU apply kernel. vLLM and SGLang use it as their default backend.
llguidance would also do; xgrammar was the issue's first choice and covers everything below. It is imported
lazily, by the first request that asks for structure: an engine runs without it, and such a request then gets an
InvalidRequest naming the package.

Supported `response_format`s (OpenAI's shapes):
- {"type": "text"} or None: unconstrained.
- {"type": "json_object"}: any JSON object.
- {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}: JSON valid against the
  schema. With `strict: true`, properties and array items that the schema does not list are forbidden even where
  it does not say `additionalProperties: false` (OpenAI's strict mode requires that anyway). Without it, the
  schema means what JSON Schema says: unlisted properties are allowed unless the schema forbids them.
The JSON is compact, on one line (", " and ": " separators and no other whitespace). If any whitespace were
allowed between tokens, a model could pad its answer with newlines until max_tokens.

The pieces:
- `parse_response_format`: checks the shape and needs no library. InvalidRequest names what is wrong.
- `StructuredOutputs`, one per engine: the tokenizer's vocabulary as xgrammar sees it (built once, padded to the
  model's vocab_size), the compiler, a bounded LRU of compiled grammars keyed by their canonical JSON, and
  `fill_bitmask` for a step's rows.
- `GrammarState`, one per request: the matcher. Its docstring has the speculative-verify recipe.

The bitmask layout is xgrammar's: int32 [rows, ceil(vocab_size / 32)], bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minidsa.common.request import InvalidRequest
from minidsa.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
DEFAULT_CACHE_SIZE = 64  # compiled grammars kept per engine (a schema used again skips its ~0.1 s compile)


def import_xgrammar():
    """The xgrammar module, or InvalidRequest if this machine cannot import it."""
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidRequest(f"structured outputs need xgrammar (pip install xgrammar): {e}") from e
    return xgrammar


@dataclass(frozen=True)
class ResponseFormat:
    """A constraining response_format, checked: what to compile and the key to cache it by."""

    type: str  # "json_object" | "json_schema"
    schema: Any  # a JSON Schema (an object or a boolean); json_object: {"type": "object"}
    strict: bool

    @property
    def key(self) -> str:
        # Not sort_keys: the order of `properties` is the order the grammar generates them in.
        return json.dumps([self.type, self.schema, self.strict], separators=(",", ":"), ensure_ascii=False)


def parse_response_format(response_format: Any) -> ResponseFormat | None:
    """The constraint a `SamplingParams.response_format` asks for (None: unconstrained); InvalidRequest if its shape
    is wrong. The schema itself is checked when it compiles (`StructuredOutputs.compile`)."""
    if response_format is None:
        return None

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"SamplingParams.response_format {why}")

    if not isinstance(response_format, dict):
        raise bad(f"must be an object such as {{'type': 'json_object'}}, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", {"type": "object"}, strict=False)
    if kind != "json_schema":
        raise bad(f"type {kind!r} is not supported (one of {', '.join(RESPONSE_FORMAT_TYPES)})")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("of type json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"json_schema.name must be a string, got {type(name).__name__}")
    if "schema" not in spec:
        raise bad("json_schema.schema is missing (the JSON Schema the answer must follow)")
    schema = spec["schema"]
    if not isinstance(schema, (dict, bool)):
        raise bad(f"json_schema.schema must be a JSON Schema object, got {type(schema).__name__}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"json_schema.strict must be true or false, got {strict!r}")
    fmt = ResponseFormat("json_schema", schema, strict=bool(strict))
    try:
        json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise bad(f"json_schema.schema is not JSON: {e}") from None
    return fmt


def _library_message(e: Exception) -> str:
    """xgrammar's error text without its log prefix ("[12:00:00] /project/cpp/file.cc:123: ")."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:.]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.splitlines()[0] if text else type(e).__name__


class GrammarState:
    """Where one request stands in its grammar: the tokens it generated so far, accepted one by one.

    With `after_token_id` (a reasoning model's end of thinking), tokens are free until that token has been
    accepted: the mask allows everything, and the grammar starts with the token after it.

    The engine, once per sampled token: `fill_mask(bitmask, row)` before the step samples, `accept([token])` after.
    `terminated`: the grammar has accepted a stop token (end of sequence) after a complete value, so the request
    ends (finish_reason "stop"). Once the value is complete and nothing may follow, the mask allows only the stop
    tokens, so the next token ends it.

    Speculative verify of a chain draft d_0 .. d_{k-1} for one request (verify positions 0 .. k, position i
    predicts d_i and position k the bonus token), before the verify step samples:

        m = state.fill_draft_masks(draft, bitmask, first_row)

    Row first_row + i gets the mask of position i for i <= m, where m is the number of leading drafts the grammar
    accepts. Rows past m are all-ones, and verification never reaches them: position m's mask forbids d_m, so d_m
    is rejected there. The state is left as it was. Apply rows first_row .. first_row + k to the verify logits of
    the request's k + 1 positions, verify as usual, then commit what was accepted:

        state.accept(committed)  # the accepted drafts + the bonus / corrected token; returns len(committed)

    `fill_draft_masks` is `fill_mask` / `accept` / `rollback` along the chain. A tree verifies each root-to-leaf
    path the same way (accept the path's tokens, fill, rollback).
    """

    def __init__(self, matcher: Any, after_token_id: int | None = None):
        self._matcher = matcher
        self._after = after_token_id
        self._started = after_token_id is None  # the grammar binds (the trigger token has been accepted)
        self._free = 0  # tokens accepted before the grammar started (the trigger included)
        self._bound = 0  # tokens the matcher accepted

    @property
    def binding(self) -> bool:
        """The grammar constrains the next token (it has started and not terminated)."""
        return self._started and not self._matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self._started and self._matcher.is_terminated()

    @property
    def num_accepted(self) -> int:
        return self._free + self._bound

    def accept(self, tokens: Iterable[int]) -> int:
        """Advance over `tokens` in order; stops at the first one the grammar rejects. Returns how many it took."""
        n = 0
        for token in tokens:
            if not self._started:
                self._free += 1
                self._started = token == self._after
            elif self._matcher.accept_token(int(token)):
                self._bound += 1
            else:
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (back across the trigger token: free again)."""
        if not 0 <= n <= self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_accepted} were accepted")
        bound = min(n, self._bound)
        if bound:
            self._matcher.rollback(bound)
            self._bound -= bound
        if n > bound:  # the trigger is the last free token: undoing any free token undoes it
            self._free -= n - bound
            self._started = False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Row `row` of `bitmask` (CPU int32 [rows, ceil(vocab / 32)]): the tokens allowed next. False if it allows
        every token (the grammar has not started, or has terminated)."""
        if not self.binding:
            bitmask[row].fill_(-1)
            return False
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def fill_draft_masks(self, draft: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """The masks of a chain draft's verify positions into rows first_row .. first_row + len(draft) (see the
        class docstring); returns how many leading drafts the grammar accepts. The state is unchanged."""
        walked = 0
        for i, token in enumerate(draft):
            self.fill_mask(bitmask, first_row + i)
            if self.accept([token]) == 0:
                break
            walked += 1
        if walked == len(draft):
            self.fill_mask(bitmask, first_row + walked)
        else:
            bitmask[first_row + walked + 1:first_row + len(draft) + 1].fill_(-1)
        self.rollback(walked)
        return walked


class StructuredOutputs:
    """An engine's grammar compiler: the vocabulary (built once), compiled grammars (bounded LRU), masks per step.

    `fill_threads` > 1 fills a step's masks on that many threads (xgrammar's batch matcher) once a step has at
    least `BATCH_FILL_MIN_ROWS` constrained rows. The default comes from MINIDSA_GRAMMAR_THREADS, else 1: on a
    2-core machine the threads cost more than they saved (64 rows of JSON took 1 ms on one thread, 4 ms on two).
    """

    BATCH_FILL_MIN_ROWS = 16

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, fill_threads: int = 1):
        xgr = import_xgrammar()
        stop = sorted(set(eos_token_ids))
        if not stop:
            raise InvalidRequest("structured outputs need an end-of-sequence token (the model's config.json and "
                                 "tokenizer name none): a finished JSON value must be able to end the request")
        from tokenizers import Tokenizer as TokenizersTokenizer
        from transformers import PreTrainedTokenizerFast  # a dependency of minidsa and of xgrammar

        start = time.perf_counter()
        backend = TokenizersTokenizer.from_file(os.path.join(tokenizer.directory, "tokenizer.json"))
        # The fast-tokenizer wrapper is how xgrammar learns the vocabulary's encoding (byte-level BPE here).
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                  vocab_size=vocab_size, stop_token_ids=stop)
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.bitmask_width = math.ceil(vocab_size / 32)
        # The engine keeps its own bounded cache (xgrammar's would grow without bound).
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                             cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.cache_size = cache_size
        self.fill_threads = fill_threads  # MINIDSA_GRAMMAR_THREADS, read by config.resolve
        self._batch_matchers: dict[int, Any] = {}
        logger.info("structured outputs: xgrammar's view of the %d-token vocabulary built in %.2f s (stop tokens %s)",
                    vocab_size, time.perf_counter() - start, stop)

    def compile(self, fmt: ResponseFormat) -> Any:
        """The compiled grammar of a response format (cached); InvalidRequest if its schema cannot be compiled."""
        key = fmt.key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        schema = json.dumps(fmt.schema, ensure_ascii=False)
        try:
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=fmt.strict)
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError from its Python side)
            raise InvalidRequest(f"SamplingParams.response_format {fmt.type}: the schema cannot be used: "
                                 f"{_library_message(e)}") from None
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def new_state(self, fmt: ResponseFormat, after_token_id: int | None = None) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(fmt)), after_token_id)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU bitmask for `rows` rows, all tokens allowed."""
        return torch.full((rows, self.bitmask_width), -1, dtype=torch.int32)

    def fill_bitmask(self, states: Sequence[GrammarState | None], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (CPU int32 [>= len(states), bitmask_width]) gets states[i]'s next-token mask; rows of
        None (a request that finished after its step was planned) and of free states allow every token."""
        binding = []
        for i, state in enumerate(states):
            if state is not None and state.binding:
                binding.append(i)
            else:
                bitmask[i].fill_(-1)
        if self.fill_threads > 1 and len(binding) >= self.BATCH_FILL_MIN_ROWS:
            batch = self._batch_matchers.get(self.fill_threads)
            if batch is None:
                batch = self._batch_matchers[self.fill_threads] = self._xgr.BatchGrammarMatcher(self.fill_threads)
            batch.batch_fill_next_token_bitmask([states[i]._matcher for i in binding], bitmask, binding)
        else:
            for i in binding:
                states[i]._matcher.fill_next_token_bitmask(bitmask, i)

