"""No module-level mutable state in minidsa but caches keyed by their inputs (issue 30), read from the source.

- No `global` statement anywhere in minidsa/: nothing rebinds a module name at run time (the optional libraries'
  `_module` / `_disabled` names did, and every engine in the process shared them).
- kernels/ and attention/ bind module-level mutable containers only for the caches listed here, each keyed by
  what it was computed from (the kernel choice and the libraries' handles live in each engine).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "minidsa"
# (module, name): what the cache is keyed by
CACHES = {
    ("kernels/__init__.py", "_NUM_SMS"): "the device",
    ("kernels/__init__.py", "_LOGGED_MESSAGES"): "the message (log_once)",
    ("kernels/launch.py", "_LAUNCH"): "the device (programmatic dependent launch on or off)",
    ("kernels/flashmla.py", "_SCHED_META"): "the library module and the decode shape",
    ("kernels/fp8_gemm.py", "_arrivals"): "the device (split-K's per-tile arrival counts, all 0 between calls)",
    # Not a cache, and not process-wide: a context variable holding the registry of the JIT pool the current
    # start-up's activation profile runs beside (`GemmWarmUp.beside_pool` sets it for that profile and resets it
    # after), which the custom ops read (`deepgemm_warmup.building()`); None elsewhere, serving included. The
    # registry itself belongs to the pool (`JitPool.building`), so engines never see each other's.
    ("kernels/deepgemm_warmup.py", "_BESIDE_POOL"): "the context (thread) running one start-up's activation profile",
}
MUTABLE_CALLS = {"dict", "set", "list", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray", "ContextVar"}


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def test_no_global_statements():
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}: global {', '.join(node.names)}"
             for path in _modules() for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Global)]
    assert not found, found


def test_kernel_modules_keep_no_mutable_state_but_their_caches():
    bound = set()
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(("kernels/", "attention/")):
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            if _mutable(getattr(node, "value", None)):
                bound |= {(rel, t.id) for t in targets if isinstance(t, ast.Name) and not t.id.startswith("__")}
    assert bound == set(CACHES), f"module-level mutable state that is not a listed cache: {bound - set(CACHES)}; " \
                                 f"listed caches gone: {set(CACHES) - bound}"


def test_the_check_sees_what_it_forbids():
    """The rules above catch the patterns this redesign removed."""
    old = ast.parse("_status: dict[str, int] = {}\n_disabled = None\ndef fail():\n    global _disabled\n")
    assert _mutable(old.body[0].value) and not _mutable(old.body[1].value)
    assert any(isinstance(n, ast.Global) for n in ast.walk(old))
