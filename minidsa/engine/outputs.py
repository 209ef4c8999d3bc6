"""Output processing: tokens in, text and `RequestOutput`s out.

Every generated token, from a plain step or several accepted at once by the speculator, enters a request
through `OutputProcessor.append_tokens`, which checks stop conditions per token (eos, stop token ids, stop
strings on the detokenised text, max_tokens, max_model_len) and drops tokens after a stop. Text is
detokenised incrementally and held back while it could still be the start of a stop string.
"""

from __future__ import annotations

from typing import Callable

from minidsa.engine.request import Request, RequestOutput, now
from minidsa.engine.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Callable[[], Tokenizer], eos_token_ids: frozenset[int], max_model_len: int):
        self._tokenizer = tokenizer  # loaded on first use: token-id workloads run without one
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generation_tokens_total = 0

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
        return kept, new_text

    def _detokenize(self, req: Request) -> bool:
        """Extend req.text by the last token's text; True if a stop string appeared (text is cut before it).

        Decodes a short window of recent ids and takes the difference, so multi-byte characters split
        across tokens appear once complete (a trailing U+FFFD means: wait for more bytes).
        """
        tokenizer = self._tokenizer()
        ids = req.output_ids
        prefix = tokenizer.decode(ids[req.prefix_offset:req.read_offset])
        full = tokenizer.decode(ids[req.prefix_offset:])
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
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=req.text[: req.emitted],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.finish_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=list(req.prompt_logprobs) if with_prompt_logprobs else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if with_prompt_logprobs else None,
            ttft_s=ttft,
            prompt=req.prompt,
            num_preemptions=req.num_preemptions,
        )


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string (text to hold back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
