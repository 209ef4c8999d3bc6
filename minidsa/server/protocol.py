"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests are strict: an unknown field, a wrong type or an out-of-range value
is a `RequestError` (HTTP 400) naming the offending field, in OpenAI's error
shape. OpenAI fields minidsa does not implement (logit_bias, suffix, best_of
other than n) are accepted only at their neutral value, so a client that sends
the default is served and one that relies on the feature is told it is missing,
always in the same words (`unsupported`).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]  # 0 or -1 = off
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
MaxTokens = Annotated[int, Meta(ge=0)]  # 0 only with echo (checked after decoding)
MAX_LOGPROBS = 20
NumChoices = Annotated[int, Meta(ge=1, le=16)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1)]
StopList = Annotated[list[StopString], Meta(max_length=16)]


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style JSON error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _SamplingFields(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields common to both endpoints (OpenAI names, plus vLLM-style extensions)."""

    model: str | None = None
    temperature: Temperature | None = None  # None -> 1.0, OpenAI's default
    top_p: TopP = 1.0
    top_k: TopK = 0  # extension
    min_p: MinP = 0.0  # extension
    n: NumChoices = 1
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0  # extension (vLLM / SGLang)
    logit_bias: dict[str, float] | None = None
    user: str | None = None


# A completion prompt: one string, a list of strings, one token-id list, or a list of token-id lists.
# (msgspec unions allow one array type, so the shapes are told apart after decoding.)
PromptField = str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptField
    max_tokens: MaxTokens | None = 16  # None -> up to the context length
    logprobs: int | None = None  # N: each token's logprob + the N likeliest alternatives (bounds checked below)
    echo: bool = False
    best_of: Annotated[int, Meta(ge=1, le=16)] | None = None
    suffix: str | None = None


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None  # None -> up to the context length
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # bounds checked below, as for completions' logprobs


# ---------------------------------------------------------------- responses


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first prompt token of an echo
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Struct):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ChatTopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(Struct):
    role: str
    content: str


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "minidsa"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody


# ---------------------------------------------------------------- decoding

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_encoder = msgspec.json.Encoder()
_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_FIELD_RE = re.compile(r"field `([^`]*)`")


def encode(obj: Struct) -> bytes:
    return _encoder.encode(obj)


def error_body(err: RequestError) -> bytes:
    return encode(ErrorResponse(ErrorBody(err.message, err.type, err.param, err.code)))


def _decode(decoder: msgspec.json.Decoder, body: bytes):
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        field = _FIELD_RE.search(msg)
        path = _PATH_RE.search(msg)
        if field:
            prefix = path.group(1) + "." if path and path.group(1) else ""
            param = prefix + field.group(1)
        else:
            param = path.group(1) if path and path.group(1) else None
        raise RequestError(f"invalid request: {msg}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    _check_unsupported(req)
    return req


def unsupported(name: str, why: str) -> RequestError:
    """The one shape of every refusal of a parameter minidsa does not implement."""
    return RequestError(f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter")


def _check_count(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got {value}", param=name)


def decode_completion_request(body: bytes) -> CompletionRequest:
    req = _decode(_completion_decoder, body)
    if req.suffix:
        raise unsupported("suffix", "minidsa completes after the prompt only")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", "only best_of = n")
    _check_count("logprobs", req.logprobs)
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("'max_tokens' must be >= 1 (0 only with echo: score the prompt)", param="max_tokens")
    prompt_list(req.prompt)  # validates the shape
    return req


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    req = _decode(_chat_decoder, body)
    _check_count("top_logprobs", req.top_logprobs)
    if req.top_logprobs and not req.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    for name in ("max_tokens", "max_completion_tokens"):
        if getattr(req, name) == 0:
            raise RequestError(f"'{name}' must be >= 1", param=name)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise RequestError("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
    return req


def _check_unsupported(req: _SamplingFields) -> None:
    if req.logit_bias:
        raise unsupported("logit_bias", "no per-token logit offsets")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The completion prompt as a list of prompts (each a string or a token-id list)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p:
                raise RequestError(f"prompt[{i}] is an empty token list", param="prompt")
        return list(prompt)
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of "
                       "token-id lists (not a mix)", param="prompt")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the plain dicts a chat template expects (text parts joined)."""
    out = []
    for m in req.messages:
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(p.text for p in m.content)
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def now() -> int:
    return int(time.time())
