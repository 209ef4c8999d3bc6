"""Triton where it is installed. Where it is not (no wheel for macOS, Windows), the kernel modules still import:
`triton` and `tl` below stand in for it, `@triton.jit` makes a kernel that refuses to launch, and
`attention/select.py` (`triton_usable`: "import triton failed") serves every op with the torch references.

The kernel modules import `triton` and `tl` from here instead of importing Triton themselves.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    MISSING: str | None = None
except Exception as e:  # noqa: BLE001 - not installed, or a broken install: the references serve either way
    MISSING = f"import triton failed: {type(e).__name__}: {e}"

    class JITFunction:  # type: ignore[no-redef]
        """Nothing is a Triton kernel without Triton."""

    class _Unlaunchable:
        """A `@triton.jit` function without Triton: defining it works, launching or calling it raises."""

        def __init__(self, fn: Any):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def _refuse(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"Triton kernel {self.__name__} cannot run: {MISSING}")

        __call__ = _refuse

        def __getitem__(self, grid: Any) -> Any:
            return self._refuse

    class _Absent:
        """`triton` / `triton.language` without Triton: `jit` decorates; any other name is a placeholder that
        raises when used (kernel bodies, which never run, and launch-size helpers)."""

        def __init__(self, name: str):
            self._name = name

        def jit(self, fn: Any = None, **options: Any) -> Any:
            return _Unlaunchable(fn) if fn is not None else _Unlaunchable

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Absent(f"{self._name}.{name}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self._name} cannot run: {MISSING}")

    triton = _Absent("triton")  # type: ignore[assignment]
    tl = _Absent("triton.language")  # type: ignore[assignment]

__all__ = ["JITFunction", "MISSING", "tl", "triton"]
