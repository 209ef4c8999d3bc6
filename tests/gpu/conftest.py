"""GPU tests build full-size engines one after another: each test starts with the memory of the ones before it
given back to the driver, since an engine sizes its KV cache from the free memory the driver reports."""

from __future__ import annotations

import gc
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    # A failed test's traceback (kept by pytest for post-mortem debugging until the next test runs) holds its
    # frames, and with them any engine a frame still referenced.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
