"""The package layout, read from the source with `ast`: no import cycle, and every import goes down the layers.

A unit is a package (`minidsa/<name>/`) or a top-level module (`minidsa/<name>.py`), except the few modules that
serve the layers below their own package: those are units of their own (`SHARED_MODULES`, each with its reason).
`ALLOWED` lists, per unit, every unit it imports, at module level or inside a function (deferred: optional
libraries, heavy modules, the model code of a command). It is exact (an entry nobody uses fails too), so it stays
the map of the code, and it has no cycle, so it is a layering. The deferred imports that go up against it are
listed in `DEFERRED_UPWARD`, each with its reason. Imports under `if TYPE_CHECKING:` only annotate: not counted.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "minidsa")

# minidsa/common/ is the bottom layer the others share (plain structs, the step plan, the batch, the caches, the
# sampler, the presets, a rank's TensorParallel): one unit, above the kernels only.
SHARED_MODULES: dict[str, str] = {}

# unit -> every unit it imports; bottom layers first.
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "common": {"kernels"},
    "config": {"common"},
    "sched": {"common"},
    "attention": {"common", "kernels"},
    "models": {"attention", "common", "config", "kernels"},
    "speculative": {"common", "config", "models"},
    "exec": {"attention", "common", "config", "kernels", "models", "sched", "speculative"},
    "parallel": {"attention", "common", "config", "exec", "kernels"},
    "chat": {"common"},
    "engine": {"chat", "common", "config", "exec", "parallel", "sched"},
    "llm": {"chat", "common", "config", "engine"},
    "server": {"chat", "common", "config", "engine", "parallel"},
    "minidsa": {"common", "config", "engine", "llm"},  # minidsa/__init__.py: LLM, Engine on first use
    "bench": {"common", "config", "engine", "exec", "minidsa", "models", "parallel", "sched", "server"},
    "cli": {"bench", "common", "config", "engine", "llm", "models", "server"},
    "__main__": {"cli"},
}

# Deferred imports that go up against ALLOWED: (importing module, imported module) -> why. Kept empty: a function
# that needs a layer above belongs to that layer.
DEFERRED_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, str]:
    """Dotted name below minidsa (`exec.batch`; the package itself is `minidsa`) -> file."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel) or "minidsa"] = os.path.join(folder, f)
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _target(name: str) -> str | None:
    """The minidsa module an absolute dotted import names (the longest existing prefix), or None (not minidsa)."""
    if name != "minidsa" and not name.startswith("minidsa."):
        return None
    parts = name.split(".")[1:]
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) or "minidsa"


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside functions) by `module`."""
    path = MODULES[module]
    with open(path) as f:
        return _scan(f.read(), module, path.endswith("__init__.py"))


def _scan(source: str, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    top: set[str] = set()
    deferred: set[str] = set()

    def add(node, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            hits = {_target(a.name) for a in node.names}
        else:
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                up = package[:len(package) - (node.level - 1)]
                base = ".".join(["minidsa", *[p for p in up if p != "minidsa"], *([base] if base else [])])
            # `from package import name`: the submodule `name` where there is one, else the package
            hits = {_target(f"{base}.{a.name}") for a in node.names}
        (deferred if in_function else top).update(h for h in hits if h is not None and h != module)

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                add(child, in_function)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:  # the body only annotates
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function)
            else:
                visit(child, in_function)

    visit(tree, False)
    return top, deferred


IMPORTS = {m: _imports(m) for m in MODULES}


def unit(module: str) -> str:
    if module in SHARED_MODULES:
        return module
    return module.split(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _unit_edges(which: int) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(importing unit, imported unit) -> the (module, module) imports behind it; which: 0 module level, 1 deferred."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for module, imports in IMPORTS.items():
        for target in imports[which]:
            if unit(module) != unit(target):
                edges[unit(module), unit(target)].add((module, target))
    return edges


def test_the_scan_sees_the_imports_it_should():
    """The parser itself: module-level and deferred imports, `from package import name` (the package) and `from
    package import submodule` (the submodule), relative imports; annotation-only imports are not counted."""
    source = """
import torch
import minidsa.common.plan
from minidsa.kernels import num_sms, reference
from . import core
from ..common.batch import ForwardBatch
if TYPE_CHECKING:
    from minidsa.models.deepseek_v32 import ModelOutput
else:
    from minidsa import config
try:
    from minidsa.kernels import fp8
except ImportError:
    fp8 = None

class Step:
    kind = __import__("os")

    def run(self):
        from minidsa.exec.runner import ModelRunner
        return lambda: __import__("minidsa.exec.graphs")
"""
    top, deferred = _scan(source, "engine.outputs", is_package=False)
    assert top == {"common.plan", "kernels", "kernels.reference", "engine.core", "common.batch", "config",
                   "kernels.fp8"}
    assert deferred == {"exec.runner"}  # __import__ calls are not import statements: nothing here uses them
    assert IMPORTS["exec.build"][0] >= {"attention.select", "exec.compile_cache", "speculative.mtp"}


def test_no_import_cycle_between_modules():
    assert _cycles({m: imports[0] for m, imports in IMPORTS.items()}) == []


def test_no_import_cycle_between_units():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in _unit_edges(0):
        graph[a].add(b)
    assert _cycles(graph) == []


def test_every_unit_is_in_the_table_and_the_table_has_no_cycle():
    units = {unit(m) for m in MODULES}
    assert units == set(ALLOWED), f"add {sorted(units - set(ALLOWED))} to ALLOWED; drop {sorted(set(ALLOWED) - units)}"
    assert set(SHARED_MODULES) <= set(MODULES)
    assert _cycles(ALLOWED) == []


def test_imports_follow_the_table_and_the_table_is_exact():
    module_level, deferred = _unit_edges(0), _unit_edges(1)
    against = {e: sorted(how) for e, how in module_level.items() if e[1] not in ALLOWED[e[0]]}
    assert not against, f"module-level imports against the layers: {against}"
    upward = {how for e, hows in deferred.items() if e[1] not in ALLOWED[e[0]] for how in hows}
    assert upward == set(DEFERRED_UPWARD), (f"deferred imports against the layers: new "
                                            f"{sorted(upward - set(DEFERRED_UPWARD))}, gone (remove from "
                                            f"DEFERRED_UPWARD) {sorted(set(DEFERRED_UPWARD) - upward)}")
    unused = {(a, b) for a, allowed in ALLOWED.items() for b in allowed
              if (a, b) not in module_level and (a, b) not in deferred}
    assert not unused, f"ALLOWED lists dependencies nothing has (remove them): {sorted(unused)}"


@pytest.mark.parametrize("name", ["StepMode", "ForwardMode", "GRAPH_KIND_OF", "pads_draft_extend", "static_on_cpu",
                                  "req_to_token_pool", "ReqToTokenPool"])
def test_retired_names_stay_gone(name):
    """One name per idea: the step kind is StepKind (common/plan.py); test hooks live in tests/."""
    users = []
    for module, path in MODULES.items():
        with open(path) as f:
            if name in f.read():
                users.append(module)
    assert users == []
