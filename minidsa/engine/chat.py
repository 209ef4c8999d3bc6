"""Chat requests on an Engine: a conversation rendered with the model's chat format, added as a request whose
output is parsed back (reasoning, content, tool calls). LLM.chat and the server both come through here, so a
conversation becomes the same tokens and its answer the same message either way.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from minidsa.chat.formats import ChatFormat, ChatOptions, PreparedChat, select_chat_format
from minidsa.chat.messages import ChatFormatError
from minidsa.common.request import SamplingParams


def chat_format(engine: Any) -> ChatFormat:
    """The engine's chat format (decided on first use and logged; cached per model)."""
    return select_chat_format(engine.model_config.architecture, engine.tokenizer, engine.config.args.chat_template)


def prepare_chat(engine: Any, messages: Any, params: SamplingParams | None = None,
                 options: ChatOptions | None = None) -> tuple[PreparedChat, SamplingParams]:
    """The rendered conversation and the request's sampling parameters: its response_format (the request's own, or
    the JSON schema of a forced tool call) made to bind after the model's thinking. Raises ChatFormatError (an
    InvalidRequest) for what the format cannot render."""
    params = copy.copy(params) if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ChatFormatError(f"params must be SamplingParams, got {type(params).__name__}")
    options = options or ChatOptions()
    if params.response_format is not None:
        options = dataclasses.replace(options, response_format=params.response_format)
    prepared = chat_format(engine).prepare(engine.tokenizer, messages, options)
    if prepared.response_format is not None:
        params.response_format = prepared.response_format
        if params.structured_after_token_id is None:
            params.structured_after_token_id = prepared.structured_after_token_id
    return prepared, params


def add_chat_request(engine: Any, messages: Any, params: SamplingParams | None = None,
                     options: ChatOptions | None = None, request_id: str | None = None) -> str:
    prepared, params = prepare_chat(engine, messages, params, options)
    rid = engine.add_request(prepared.token_ids, params, request_id=request_id)
    engine.outputs.parse_chat(engine.requests[rid], prepared.output)
    return rid
