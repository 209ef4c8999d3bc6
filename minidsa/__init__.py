"""minidsa: a small PyTorch-native inference engine for DeepSeek Sparse Attention models.

    from minidsa import LLM, SamplingParams
    llm = LLM()  # embedded tiny preset; LLM(model="path/to/checkpoint") for a real one
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].text)
"""

from minidsa.common.request import SamplingParams
from minidsa.common.version import __version__
from minidsa.config import EngineConfig

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # The engine pulls in the model code; import it only when asked for.
    if name == "LLM":
        from minidsa.llm import LLM

        return LLM
    if name == "Engine":
        from minidsa.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'minidsa' has no attribute {name!r}")
