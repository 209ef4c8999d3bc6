"""Kernels: pure-torch references (reference.py) and the Triton / DeepGEMM versions beside them."""

from __future__ import annotations

import logging

import torch

_NUM_SMS: dict[torch.device, int] = {}
# log_once's cache, keyed by its input (the message): what it has already said in this process.
_LOGGED_MESSAGES: set[str] = set()


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; 8 off CUDA (the Triton interpreter's stand-in)."""
    device = torch.device(device)
    # A plain dict, not functools.lru_cache: torch.compile traces through callers without warnings.
    if device not in _NUM_SMS:
        _NUM_SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                            if device.type == "cuda" else 8)
    return _NUM_SMS[device]


def few_rows(num_rows: int, device: torch.device | str) -> bool:
    """At most SMs / 8 rows: one program per row would leave most of the GPU idle (the top-k then splits
    each row over several programs; measured to pay at batch 1 and 8 on H100)."""
    return num_rows <= num_sms(device) // 8


def log_once(logger: logging.Logger, level: int, msg: str) -> None:
    """Log `msg` the first time it is said in this process: a kernel fallback taken on every call of a shape is
    worth one line. Called inside the opaque custom ops; while torch.compile traces, nothing is logged (a graph
    would guard on the set of messages and compile again once it grows; the eager calls log it)."""
    if torch.compiler.is_compiling() or msg in _LOGGED_MESSAGES:
        return
    _LOGGED_MESSAGES.add(msg)
    logger.log(level, msg)
