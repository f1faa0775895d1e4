"""``budget="device"``: what the CUDA device has free when the first graph is planned, less
a margin, made bytes there (``Budget.device``); refused on a machine or model without one."""

from __future__ import annotations

import logging

import torch

from remat.errors import InvalidOption
from remat.solvers import Budget, format_bytes

log = logging.getLogger("remat")

# Share of the free memory a "device" budget leaves unplanned: the caching allocator rounds
# blocks up and fragments, and kernels' workspaces (cuBLAS, cuDNN) come on top of what
# remat plans; measured peaks are allocated bytes, which reserved bytes exceed.
DEVICE_MARGIN = 0.10


def check_available(budget: Budget) -> None:
    """A ``"device"`` budget where no CUDA device is: refused before anything is traced."""
    if budget.device and not torch.cuda.is_available():
        raise InvalidOption(_no_cuda("this machine has no CUDA device"))


def on_device(budget: Budget, device: torch.device) -> Budget:
    """``budget``, a ``"device"`` one made bytes: ``device``'s free memory now (parameters
    and inputs on it already; the optimizer's state, made at its first step, not yet) less
    ``DEVICE_MARGIN`` of it. Any other budget as it is."""
    if not budget.device:
        return budget
    if device.type != "cuda":
        raise InvalidOption(_no_cuda(f"this model's graph runs on {device}"))
    free, _total = torch.cuda.mem_get_info(device)
    nbytes = int(free * (1 - DEVICE_MARGIN))
    log.info(
        "remat: budget 'device' is %s: %s free on %s, less a %.0f%% margin",
        format_bytes(nbytes),
        format_bytes(free),
        device,
        100 * DEVICE_MARGIN,
    )
    return Budget(nbytes=nbytes, written=f"device ({format_bytes(nbytes)})")


def _no_cuda(why: str) -> str:
    return (
        f'budget "device" is what a CUDA device has free at the first step, and {why}: '
        'give bytes ("2GiB"), a fraction of the store-all peak (0.5) or "min"'
    )
