"""Per-node costs of an AOTAutograd joint graph: bytes, aliasing, time and flags.

* ``remat.costs.graph``: facts read off fx nodes and their fake metadata (aliasing, bytes
  allocated and moved, flops).
* ``remat.costs.flags``: randomness and side effects (what may never be recomputed).
* ``remat.costs.device``: device specs and the roofline time estimate.
* ``remat.costs.measured``: kernel time and scratch memory measured on the device.

Why the rules are what they are, and where the figures come from: docs/cost-model.md.
"""

from __future__ import annotations

from .device import DeviceSpec, estimate_seconds
from .flags import has_side_effects, is_random, random_numbers
from .graph import aliased_input, allocated_bytes, bytes_moved, flops, output_bytes
from .measured import (
    KernelMemory,
    ProfileResult,
    kernel_memory,
    profile_seconds,
    scratch_measurable,
)

__all__ = [
    "DeviceSpec",
    "KernelMemory",
    "ProfileResult",
    "aliased_input",
    "allocated_bytes",
    "bytes_moved",
    "estimate_seconds",
    "flops",
    "has_side_effects",
    "is_random",
    "kernel_memory",
    "output_bytes",
    "profile_seconds",
    "random_numbers",
    "scratch_measurable",
]
