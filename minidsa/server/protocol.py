"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests are strict: an unknown field, a wrong type or an out-of-range value
is a `RequestError` (HTTP 400) naming the offending field, in OpenAI's error
shape. OpenAI fields minidsa does not implement (logit_bias, suffix, best_of
other than n, audio, web search, ...) are accepted only at their neutral value,
so a client that sends the default is served and one that relies on the
feature is told it is missing, always in the same words (`unsupported`).
OpenAI fields that change nothing about the output here (store, metadata,
user, service_tier, prompt_cache_key, ...) are accepted and ignored, with a
debug log line, as agent frameworks send them on every request.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

logger = logging.getLogger(__name__)

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
    include_obfuscation: bool | None = None  # ignored: no obfuscation padding is sent


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True):
    """OpenAI's response_format: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None
    # accepted and ignored: they change nothing about the output here
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


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


class FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Struct, forbid_unknown_fields=True):
    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # an assistant turn's reasoning (dropped by formats that drop it)
    reasoning: str | None = None  # the same, by vLLM's newer name
    refusal: str | None = None  # ignored


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None  # None -> up to the context length
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # bounds checked below, as for completions' logprobs
    tools: Annotated[list[ToolDef], Meta(min_length=1, max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"thinking": true} / {"enable_thinking": false}
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # OpenAI features minidsa does not have: only their neutral values are accepted
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None  # ignored: a latency hint, the output is the same


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a completion prompt, or a conversation rendered as chat requests render it."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # prompt: default true (as completions encode it)
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: Annotated[list[ToolDef], Meta(min_length=1, max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


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


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatResponseMessage(Struct, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls
    reasoning_content: str | None = None  # the model's thinking, when it thought
    tool_calls: list[ToolCallOut] = []


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


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed call: the first delta of a call has its id, type and name (arguments ""), later ones carry
    argument fragments; concatenated they are the call's JSON arguments."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
_encoder = msgspec.json.Encoder()
_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_FIELD_RE = re.compile(r"field `([^`]*)`")


def encode(obj: Struct) -> bytes:
    return _encoder.encode(obj)


def error_body(err: RequestError) -> bytes:
    return encode(ErrorResponse(ErrorBody(err.message, err.type, err.param, err.code)))


def _decode(decoder: msgspec.json.Decoder, body: bytes, sampling: bool = True):
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
    if sampling:
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
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "text output only")
    for name, why in (("audio", "no audio output"), ("web_search_options", "no web search"),
                      ("functions", "use 'tools'"), ("function_call", "use 'tool_choice'")):
        if getattr(req, name) is not None:
            raise unsupported(name, why)
    if req.verbosity not in (None, "medium"):
        raise unsupported("verbosity", "the answer's length is the model's; use max_tokens to bound it")
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and \
            req.tool_choice.function.name not in {t.function.name for t in req.tools}:
        raise RequestError(f"'tool_choice' names the function '{req.tool_choice.function.name}', which is not in "
                           "'tools'", param="tool_choice")
    _check_messages(req.messages)
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


def decode_tokenize_request(body: bytes) -> TokenizeRequest:
    req = _decode(_tokenize_decoder, body, sampling=False)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("send either 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        _check_messages(req.messages)
    if req.response_format is not None:
        _check_response_format(req.response_format)
    return req


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    return _decode(_detokenize_decoder, body, sampling=False)


_IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                   "safety_identifier", "prediction", "refusal")


def _check_unsupported(req: _SamplingFields) -> None:
    if req.logit_bias:
        raise unsupported("logit_bias", "no per-token logit offsets")
    if req.response_format is not None:
        _check_response_format(req.response_format)
    if logger.isEnabledFor(logging.DEBUG):
        ignored = [name for name in _IGNORED_FIELDS if getattr(req, name, None) is not None]
        if req.stream_options is not None and req.stream_options.include_obfuscation is not None:
            ignored.append("stream_options.include_obfuscation")
        if ignored:
            logger.debug("ignoring request fields that change nothing here: %s", ", ".join(ignored))


def _check_response_format(rf: ResponseFormat) -> None:
    if rf.type == "json_schema" and rf.json_schema is None:
        raise RequestError("response_format of type 'json_schema' needs 'json_schema': {'name': ..., "
                           "'schema': {...}}", param="response_format.json_schema")
    if rf.type != "json_schema" and rf.json_schema is not None:
        raise RequestError(f"response_format of type '{rf.type}' takes no 'json_schema'",
                           param="response_format.json_schema")


def response_format_dict(rf: ResponseFormat | None) -> dict[str, Any] | None:
    """The request's response_format in OpenAI's dict shape (SamplingParams.response_format); None for text."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "json_object"}
    js = rf.json_schema
    spec: dict[str, Any] = {"name": js.name, "schema": js.schema if js.schema is not None else {}}
    if js.strict is not None:
        spec["strict"] = js.strict
    if js.description is not None:
        spec["description"] = js.description
    return {"type": "json_schema", "json_schema": spec}


def _check_messages(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise RequestError(f"messages[{i}]: only assistant messages carry 'tool_calls'",
                               param=f"messages[{i}].tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise RequestError(f"messages[{i}]: only tool messages carry 'tool_call_id'",
                               param=f"messages[{i}].tool_call_id")


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


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts in OpenAI's shape (the chat formats check and render them)."""
    out = []
    for m in messages:
        if m.content is None or isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(p.text for p in m.content)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                                 for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def tools_list(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in msgspec.structs.asdict(t.function).items()
                                              if v is not None}} for t in tools]


def tool_choice_value(choice: str | NamedToolChoice | None) -> Any:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.function.name}}
    return choice or "auto"


def now() -> int:
    return int(time.time())
