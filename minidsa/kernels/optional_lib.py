"""Loading an optional kernel library (DeepGEMM, FlashMLA) at start-up: one check, one reason.

Each library module keeps its own cache of results and its own `_device_capability` name (bound to
`cuda_capability`; tests replace it per library); this is the check they share: a CUDA device of a supported SM generation, the module importable (a broken build may
fail at load, not only be missing), and every function the engine calls present.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

import torch


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for anything else."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@dataclass(frozen=True)
class LibraryStatus:
    available: bool
    reason: str  # why not, or which build on which GPU
    sm_major: int = 0


def load_library(name: str, required_api: Iterable[str], device: torch.device,
                 capability: Callable[[torch.device], tuple[int, int] | None], sm_majors: tuple[int, ...],
                 needs: str) -> tuple[ModuleType | None, LibraryStatus]:
    """(the module, its status) when `name` can serve on `device`, else (None, why not). `needs` completes the
    sentence "GPU is SMxy, ..." (e.g. "DeepGEMM's indexer needs SM90 or SM100")."""
    cap = capability(device)
    if cap is None:
        return None, LibraryStatus(False, f"{device} is not a CUDA device")
    if cap[0] not in sm_majors:
        return None, LibraryStatus(False, f"GPU is SM{cap[0]}{cap[1]}, {needs}")
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken build failing at load (undefined symbol, ...)
        return None, LibraryStatus(False, f"import {name} failed: {type(e).__name__}: {e}")
    missing = [fn for fn in required_api if not callable(getattr(mod, fn, None))]
    if missing:
        return None, LibraryStatus(False, f"{name} lacks {', '.join(missing)}")
    version = getattr(mod, "__version__", "unknown version")
    return mod, LibraryStatus(True, f"{name} {version} on SM{cap[0]}{cap[1]}", cap[0])
