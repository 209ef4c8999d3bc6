"""Output processing: tokens in, text and `RequestOutput`s out.

Every generated token, from a plain step or several accepted at once by the speculator, enters a request
through `OutputProcessor.append_tokens`, which checks stop conditions per token (eos, stop token ids, stop
strings on the detokenised text, max_tokens, max_model_len) and drops tokens after a stop. Text is
detokenised incrementally and held back while it could still be the start of a stop string.

A chat request (`parse_chat`) also has its text, as it is handed out, split by its chat format's parser
(minidsa.chat) into reasoning, content and tool calls, which its outputs carry. A parser failure never fails the
step: the rest of that request's text becomes plain content.
"""

from __future__ import annotations

import logging
from typing import Callable

from minidsa.chat.parser import ChatOutputParser, OutputSpec
from minidsa.common.request import Request, RequestOutput, ToolCall, now
from minidsa.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Callable[[], Tokenizer], eos_token_ids: frozenset[int], max_model_len: int):
        self._tokenizer = tokenizer  # loaded on first use: token-id workloads run without one
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generation_tokens_total = 0

    @staticmethod
    def parse_chat(req: Request, spec: OutputSpec) -> None:
        """Read this request's output as a chat answer (before its first token)."""
        req.chat = ChatOutputParser(spec)

    def append_tokens(self, req: Request, tokens: list[int], logprobs: list[float] | None = None,
                      top_logprobs: list[dict[int, float]] | None = None) -> tuple[list[int], str]:
        """Append new tokens to a request, checking stop conditions after each one.

        Tokens after the one that stops the request (eos / stop token / stop string / max_tokens) are dropped.
        Returns (the ids kept, the text that became safe to hand out). Marks the request finished
        (finish_reason set) but does not free its KV: the engine does that.
        """
        p = req.params
        kept: list[int] = []
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            kept.append(tok)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            if top_logprobs is not None:
                req.output_top_logprobs.append(top_logprobs[i])
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                req.finish_reason = "stop"
                break
            if p.detokenize and self._detokenize(req):
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
                break
        self.generation_tokens_total += len(kept)
        if req.first_token_time is None and kept:
            req.first_token_time = now()
        # Hand out text up to where a stop string could still begin (all of it once finished).
        safe = len(req.text) if req.finish_reason else len(req.text) - stop_prefix_len(req.text, p.stop)
        new_text = req.text[req.emitted:safe] if safe > req.emitted else ""
        req.emitted = min(max(req.emitted, safe), len(req.text))
        if req.chat is not None:
            _feed_chat(req, new_text)
        return kept, new_text

    def _detokenize(self, req: Request) -> bool:
        """Extend req.text by the last token's text; True if a stop string appeared (text is cut before it).

        Decodes a short window of recent ids and takes the difference, so multi-byte characters split
        across tokens appear once complete (a trailing U+FFFD means: wait for more bytes).
        """
        tokenizer = self._tokenizer()
        ids = req.output_ids
        keep = req.chat.spec.keep_special_ids if req.chat is not None else frozenset()
        prefix = tokenizer.decode(ids[req.prefix_offset:req.read_offset], keep_special=keep)
        full = tokenizer.decode(ids[req.prefix_offset:], keep_special=keep)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        start = len(req.text)
        req.text += full[len(prefix):]
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        stops = req.params.stop
        if not stops:
            return False
        window = max(0, start - max(len(s) for s in stops) + 1)
        hits = [i for i in (req.text.find(s, window) for s in stops) if i >= 0]
        if not hits:
            return False
        req.text = req.text[:min(hits)]
        return True

    @staticmethod
    def make_output(req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = req.finish_reason is not None
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        # Prompt logprobs (as long as the prompt) go with the first output and the final one, not every step.
        with_prompt_logprobs = req.params.prompt_logprobs is not None and (finished or len(req.output_ids) <= 1)
        chat = req.chat
        finish_reason = req.finish_reason
        if chat is not None:
            if finished and not chat.finished:  # aborted: no more text comes
                _feed_chat(req, "")
            if finish_reason == "stop" and chat.tool_calls:
                finish_reason = "tool_calls"
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=req.text[: req.emitted],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=list(req.prompt_logprobs) if with_prompt_logprobs else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if with_prompt_logprobs else None,
            ttft_s=ttft,
            prompt=req.prompt,
            num_preemptions=req.num_preemptions,
            reasoning_content=None if chat is None or not chat.has_reasoning else chat.reasoning,
            content=None if chat is None else chat.content,
            tool_calls=None if chat is None else [ToolCall(c.id, c.name, c.arguments) for c in chat.tool_calls],
        )


def _feed_chat(req: Request, text: str) -> None:
    """Hand newly safe text to the request's chat parser; the whole rest once the request finished."""
    chat = req.chat
    try:
        if text:
            chat.feed(text)
        if req.finish_reason is not None:
            chat.finish()
    except Exception:  # noqa: BLE001 - a parser bug must not fail the step for everyone
        logger.exception("request %s: the chat output parser failed; the rest of its text is plain content",
                         req.request_id)
        chat.degrade(text)


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string (text to hold back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
