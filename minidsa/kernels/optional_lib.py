"""Optional kernel libraries (DeepGEMM, FlashMLA): the start-up check they share, and how their calls fail.

`load_library` is the check made at start-up (attention/select.py): a CUDA device of a supported SM
generation (`cuda_capability`), the module importable (a broken build may fail at load, not only be
missing), and every function the engine calls present.

Inside the custom ops a library is reached by name through Python's import cache (`import_library`), never
through a handle: custom ops take tensors and plain values only. A wrapper around a library call raises
`LibraryCallFailed` when the library raised; the op then runs the Triton kernel for that call and logs the
failure once (`kernels.log_once`). Nothing here remembers a failure: each engine's calls are its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch


class LibraryCallFailed(RuntimeError):
    """A call into an optional library raised (a build whose contract differs, a missing module): the caller
    serves the call another way."""


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


def missing_api(module: object, required_api: Iterable[str]) -> list[str]:
    """The functions of `required_api` that `module` lacks (or has as something not callable)."""
    return [fn for fn in required_api if not callable(getattr(module, fn, None))]


def load_library(name: str, required_api: Iterable[str], device: torch.device, sm_majors: tuple[int, ...],
                 needs: str) -> tuple[ModuleType | None, LibraryStatus]:
    """(the module, its status) when `name` can serve on `device`, else (None, why not). `needs` completes the
    sentence "GPU is SMxy, ..." (e.g. "DeepGEMM needs SM90 or SM100")."""
    cap = cuda_capability(device)
    if cap is None:
        return None, LibraryStatus(False, f"{device} is not a CUDA device")
    if cap[0] not in sm_majors:
        return None, LibraryStatus(False, f"GPU is SM{cap[0]}{cap[1]}, {needs}")
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken build failing at load (undefined symbol, ...)
        return None, LibraryStatus(False, f"import {name} failed: {type(e).__name__}: {e}")
    missing = missing_api(mod, required_api)
    if missing:
        return None, LibraryStatus(False, f"{name} lacks {', '.join(missing)}")
    version = getattr(mod, "__version__", "unknown version")
    return mod, LibraryStatus(True, f"{name} {version} on SM{cap[0]}{cap[1]}", cap[0])


def import_library(name: str) -> ModuleType:
    """The library module, from Python's module cache once imported (`sys.modules`, keyed by the name); raises
    `LibraryCallFailed` when it does not import. What the custom ops use: they cannot be handed the module."""
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise LibraryCallFailed(f"import {name} failed: {type(e).__name__}: {e}") from e


def failed(what: str, err: Exception) -> LibraryCallFailed:
    """The exception a wrapper raises for a library call `what` that raised `err`."""
    return LibraryCallFailed(f"{what} failed: {type(err).__name__}: {err}")
