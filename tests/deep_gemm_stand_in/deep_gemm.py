"""A CPU stand-in for DeepGEMM's `fp8_gemm_nt` and its JIT disk cache (tests/test_deepgemm_jit.py).

Put this directory on PYTHONPATH (worker processes) or import it as `deep_gemm` (this process). Like DeepGEMM,
a call needs a "kernel" chosen from its shape (several row classes and shapes share one, `kernel_name`): it is
"compiled" into `$DG_JIT_CACHE_DIR/cache/kernel.<name>` (a directory renamed into place, as DeepGEMM does) when
missing, else loaded. Every call appends one JSON line to `$STAND_IN_DG_LOG`: the process, whether it runs in
minidsa's DeepGEMM worker (`python -m minidsa.kernels.deepgemm_warmup`), the shape, and "compiled" or "loaded".
`$STAND_IN_DG_CRASH_WORKER=ROWS` makes a worker process die (exit code 3) on a call with that many rows.
The product is computed in torch (DeepGEMM's contract: e4m3 rows x 1x128 scales times the e4m3 weight x
128x128 scales).

`m_grouped_fp8_gemm_nt_contiguous` likewise: its kernel follows (rows up to 4 blocks of `ALIGNMENT`, N, K, groups),
rows of expert -1 are not multiplied, and its events' task is [rows, n, k, groups].
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import torch

__version__ = "stand-in"


def kernel_name(rows: int, n: int, k: int) -> str:
    """Few kernels for many shapes: row classes grouped by size, weights by K only."""
    return f"kernel.stand_in.{min(rows, 64) // 32}.{rows.bit_length()}.{k}"


ALIGNMENT = 16  # DeepGEMM's is 128 on SM90: smaller here, for short row ranges


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


def grouped_kernel_name(rows: int, n: int, k: int, groups: int) -> str:
    return f"kernel.stand_in_grouped.{min(rows // ALIGNMENT, 4)}.{n}.{k}.{groups}"


def _in_worker() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "minidsa.kernels.deepgemm_warmup"


def _record(**event) -> None:
    path = os.environ.get("STAND_IN_DG_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "worker": _in_worker(), **event}) + "\n")


def _kernel(name: str, task: list[int]) -> None:
    """Compile the kernel into the disk cache if missing (else load it), and log the call."""
    if _in_worker() and os.environ.get("STAND_IN_DG_CRASH_WORKER") == str(task[0]):
        os._exit(3)
    root = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
    path = os.path.join(root, "cache", name)
    event = "loaded"
    if not os.path.isdir(path):
        tmp = os.path.join(root, "tmp", uuid.uuid4().hex)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "kernel.cubin"), "w") as f:
            f.write("stand-in")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished it first
            pass
        event = "compiled"
    _record(event=event, task=task, kernel=name)


def fp8_gemm_nt(a, b, out, c=None, recipe=None, compiled_dims=""):
    (a8, a_s), (w8, w_s) = a, b
    assert a8.dtype == w8.dtype == torch.float8_e4m3fn and out.dtype == torch.bfloat16
    rows, k = a8.shape
    n = w8.shape[0]
    _kernel(kernel_name(rows, n, k), [rows, n, k])
    acts = a8.float() * a_s.repeat_interleave(128, 1)[:, :k]
    w_full = w8.float() * w_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    out.copy_(acts @ w_full.T)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
    (a8, a_s), (w8, w_s) = a, b
    rows, k = a8.shape
    groups, n, _ = w8.shape
    assert a8.dtype == w8.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16 and d.shape == (rows, n)
    assert rows % ALIGNMENT == 0 and m_indices.shape == (rows,) and m_indices.dtype == torch.int32
    assert a_s.shape == (rows, k // 128) and a_s.stride(0) == 1, "activation scales MN-major"
    assert w_s.shape == (groups, -(-n // 128), -(-k // 128)) and w_s.dtype == torch.float32
    _kernel(grouped_kernel_name(rows, n, k, groups), [rows, n, k, groups])
    acts = a8.float() * a_s.repeat_interleave(128, 1)[:, :k]
    for e in m_indices[m_indices >= 0].unique().tolist():
        r = m_indices == e
        w_full = w8[e].float() * w_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        d[r] = (acts[r] @ w_full.T).to(d.dtype)
