"""Programmatic dependent launch (kernels/launch.py): the contract that keeps it race-free, checked for every Triton
kernel minidsa launches, and the instruction it compiles to."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from triton_interp import compile_for_h100

from minidsa.kernels.launch import pdl_launch

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "minidsa" / "kernels"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in n.decorator_list)}


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Calls of the form kernel[grid](...)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name)]


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.name, ast.parse(p.read_text())) for p in sorted(KERNEL_DIR.glob("*.py"))]


def test_every_launched_kernel_waits_for_its_producers_first():
    """A kernel launched with PDL may start while the kernel before it still runs: unless its first statement is
    the wait, it could read inputs not yet written (or overwrite ones still being read)."""
    launched = 0
    for name, tree in _modules():
        kernels = _jit_functions(tree)
        for call in _launches(tree):
            kernel = kernels.get(call.func.value.id)
            if kernel is None:
                continue
            launched += 1
            where = f"{name}: {kernel.name}"
            params = [a.arg for a in kernel.args.args]
            assert "PDL" in params, f"{where} has no PDL parameter"
            body = kernel.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            assert ast.unparse(body[0]) == "wait_for_producers(PDL)", f"{where} does not begin with the wait"
            spread = [k.value for k in call.keywords if k.arg is None]
            assert any(ast.unparse(v).startswith("pdl_launch(") for v in spread), \
                f"{where} is launched without **pdl_launch(device) (line {call.lineno})"
            assert not any(k.arg in ("PDL", "launch_pdl") for k in call.keywords), \
                f"{where} sets PDL or launch_pdl by hand (line {call.lineno}): pdl_launch sets both together"
    assert launched >= 30  # the scan found the kernels (34 launch sites when written)


def test_pdl_is_off_where_the_interpreter_runs():
    assert pdl_launch("cpu") == {"PDL": False}
    assert pdl_launch(torch.device("cpu")) is pdl_launch("cpu")  # resolved once per device


_COMPILE_FOR_H100 = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minidsa.kernels import norm_quant
sig = {"x_ptr": "*bf16", "rows_ptr": "*i32", "w_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32", "stride_x": "i32",
       "stride_out": "i32", "eps": "fp32", "BLOCK": "constexpr", "GATHER": "constexpr", "PDL": "constexpr"}
for pdl in (True, False):
    src = ASTSource(norm_quant._rmsnorm_rows_kernel, sig, constexprs={"BLOCK": 1024, "GATHER": True, "PDL": pdl})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\\.wait", body)]
    if pdl:
        # one wait, before the first load of anything another kernel wrote
        assert len(waits) == 1, body[:3000]
        assert waits[0] < body.index("ld.global"), body[:3000]
    else:
        assert not waits, body[:3000]
    assert "griddepcontrol.launch_dependents" not in body
print("compiled")
"""


def test_the_wait_compiles_to_griddepcontrol_before_the_first_load():
    """With PDL the kernel's PTX waits (griddepcontrol.wait) before its first global load and never signals early;
    without it, no wait is compiled in. Compiled for sm_90 here, no GPU needed."""
    compile_for_h100(_COMPILE_FOR_H100, "_rmsnorm_rows_kernel")
