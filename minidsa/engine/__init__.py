"""The control plane. Which module owns what:

- `core.Engine`: requests in (add / abort), one step at a time: asks the scheduler what runs, turns it
  into a `StepPlan` for the worker, takes the `StepResult` back; overlapped scheduling lives here. It builds
  the host-side KV page and row allocators (sched/pages.py) from the capacity the worker reports.
- `outputs.OutputProcessor`: tokens into requests (stop conditions), detokenising, chat answers parsed,
  `RequestOutput`.
- `chat`: chat requests: a conversation rendered with the model's chat format (minidsa.chat) and added with
  its output parser (LLM.chat and the server both use it).

The synchronous Python API over an Engine is `minidsa.llm.LLM`. Names below are imported lazily, so that
`import minidsa.engine` does not pull in the model code. Requests, sampling parameters and the tokenizer are in
minidsa/common/.
"""

__all__ = ["Engine", "EngineMetrics", "OutputProcessor"]


def __getattr__(name: str):
    if name == "OutputProcessor":
        from minidsa.engine.outputs import OutputProcessor

        return OutputProcessor
    if name in __all__:
        from minidsa.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'minidsa.engine' has no attribute {name!r}")
