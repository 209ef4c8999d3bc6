"""Request state and the structs that cross module lines: SamplingParams, Request, RequestOutput.

They are msgspec Structs (cheap to build, encode straight to JSON in the
server). Where msgspec is not installed (the GPU machine), `Struct` falls
back to a dataclass with the same constructor and mutable-default semantics.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import time
from typing import Any

try:
    import msgspec

    Struct = msgspec.Struct
except ImportError:  # pragma: no cover - exercised only on machines without msgspec
    class Struct:  # type: ignore[no-redef]
        """Dataclass stand-in for msgspec.Struct: `x: list = []` gives each instance its own list."""

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__()
            for name in cls.__dict__.get("__annotations__", {}):
                value = cls.__dict__.get(name, dataclasses.MISSING)
                if isinstance(value, (list, dict, set)):
                    setattr(cls, name, dataclasses.field(default_factory=lambda v=value: copy.copy(v)))
            dataclasses.dataclass(cls)


MAX_TOP_LOGPROBS = 20  # most alternatives per position (OpenAI's limit)


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the problem. Nothing in the engine changed."""


class QueueFull(InvalidRequest):
    """More than max_queued_requests are waiting."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class SamplingParams(Struct):
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy (exact argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None  # same seed -> same output, whatever else is in the batch
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each generated token under the model (before temperature)
    top_logprobs: int = 0  # with logprobs: also the N (<= 20) likeliest tokens at each generated position
    prompt_logprobs: int | None = None  # N >= 0: log-probability of each prompt token (+ N likeliest alternatives)
    presence_penalty: float = 0.0  # OpenAI: subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # vLLM / SGLang: logits of prompt or generated tokens / it (> 0) or * it (< 0)
    detokenize: bool = True  # False: skip text (benchmarks); stop strings then cannot be used
    # Structured output, OpenAI's shape: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}, "strict": true}}; None or "text" = unconstrained
    response_format: dict[str, Any] | None = None
    # The grammar of `response_format` binds only after this token was generated (a reasoning model's end of
    # thinking, e.g. `</think>`); None = from the first generated token
    structured_after_token_id: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Check every field; raise InvalidRequest naming the first bad one. Normalises `stop` and top_k=-1."""

        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 1 (0 only with prompt_logprobs: score the prompt)")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens", "must be an integer >= 1 (0 only with prompt_logprobs: score the prompt)")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be a number in (0, 10] (1 = off)")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 = off)")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "logprobs", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "needs logprobs=True")
        if self.stop and not self.detokenize:
            raise bad("stop", "needs detokenize=True (stop strings are matched on text)")
        if self.top_k == -1:
            self.top_k = 0
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        return self

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, or preempted (holds no KV)
    RUNNING = 1  # holds a req_to_token row and KV pages
    FINISHED = 2


class Request(Struct):
    """One request's state. The scheduler owns row/pages/seq_len; the engine appends tokens."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = 0.0
    use_prefix_cache: bool = True  # False: neither reuse cached KV pages nor add this request's
    output_ids: list[int] = []
    output_logprobs: list[float] = []
    output_top_logprobs: list[dict[int, float]] = []  # per generated token, with params.top_logprobs
    # with params.prompt_logprobs: per prompt token (the first has none), filled as prefill chunks run
    prompt_logprobs: list[float | None] = []
    prompt_top_logprobs: list[dict[int, float] | None] = []
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # KV: row of req_to_token, pages held, and how many of the request's tokens are cached.
    row: int = -1
    pages: list[int] = []
    seq_len: int = 0  # row positions [0, seq_len) hold KV of tokens [0, seq_len)
    prefill_len: int = 0  # tokens to cache before sampling again (set at admission: prompt + outputs so far)
    admit_seq: int = -1  # admission order; preemption picks the most recent
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Incremental detokenizer: `text` is all output text (stop string cut off); `emitted` chars were handed out.
    text: str = ""
    emitted: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    # Overlapped scheduling: tokens of this request planned into steps whose results have not been
    # processed yet (0 or 1), and how many prompt positions have been planned for prompt-logprob scoring.
    num_pending: int = 0
    prompt_scored: int = 0
    # A chat request's output parser (minidsa.chat.ChatOutputParser): splits the text into reasoning, content
    # and tool calls as it is handed out; None for plain prompts
    chat: Any = None
    # Structured outputs: the request's place in its grammar (minidsa.chat.grammar.GrammarState), fed every
    # generated token; None when unconstrained
    grammar: Any = None
    # DP attention: the attention rank whose scheduler and KV cache hold the request (0: the only one without)
    attention_rank: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.seq_len < self.prefill_len

    @property
    def all_tokens_planned(self) -> bool:
        """Every token max_tokens allows is generated or in flight: nothing more to plan."""
        return len(self.output_ids) + self.num_pending >= self.params.max_tokens

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]


class ToolCall(Struct):
    """A function call the model made (OpenAI's `tool_calls[i]`); `arguments` is JSON text, complete once the
    request finished (while streaming: as far as it has been generated)."""

    id: str
    name: str
    arguments: str


class RequestOutput(Struct):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated ids so far
    text: str  # generated text so far (stop string excluded, held-back text not included until safe)
    new_token_ids: list[int]  # ids produced in this step
    new_text: str  # text delta of this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" (| "tool_calls" for chat requests)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None  # per generated token: token id -> logprob, likeliest first
    # per prompt token, None for the first; sent with the first output and the final one (None between)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    ttft_s: float | None = None
    prompt: str | None = None
    num_preemptions: int = 0
    # Chat requests (LLM.chat, the server's chat endpoint): `text` split by the model's chat format into the
    # reasoning (before `</think>`), the answer, and tool calls, each as far as handed out so far (they only
    # grow). finish_reason is "tool_calls" when the model stopped after calling tools. None for plain prompts.
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    def __repr__(self) -> str:  # short enough for a notebook cell
        text = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        calls = f", tool_calls={[c.name for c in self.tool_calls]}" if self.tool_calls else ""
        return (f"RequestOutput(id={self.request_id!r}, tokens={len(self.token_ids)}, "
                f"finish_reason={self.finish_reason!r}, text={text!r}{calls})")


def now() -> float:
    return time.perf_counter()
