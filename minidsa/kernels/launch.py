"""How minidsa's Triton kernels are launched: with programmatic dependent launch (PDL) on Hopper and later.

A decode step is a chain of ~170 short kernels; at batch 1 most of them stream a few MB of weights in a few
microseconds, and the time between one kernel's last block and the next kernel's first block is a fixed cost
paid ~170 times. Launched with PDL, a kernel's blocks are placed on SMs as its predecessor's blocks drain, instead
of after the whole predecessor has finished and its writes are flushed, and they wait on the device
(`griddepcontrol.wait`) for that completion. Measured on an H100 in a CUDA graph (benchmarks/scripts/pdl_probe.py,
benchmarks/decode/pdl_h100_cb31623_1e70be9.json): 0.3 us saved per tiny kernel, 0.7 us per 10 MB weight-streaming
kernel.

The contract, which tests/test_launch.py checks for every kernel: a kernel with a `PDL` parameter calls
`wait_for_producers(PDL)` as its first statement, before it reads or writes anything another kernel touches, and
every launch passes `**pdl_launch(device)`, which sets that parameter and the launch attribute together. A kernel
that skipped the wait would race its predecessor; one that waits but is launched without PDL only loses the
overlap. The wait is also what makes the chain transitive: a kernel waits for its predecessor, which finished only
after its own wait, so any earlier producer has finished too.

No kernel signals early (`gdc_launch_dependents`): the next kernel's blocks would then hold SM slots while spinning,
which measured slower than letting them start as this kernel's blocks exit (same probe).
"""

from __future__ import annotations

import torch

from minidsa.kernels.triton_compat import tl, triton

# device -> launch keywords; a plain dict (torch.compile traces through callers without warnings).
_LAUNCH: dict[torch.device, dict[str, bool]] = {}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Block until the kernels this one may depend on have finished and their writes are visible (PDL launch);
    nothing when launched without PDL (the stream already ordered it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def pdl_launch(device: torch.device | str) -> dict[str, bool]:
    """Keywords for launching a kernel with a `PDL` parameter on `device`: PDL on CUDA devices of compute
    capability 9.0 or later, off elsewhere (older GPUs, and the CPU tensors of Triton's interpreter)."""
    device = torch.device(device)
    if device not in _LAUNCH:
        on = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
        _LAUNCH[device] = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    return _LAUNCH[device]
