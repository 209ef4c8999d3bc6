"""Import minidsa's Triton kernels under Triton's interpreter (CPU), for the kernel tests.

The interpreter must be switched on before triton is first imported; in a process
that already imported compiled triton, the tests re-run themselves in a child.
"""

from __future__ import annotations

import os
import sys


def import_kernels_interpreted() -> bool:
    """Import minidsa's Triton kernels as interpreted functions; False if this process cannot any more."""
    if "triton" in sys.modules:
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        if isinstance(tl.zeros, JITFunction):
            return False
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from minidsa.kernels import custom_ops, dispatch, indexer  # noqa: F401
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = prev
    from triton.runtime.jit import JITFunction

    return not isinstance(indexer._paged_logits_kernel, JITFunction)
