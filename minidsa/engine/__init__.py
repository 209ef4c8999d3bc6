"""The control plane. Which module owns what:

- `core.Engine`: requests in (add / abort), one step at a time: asks the scheduler what runs, turns it
  into a `StepPlan` for the worker, takes the `StepResult` back; overlapped scheduling lives here.
- `outputs.OutputProcessor`: tokens into requests (stop conditions), detokenising, chat answers parsed,
  `RequestOutput`.
- `chat`: chat requests: a conversation rendered with the model's chat format (minidsa.chat) and added with
  its output parser (LLM.chat and the server both use it).
- `llm.LLM`: the synchronous Python API over an Engine.
"""

from minidsa.engine.core import (Engine, EngineMetrics, decode_reserve_tokens, make_engine_config,
                                 resolve_engine_config, resolve_model)
from minidsa.engine.llm import LLM
from minidsa.engine.outputs import OutputProcessor

__all__ = ["LLM", "Engine", "EngineMetrics", "OutputProcessor", "decode_reserve_tokens", "make_engine_config",
           "resolve_engine_config", "resolve_model"]
