"""Shared test fixtures.

- An autouse KV-leak check: after every test, every Engine created during
  the test (and every shared fixture engine) must hold exactly the KV pages
  and req_to_token rows of its running requests, and none once it has no
  unfinished request. A leak fails the test that caused it.
- `tiny_llm`: one LLM on the embedded tiny preset (fp32, CPU) for the
  whole session, so tests do not pay for building a model each.
- torch uses one intra-op thread (MINIDSA_TEST_THREADS overrides).
- `fresh_log_once`: the kernels' once-per-process fallback messages are logged again in this test.
- The `smoke` marker: a subset across the layers that runs in under a minute on 2 cores (tests/README.md);
  CI runs it first (`pytest -m smoke`), then the rest (`-m "not smoke"`).
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which must be on before triton is
# first imported (torch.compile / dynamo import it too): switch it on for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs `pytest -n 2` on 2 cores: one intra-op thread per worker. More threads than free cores make
# OpenMP spin-wait against each other (10x slower small ops on a busy machine).
torch.set_num_threads(int(os.environ.get("MINIDSA_TEST_THREADS", "1")))

pytest_plugins = ["pytester"]  # test_engine.py runs a leaking test file to see the leak check fail it


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: a fast test of the smoke subset (tests/README.md); CI runs it first")


_SHARED_ENGINES: list = []  # fixture engines that outlive a test: checked after every test too


@pytest.fixture(autouse=True)
def _check_kv_leaks():
    try:
        from engine_tracking import track_engines
    except ImportError:  # the engine is not importable: nothing to check
        yield
        return
    with track_engines() as created:  # engines local to the test are checked too (their bookkeeping is kept)
        yield
    for engine in created + [e for e in _SHARED_ENGINES if not any(c.tracks(e) for c in created)]:
        engine.check_no_leaks()


@pytest.fixture
def fresh_log_once(monkeypatch):
    """The kernels' log-once memory emptied for this test, so a fallback an earlier test logged is logged again."""
    import minidsa.kernels

    monkeypatch.setattr(minidsa.kernels, "_LOGGED_MESSAGES", set())


@pytest.fixture(scope="session")
def tiny_llm():
    """The embedded tiny preset, fp32 on CPU, ample KV memory."""
    from minidsa import LLM

    llm = LLM(device="cpu", dtype="float32", progress=False)
    _SHARED_ENGINES.append(llm.engine)
    yield llm
    _SHARED_ENGINES.remove(llm.engine)


@pytest.fixture(scope="session")
def long_prompts(tiny_llm):
    """Token-id prompts of different lengths, all longer than the preset's index_topk (sparse attention)."""
    import random

    topk = tiny_llm.engine.model_config.index_topk
    rng = random.Random(1234)
    lengths = [topk + 9, 2 * topk + 5, 3 * topk - 3, 4 * topk + 1]
    return [[rng.randint(1000, 100000) for _ in range(n)] for n in lengths]
