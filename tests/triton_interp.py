"""Import minidsa's Triton kernels under Triton's interpreter (CPU), for the kernel tests.

The interpreter must be switched on before triton is first imported; in a process
that already imported compiled triton, the tests re-run themselves in a child.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch


def run_file_interpreted(path: str, timeout: float = 600) -> None:
    """Run a test file's tests again in a child process with TRITON_INTERPRET=1; fail with its output if they do."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def compile_for_h100(script: str, kernel: str) -> str:
    """Run `script` (Python that compiles kernels for sm_90 with `triton.compile` and prints "compiled") in a child
    process without the interpreter, which runs Python, not Triton's compiler: what only the compiler refuses fails
    here, no GPU needed. Skips where this triton has no NVIDIA backend or no usable ptxas; returns its stdout."""
    import pytest

    backends = pytest.importorskip("triton.backends")
    if "nvidia" not in getattr(backends, "backends", {}):
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode and "ptxas" in r.stderr and kernel not in r.stderr:
        pytest.skip(f"no usable ptxas here: {r.stderr[-300:]}")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


# Python for `compile_for_h100` scripts: `ptxas_spills(kernel)` -> (the most spill-store bytes ptxas -v reports for any
# function of a compiled kernel's PTX at sm_90a, its report); `compile_without_spills(src, num_warps, **options)`
# compiles an ASTSource for sm_90, asserts a cubin and 0 spill bytes, and returns the kernel.
SPILL_CHECK = """
import re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
target = GPUTarget("cuda", 90, 32)
ptxas = get_ptxas(90)
ptxas = getattr(ptxas, "path", ptxas)


def ptxas_spills(kernel):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True,
                              text=True).stderr
    spills = [int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)]
    assert spills, info
    return max(spills), info


def compile_without_spills(src, num_warps, **options):
    kernel = triton.compile(src, target=target, options={"num_warps": num_warps, **options})
    assert kernel.asm["cubin"]
    spills, info = ptxas_spills(kernel)
    assert spills == 0, info
    return kernel
"""


_real_empty, _real_empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(77 if t.dtype == torch.uint8 else -123456)


def poison_new_tensors(monkeypatch) -> None:
    """Every torch.empty / empty_like made from now on (for the test `monkeypatch` belongs to) comes back full of
    garbage, so an output element a kernel forgets to write shows. Also keeps TRITON_INTERPRET=1 meanwhile: triton
    reads it again in imports it makes lazily."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # `with torch.device(...)` intercepts the constructors it lists once per process (a cached set of functions):
    # listed first under this patch, it would hold the lambdas, and from then on every `with torch.device("meta")`
    # would let the real torch.empty allocate on the CPU (a meta-device build of a 671B preset asked for 30 GB).
    import torch.utils._device

    torch.utils._device._device_constructors()
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real_empty_like(*a, **k)))


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
        from minidsa.kernels import custom_ops, indexer  # noqa: F401
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = prev
    from triton.runtime.jit import JITFunction

    return not isinstance(indexer._paged_logits_kernel, JITFunction)


@contextlib.contextmanager
def torch_rounded_casts():
    """Within: the interpreter's narrowing float casts (to fp16, bf16, float8e4nv) round as torch does, and
    its tl.dot takes bf16 operands (it multiplies their bit patterns otherwise).

    Triton 3.9's interpreter mis-rounds them where rounding carries into the exponent (31.7 -> e4m3 16,
    not 32; about 2% of random values in e4m3), which the GPU's cvt.rn does not; kernels that quantise
    activations in-kernel are compared against torch's quantisation under this patch.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float8e4nv: torch.float8_e4m3fn}
    bits = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        src_t, dst_t = torch_of.get(input_dtype), torch_of.get(output_dtype)
        if src_t is None or dst_t is None or dst_t.itemsize >= src_t.itemsize or rounding_mode not in (
                None, interpreter._ir.ROUNDING_MODE.RTNE):
            return original(data, input_dtype, output_dtype, rounding_mode)
        src = torch.from_numpy(np.ascontiguousarray(data)).view(src_t)
        return src.to(dst_t).view(bits[dst_t.itemsize]).numpy().reshape(data.shape)

    original_dot = interpreter.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 operands are held as uint16 bit patterns, which numpy would multiply as integers
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            a, b = (interpreter.TensorHandle(torch.from_numpy(np.ascontiguousarray(t.data)).view(torch.bfloat16)
                                             .float().numpy(), tl.float32) for t in (a, b))
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter._convert_float = convert
    interpreter.InterpreterBuilder.create_dot = dot
    try:
        yield
    finally:
        interpreter._convert_float = original
        interpreter.InterpreterBuilder.create_dot = original_dot
