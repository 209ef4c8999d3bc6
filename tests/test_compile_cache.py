"""The persistent compile cache (minidsa/exec/compile_cache.py): where it lives, what its key covers, and that its
artifacts survive a round trip through another process; bad files are ignored with a warning."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap

import torch

from minidsa.exec.compile_cache import (GRAPH_ARGS, MAGIC, TOOL_DIRS, CompileCache, cache_key,
                                   key_inputs)
from minidsa.config import EngineConfig, ModelConfig
from minidsa.common.presets import preset_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def _key(config: EngineConfig, model: ModelConfig | None = None) -> str:
    return cache_key(key_inputs(config, model or ModelConfig.from_dict(preset_config("tiny")), CPU))


def test_cache_root_flag_then_environment_then_user_cache_dir(monkeypatch, tmp_path):
    from minidsa.config import compile_cache_root as cache_root

    monkeypatch.delenv("MINIDSA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "minidsa")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == str(tmp_path / "home" / ".cache" / "minidsa")
    monkeypatch.setenv("MINIDSA_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root() == str(tmp_path / "env")
    assert cache_root(str(tmp_path / "flag")) == str(tmp_path / "flag")  # the engine argument wins
    assert cache_root("none") is None and cache_root("OFF") is None
    monkeypatch.setenv("MINIDSA_CACHE_DIR", "none")
    assert cache_root() is None


def test_key_changes_with_what_shapes_the_code_and_nothing_else(monkeypatch):
    base = EngineConfig(dtype="bfloat16", page_size=64)
    key = _key(base)
    assert _key(EngineConfig(dtype="bfloat16", page_size=64)) == key  # deterministic
    for name in GRAPH_ARGS:
        value = getattr(base, name)
        if isinstance(value, bool):
            other = not value
        elif value is None:
            other = True
        elif isinstance(value, int):
            other = value + 1
        else:
            other = {"bfloat16": "float16", "auto": "fp8"}.get(value, value + "x")
        assert _key(dataclasses.replace(base, **{name: other})) != key, name
    for name, other in (("seed", 7), ("max_queued_requests", 9), ("overlap_schedule", False),
                        ("enable_prefix_caching", False), ("kv_cache_mem_fraction", 0.5), ("compile_cache_dir", "/x")):
        assert _key(dataclasses.replace(base, **{name: other})) == key, name
    raw = preset_config("tiny")
    raw["num_hidden_layers"] += 1
    assert _key(base, ModelConfig.from_dict(raw)) != key  # the model's config
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert _key(base) != key  # and the versions


def test_tool_directories_point_into_the_cache_unless_the_environment_names_one(monkeypatch, tmp_path):
    import torch._dynamo  # noqa: F401 - sets TORCHINDUCTOR_CACHE_DIR to inductor's default: not a choice

    for env in TOOL_DIRS:
        monkeypatch.setenv(env, "")  # restored after the test, whatever activate_dirs sets
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    used = CompileCache.activate_dirs(str(tmp_path / "cache"))
    assert used["TRITON_CACHE_DIR"] == str(tmp_path / "mine")  # an explicit choice stays
    inductor = str(tmp_path / "cache" / "inductor")
    assert used["TORCHINDUCTOR_CACHE_DIR"] == os.environ["TORCHINDUCTOR_CACHE_DIR"] == inductor
    assert used["DG_JIT_CACHE_DIR"] == str(tmp_path / "cache" / "deep_gemm")
    assert all(os.path.isdir(d) for d in used.values())


def test_missing_foreign_and_corrupt_files_are_ignored_with_a_warning(tmp_path, caplog):
    cache = CompileCache(str(tmp_path), key_inputs(EngineConfig(), ModelConfig.from_dict(preset_config("tiny")), CPU))
    assert cache.load() == "no artifacts for this configuration yet"
    os.makedirs(os.path.dirname(cache.artifacts))
    cases = {
        b"not a cache file at all": "not a minidsa compile cache file",
        MAGIC + b'{"key": "someone-else"}\n' + b"payload": "written for another configuration",
        MAGIC + b'{"key": "' + cache.key.encode() + b'"}\n' + b"\x00garbage bytes": "could not be loaded",
    }
    for content, warning in cases.items():
        with open(cache.artifacts, "wb") as f:
            f.write(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minidsa.exec.compile_cache"):
            assert cache.load().startswith("ignored")
        assert any(warning in r.getMessage() for r in caplog.records), (warning, caplog.text)


ROUND_TRIP = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters  # before activate_dirs, as in the engine (it sets inductor's default)
    from minidsa.exec.compile_cache import CompileCache
    root, phase = sys.argv[1], sys.argv[2]
    CompileCache.activate_dirs(root)
    cache = CompileCache(root, {"test": 1})
    loaded = cache.load()

    @torch.compile(backend="inductor")
    def f(x):
        return (x.sin() * 2 + 1).sum(-1)

    f(torch.randn(8, 16))
    print(json.dumps({"loaded": loaded, "saved": cache.save(), "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def _run(root: str) -> dict:
    import json

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for name in TOOL_DIRS:
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", ROUND_TRIP, root, "x"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_artifacts_round_trip_through_another_process(tmp_path):
    """inductor compiles on CPU here: the first process compiles and saves; the second, with inductor's own
    directory gone (a fresh machine that got only the artifact file), loads them and hits inductor's cache."""
    import shutil

    root = str(tmp_path / "cache")
    first = _run(root)
    assert first["misses"] >= 1 and first["hits"] == 0 and first["saved"].startswith("saved")
    assert first["loaded"] == "no artifacts for this configuration yet"
    shutil.rmtree(os.path.join(root, "inductor"))
    shutil.rmtree(os.path.join(root, "triton"), ignore_errors=True)
    second = _run(root)
    assert second["loaded"].startswith("loaded") and second["hits"] >= 1 and second["misses"] == 0, second
    assert second["saved"] == "up to date"  # nothing new: the file is left as it is


def test_compile_stats_count_the_graphs_dynamo_compiled():
    """The start-up lines' "torch.compile N s for G graphs" come from CompileStats: a compilation in between shows
    (torch 2.11+ no longer counts frames["ok"], which made every phase read "nothing compiled")."""
    import torch

    from minidsa.exec.compile_cache import CompileStats

    before = CompileStats.now()
    assert CompileStats.now().since(before).describe() == "nothing compiled"
    fn = torch.compile(lambda x: x * 2 + 1, backend="aot_eager", fullgraph=True)
    fn(torch.ones(3))
    done = CompileStats.now().since(before)
    assert done.frames == 1 and done.describe().startswith("torch.compile")
