"""Per-node costs of an AOTAutograd joint graph: bytes, aliasing, time and flags.

* ``remat.costs.graph``: facts read off fx nodes and their fake metadata (aliasing, bytes
  allocated and moved, flops).
* ``remat.costs.flags``: randomness and side effects (what may never be recomputed).
* ``remat.costs.device``: device specs and the roofline time estimate.
* ``remat.costs.measured``: kernel time and scratch memory measured on the device.

The cost-model registry lives here: ``COST_MODELS`` names the choices a user has (the
planner, the CLI and the bench all read it), ``check_cost_model`` refuses any other name,
and ``CostModel`` is what a name stands for on one graph.

Why the rules are what they are, and where the figures come from: docs/cost-model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from remat.errors import InvalidOption

from . import calibration
from ._fx import compute_dtypes
from .device import DeviceSpec, estimate_seconds, fused_seconds
from .flags import has_side_effects, is_random, random_numbers
from .graph import (
    aliased_input,
    allocated_bytes,
    bytes_moved,
    flops,
    is_pointwise,
    is_view,
    output_bytes,
)
from .measured import (
    KernelMemory,
    ProfileResult,
    kernel_memory,
    output_strides,
    profile_seconds,
    scratch_measurable,
)

__all__ = [
    "COST_MODELS",
    "COMPILERS",
    "FUSED_SAVE_PASSES",
    "SAVE_PASSES",
    "CostModel",
    "DeviceSpec",
    "KernelMemory",
    "ProfileResult",
    "aliased_input",
    "allocated_bytes",
    "bytes_moved",
    "check_cost_model",
    "estimate_seconds",
    "flops",
    "has_side_effects",
    "fused_seconds",
    "is_pointwise",
    "is_random",
    "kernel_memory",
    "output_bytes",
    "output_strides",
    "profile_seconds",
    "random_numbers",
    "scratch_measurable",
]

# roofline: time estimated from flops and bytes (``device``); profile: each distinct
# kernel timed on the device (``measured``). Both measure each kernel's memory.
COST_MODELS = ("roofline", "profile")

# Bandwidth passes a saved storage costs the step: the backward reads it back cold, where
# a value recomputed just before its reader is read warm (1); a value inductor fuses into
# its readers would not have been written at all, so saving it also costs its write (2).
# Measured against steps: docs/cost-model.md, "Step time".
SAVE_PASSES, FUSED_SAVE_PASSES = 1.0, 2.0
COMPILERS = ("eager", "inductor")  # what runs the programs; the first is the default


def device_spec(
    joint: fx.GraphModule,
    device: torch.device,
    stored: Callable[[str, Callable[[], dict]], dict] | None = None,
) -> DeviceSpec:
    """The roofline's figures for ``joint`` on ``device``: measured on this machine for
    the dtypes its inputs hold (``calibration.calibrated``, kept by ``stored``), or the
    datasheet's with ``REMAT_CALIBRATE=0``."""
    if not calibration.enabled():
        return DeviceSpec.for_device(device)
    return calibration.calibrated(device, compute_dtypes(joint), stored)


def check_cost_model(name: str) -> str:
    """``name`` if it is one of ``COST_MODELS``; ``InvalidOption`` listing them otherwise."""
    if name not in COST_MODELS:
        raise InvalidOption(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}")
    return name


@dataclass
class CostModel:
    """Node facts for ``passes.extract``: bytes and aliasing from fake tensors (bytes
    raised to a kernel's measured output storage), scratch measured per kernel, time by
    roofline estimate or, with ``measured``, by timing each op on the device; the time
    under the ``compiler`` that runs the programs (inductor fuses a pointwise op into
    readers that are pointwise too) and the time a saved storage costs the step."""

    spec: DeviceSpec
    device: torch.device
    measured: dict[str, float] = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)  # kernel_memory's cache
    compiler: str = "eager"

    @classmethod
    def for_graph(
        cls,
        name: str,
        joint: fx.GraphModule,
        device: torch.device,
        compiler: str = "eager",
        spec: DeviceSpec | None = None,
    ) -> CostModel:
        """The cost model ``name`` (one of ``COST_MODELS``) of ``joint`` on ``device`` for
        programs ``compiler`` runs, with ``spec``'s figures (``calibration.calibrated``;
        default: the datasheet's); with "profile", every distinct kernel of ``joint`` is
        timed now."""
        check_cost_model(name)
        if compiler not in COMPILERS:
            raise InvalidOption(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        spec = DeviceSpec.for_device(device) if spec is None else spec
        model = cls(spec, device, compiler=compiler)
        if name == "profile":
            model.measured.update(profile_seconds(joint, device, spec=spec))
        return model

    def allocated_bytes(self, node: fx.Node) -> int:
        """The fake tensors' sizes, or the measured storage where a single output's is
        larger (``KernelMemory``); never less, so the budget stays safe."""
        nominal = allocated_bytes(node)
        if nominal == 0 or isinstance(node.meta.get("val"), (list, tuple)):
            return nominal  # aliases, views, multi-output ops (their parts own the bytes)
        measured = kernel_memory(node, self.device, self.kernels)
        return nominal if measured is None else max(nominal, measured.storage)

    def aliased_input(self, node: fx.Node) -> fx.Node | None:
        return aliased_input(node)

    def seconds(self, node: fx.Node) -> float:
        if self.fused(node):
            return fused_seconds(node, self.spec)
        if node.name in self.measured:
            return self.measured[node.name]
        return estimate_seconds(node, self.spec)

    def fused(self, node: fx.Node) -> bool:
        """Whether the compiler runs ``node`` inside its readers' kernel: under inductor, a
        pointwise op all of whose readers are pointwise (through views). One read by a
        matmul, a reduction or the output is written out like any kernel's."""
        return self.compiler == "inductor" and is_pointwise(node) and _fusible_readers(node)

    def save_seconds(self, node: fx.Node, nbytes: int) -> float:
        """What keeping ``node``'s storage of ``nbytes`` for the backward costs the step."""
        passes = FUSED_SAVE_PASSES if self.fused(node) else SAVE_PASSES
        return passes * nbytes / self.spec.bandwidth

    def workspace(self, node: fx.Node) -> int:
        measured = kernel_memory(node, self.device, self.kernels)
        return 0 if measured is None else measured.scratch

    def recomputable(self, node: fx.Node) -> bool:
        return not (is_random(node) or has_side_effects(node))


def _fusible_readers(node: fx.Node) -> bool:
    """Every reader of ``node`` is a pointwise op, or a view whose readers all are."""
    if not node.users:
        return False
    return all(is_pointwise(u) or (is_view(u) and _fusible_readers(u)) for u in node.users)
