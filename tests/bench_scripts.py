"""The benchmark scripts of benchmarks/scripts/ imported as modules, for the CPU tests of their tables and
arithmetic (their folder on sys.path: the scripts import each other by name)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "benchmarks", "scripts")


def script_path(name: str) -> str:
    return os.path.join(SCRIPTS, f"{name}.py")


def load(name: str) -> ModuleType:
    """benchmarks/scripts/NAME.py, executed afresh as module NAME."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
