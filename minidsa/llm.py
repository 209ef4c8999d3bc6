"""The offline Python API: `LLM(model=path_or_preset, **engine_args).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from minidsa.chat.formats import ChatFormat, ChatOptions
from minidsa.common.request import InvalidRequest, RequestOutput, SamplingParams
from minidsa.common.tokenizer import Tokenizer
from minidsa.config import make_engine_config
from minidsa.engine.chat import add_chat_request, chat_format, prepare_chat
from minidsa.engine.core import Engine


class LLM:
    """Offline Python API: `LLM(model=path_or_preset, **engine_args).generate(prompts, SamplingParams(...))`.

    Synchronous (no event loop), so it works as is in a Jupyter notebook.
    """

    def __init__(self, model: str | None = None, progress: bool = True, **engine_args: Any):
        self.engine = Engine(make_engine_config(model, **engine_args), progress=progress)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def __repr__(self) -> str:
        return f"LLM({self.engine!r})"

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the LLM is dropped, or at exit)."""
        self.engine.close()

    @property
    def is_driver(self) -> bool:
        """False on a tensor-parallel rank > 0 of a torchrun launch: that process calls `follow()`, rank 0 the
        rest."""
        return self.engine.is_driver

    def follow(self) -> None:
        """A torchrun rank > 0: run rank 0's steps until rank 0 closes its LLM (see the README)."""
        self.engine.follow()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order."""
        batch = _as_prompt_list(prompts)
        if isinstance(params, list):
            if len(params) != len(batch):
                raise InvalidRequest(f"got {len(params)} SamplingParams for {len(batch)} prompts")
            plist = params
        else:
            plist = [params] * len(batch)
        return self._run([lambda prompt=prompt, p=p: self.engine.add_request(prompt, p)
                          for prompt, p in zip(batch, plist)], progress)

    def _run(self, adds: list[Any], progress: bool) -> list[RequestOutput]:
        """Add requests (each callable returns its id; all or none are added) and step until all finished."""
        ids: list[str] = []
        try:
            for add in adds:
                ids.append(add())
        except Exception:
            for rid in ids:
                self.engine.abort(rid, report=False)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req")
        wanted = set(ids)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # interrupted (KeyboardInterrupt in a notebook): free what is left
                if rid not in results:
                    self.engine.abort(rid, report=False)
        return [results[rid] for rid in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield an output each step the request produces tokens; the last one has finished=True.

        Closing the generator early aborts the request.
        """
        rid = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid, report=False)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, *, tool_choice: Any = "auto",
             parallel_tool_calls: bool = True, reasoning_effort: str | None = None,
             progress: bool = False) -> RequestOutput | list[RequestOutput]:
        """Answer a conversation (OpenAI messages) with the model's chat format; a list of conversations gives a
        list of outputs. The output's `content`, `reasoning_content` and `tool_calls` are the answer parsed
        (finish_reason "tool_calls" when it called tools); `text` is the raw generated text.

        tools / tool_choice / parallel_tool_calls: OpenAI's. chat_template_kwargs: e.g. {"thinking": True}
        (DeepSeek-V3.2: thinking mode; GLM-5 templates read "enable_thinking", default on).
        `sampling_params.response_format` constrains the answer (after the thinking, if any)."""
        options = ChatOptions(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                              chat_template_kwargs=dict(chat_template_kwargs or {}), reasoning_effort=reasoning_effort)
        single = not messages or isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        outs = self._run([lambda m=m: add_chat_request(self.engine, m, sampling_params, options)
                          for m in conversations], progress)
        return outs[0] if single else outs

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None, **options: Any) -> list[int]:
        """The token ids `chat` would prompt the model with (what the server's /tokenize returns)."""
        opts = ChatOptions(tools=tools, chat_template_kwargs=dict(chat_template_kwargs or {}), **options)
        return prepare_chat(self.engine, messages, None, opts)[0].token_ids

    @property
    def chat_format(self) -> ChatFormat:
        """How this model's conversations become prompts (decided once per model, and logged)."""
        return chat_format(self.engine)


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise InvalidRequest(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
