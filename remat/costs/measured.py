"""Costs measured on the device: each kernel's time and its scratch memory.

Each op runs alone on synthetic inputs built from its inputs' fake metadata. Equal ops
(same op, shapes, strides, dtypes and other arguments) are measured once. Ops that cannot
run on synthetic data, and collectives (they could hang alone), fall back to the model:
the roofline estimate for time, the outputs' nominal bytes for memory.
"""

from __future__ import annotations

import functools
import logging
import operator
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from remat.passes._torch_compat import (
    op_schema,
    real_tensors,
    storage_of,
    tree_flatten,
    tree_map,
)
from remat.passes.layouts import RUN_STRIDES

from ._fx import hint, meta_val, tensors_of
from .device import DeviceSpec, estimate_seconds
from .flags import is_collective, reads_opaque_buffer
from .graph import is_kernel, is_view

log = logging.getLogger(__name__)

__all__ = [
    "VALID_INPUTS",
    "KernelMemory",
    "ProfileResult",
    "kernel_memory",
    "output_strides",
    "profile_seconds",
    "scratch_measurable",
]


# --------------------------------------------------------------------------------------
# Kernel time (cost_model="profile")
# --------------------------------------------------------------------------------------


class ProfileResult(dict):
    """``{node.name: seconds}`` plus the nodes that fell back to the estimate.

    ``fallbacks`` maps node name to the reason its op could not be measured on synthetic
    inputs (it then holds ``estimate_seconds``), so a caller can report them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fallbacks: dict[str, str] = {}

    @property
    def note(self) -> str:
        if not self.fallbacks:
            return "all ops measured"
        names = ", ".join(sorted(self.fallbacks)[:8])
        more = "" if len(self.fallbacks) <= 8 else ", ..."
        return f"{len(self.fallbacks)} ops fell back to the roofline estimate: {names}{more}"


def _storage_numel(t: torch.Tensor, strides: list[int]) -> int:
    sizes = [hint(s) for s in t.shape]
    if any(s == 0 for s in sizes):
        return 0
    return (
        hint(t.storage_offset())
        + 1
        + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True))
    )


def _materialise(
    fake: torch.Tensor, device: torch.device, strides: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Real tensor with ``fake``'s shape, stride (or ``strides``), offset and dtype on
    ``device``.

    Floats are standard normal, integers zero (a valid index into any non-empty
    dimension), bools runs of 64 True then 64 False. Not random bools: masks that ops
    branch on (``masked_fill``, ``where``) are causal or padding masks in practice, and
    a random mask mispredicts every other branch (timings: docs/cost-model.md,
    "Kernel time").
    """
    strides = [hint(s) for s in (fake.stride() if strides is None else strides)]
    n = _storage_numel(fake, strides)
    dtype = fake.dtype
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(n, dtype=dtype, device=device)
    elif dtype == torch.bool:
        base = torch.arange(n, device=device) // 64 % 2 == 0
    else:
        base = torch.zeros(n, dtype=dtype, device=device)
    sizes = [hint(s) for s in fake.shape]
    return base.as_strided(sizes, strides, hint(fake.storage_offset()))


# Ops whose inputs must hold what random data cannot (``remat::reversible_backward``'s
# generator states, which the generator refuses when invalid): op name -> a function that
# turns the synthetic (args, kwargs) into valid ones of the same shapes. Registered by the
# module that defines the op; without it the op is not measured (its scratch counts 0).
VALID_INPUTS: dict[str, Callable[[tuple, dict], tuple[tuple, dict]]] = {}


def _real_args(
    node: fx.Node,
    place: Callable[[torch.device], torch.device],
    layouts: Mapping[fx.Node, tuple[int, ...]] | None = None,
) -> tuple[tuple, dict]:
    """Concrete args for ``node``: tensors materialised where ``place`` puts them, laid
    out as their fake values or as ``layouts`` says (and made valid where
    ``VALID_INPUTS`` says how)."""
    made: dict[fx.Node, Any] = {}

    def convert(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in made:
                v = meta_val(a)
                if isinstance(v, torch.Tensor):
                    strides = layouts.get(a) if layouts else None
                    made[a] = _materialise(v, place(v.device), strides)
                elif isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
                    made[a] = hint(v)
                elif isinstance(v, (float, bool)):
                    made[a] = v
                elif isinstance(v, (torch.SymFloat, torch.SymBool)) and v.node.hint is not None:
                    made[a] = v.node.hint
                else:
                    raise ValueError(f"input {a.name} has no tensor metadata ({type(v).__name__})")
            return made[a]
        if isinstance(a, torch.device):
            return place(a)
        if isinstance(a, torch.SymInt):
            return hint(a)
        return a

    args, kwargs = tree_map(convert, (node.args, node.kwargs))
    schema = op_schema(node.target)
    valid = VALID_INPUTS.get(schema.name) if schema is not None else None
    return valid(args, kwargs) if valid is not None else (args, kwargs)


def timed_runs(
    fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int
) -> list[float]:
    """Seconds of each of ``repeat`` runs of ``fn`` on ``device`` after ``warmup`` untimed
    ones, synchronised on CUDA."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeat)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _time_op(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int) -> float:
    return statistics.median(timed_runs(fn, device, repeat, warmup))


def concrete_device(device: str | torch.device) -> torch.device:
    """``device`` with its index: a bare "cuda" is the current CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def profile_seconds(
    gm: fx.GraphModule,
    device: str | torch.device,
    *,
    repeat: int = 5,
    warmup: int = 1,
    spec: DeviceSpec | None = None,
) -> ProfileResult:
    """Measure every kernel of ``gm`` on ``device`` (cost_model="profile").

    Each call_function node runs alone on synthetic inputs built from its inputs' fake
    metadata; the median of ``repeat`` timed runs is kept (synchronised on CUDA). Nodes
    with the same op, shapes, strides, dtypes and other arguments (every layer of a
    transformer) are measured once and share the figure: profiling is faster, and equal
    ops cost the same, so the solver does not prefer one layer's copy over another's
    because of timing noise. Nodes
    that launch nothing (views, getitem, SymInt arithmetic) get 0, as do non-op nodes.
    Ops that fail on synthetic data, and collectives (never run in isolation: they could
    hang), get ``estimate_seconds`` instead; they are listed in ``result.fallbacks`` and
    logged. The global RNG state is restored afterwards, so profiling random ops does not
    change the training run's random numbers.
    """
    dev = concrete_device(device)
    spec = DeviceSpec.for_device(dev) if spec is None else spec  # for the fallbacks
    result = ProfileResult()
    # A graph traced for this device type keeps its tensors where they were (CPU seed or
    # scalar tensors stay on CPU); a graph traced elsewhere moves wholesale to ``dev``.
    traced_here = any(
        t.device.type == dev.type for n in gm.graph.nodes for t in tensors_of(meta_val(n))
    )

    def place(d: torch.device) -> torch.device:
        return dev if not traced_here or d.type == dev.type else d

    fork_devices = [dev.index] if dev.type == "cuda" else []
    measured: dict[Any, float] = {}
    with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
        for node in gm.graph.nodes:
            if (
                node.op != "call_function"
                or node.target is operator.getitem
                or is_view(node)
                or not is_kernel(node)
            ):
                result[node.name] = 0.0
                continue
            if is_collective(node.target) or reads_opaque_buffer(node.target):
                result[node.name] = estimate_seconds(node, spec)
                result.fallbacks[node.name] = (
                    "collective: not run in isolation"
                    if is_collective(node.target)
                    else "reads a buffer its forward kernel wrote: not run on synthetic inputs"
                )
                continue
            key = (node.target, _signature(node.args), _signature(node.kwargs))
            if key in measured:
                result[node.name] = measured[key]
                continue
            try:
                args, kwargs = _real_args(node, place)
                call = functools.partial(node.target, *args, **kwargs)
                result[node.name] = measured[key] = _time_op(call, dev, repeat, warmup)
            except Exception as e:  # any failure on synthetic data: estimate instead
                result[node.name] = estimate_seconds(node, spec)
                result.fallbacks[node.name] = f"{type(e).__name__}: {str(e)[:200]}"
    if result.fallbacks:
        log.warning("profile_seconds on %s: %s", dev, result.note)
    return result


# --------------------------------------------------------------------------------------
# Kernel memory
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelMemory:
    """What one run of a kernel allocated, measured on the device.

    ``storage``: bytes of the storages of its fresh tensor outputs (not aliases of an
    input). It can exceed their nominal size: CPU ``mse_loss`` returns its scalar in the
    input-sized buffer it reduced, which then lives as long as the loss does.
    ``scratch``: what it allocated beyond those and freed before returning.
    """

    storage: int
    scratch: int


def kernel_memory(
    node: fx.Node, device: str | torch.device, cache: dict[Any, KernelMemory | None] | None = None
) -> KernelMemory | None:
    """Run ``node``'s op on synthetic inputs under ``remat.memory.peak`` (on CUDA after a
    warm-up call): what its outputs hold and what else it allocated.

    Every kernel is measured, because which ones allocate more than their outputs is not
    predictable (examples: docs/cost-model.md, "Scratch memory").
    None for views, collectives and what is not a kernel, and for an op that cannot run
    on synthetic inputs (with a warning). ``cache`` shares results between nodes with the
    same op, shapes, strides and dtypes. Scratch is 0 where it cannot be measured now
    (``scratch_measurable``: on CPU inside a user's profiler session).
    """
    if not _runs_alone(node):
        return None
    dev = torch.device(device)
    layouts = run_layouts(node)
    key = (node.target, _signature(node.args), _signature(node.kwargs), dev, *layouts.values())
    if cache is not None and key in cache:
        return cache[key]
    if reads_opaque_buffer(node.target):
        log.warning(
            "kernel_memory: %s (%s) not measured: it reads a buffer its forward kernel wrote, "
            "which synthetic inputs cannot fake; its scratch counts as 0 (the measured peak "
            "may exceed the prediction by it)",
            node.name,
            node.target,
        )
        if cache is not None:
            cache[key] = None
        return None
    from remat.memory import peak

    # On CPU the peak is measured with a profiler, which cannot run inside a user's: then
    # only the outputs' storage is known (``scratch_measurable``).
    scratch_known = scratch_measurable(dev)
    try:
        args, kwargs = _real_args(node, lambda _: dev, layouts)
        inputs = {storage_of(t) for t in tree_flatten((args, kwargs))[0]}
        # A measured random op must not move the generator the step's masks come from.
        fork = [dev] if dev.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=fork):
            # On CUDA a first call may allocate what later ones reuse (cuBLAS's workspace,
            # caches): resident during a training step, not this op's scratch, so it runs
            # once unmeasured. On CPU a first call allocates as later ones do, so it is
            # skipped (docs/cost-model.md, "Scratch memory").
            if dev.type != "cpu" or not scratch_known:
                out = node.target(*args, **kwargs)
            if scratch_known:
                run = peak(lambda: node.target(*args, **kwargs), device=dev)
                out = run.result
        outputs = {storage_of(t): t for t in tensors_of(out)}
        storage = sum(t.untyped_storage().nbytes() for s, t in outputs.items() if s not in inputs)
        scratch = max(0, run.peak_bytes - storage) if scratch_known else 0
        result = KernelMemory(storage=storage, scratch=scratch)
    except Exception as e:  # any failure on synthetic data: nothing known
        log.warning(
            "kernel_memory: %s (%s) not measured: %s: %s",
            node.name,
            node.target,
            type(e).__name__,
            str(e)[:200],
        )
        result = None
    if cache is not None:
        cache[key] = result
    return result


def run_layouts(node: fx.Node) -> dict[fx.Node, tuple[int, ...]]:
    """``node``'s inputs laid out at run time otherwise than traced, with those strides
    (``passes.layouts``): its kernel is measured on inputs laid out as it will meet them."""
    return {a: a.meta[RUN_STRIDES] for a in node.all_input_nodes if RUN_STRIDES in a.meta}


def _runs_alone(node: fx.Node) -> bool:
    """A kernel that may run alone on synthetic inputs: not a view, not what launches no
    work, not a collective (it could hang alone)."""
    return (
        node.op == "call_function"
        and op_schema(node.target) is not None
        and not is_view(node)
        and is_kernel(node)
        and not is_collective(node.target)
    )


def output_strides(
    node: fx.Node, layouts: Mapping[fx.Node, tuple[int, ...]]
) -> list[tuple[int, ...] | None] | None:
    """The strides of the tensors ``node``'s real kernel returns (None for its other
    outputs), run once on synthetic inputs laid out as their fake values or as
    ``layouts`` says; None for an op ``kernel_memory`` would not run, or one that fails
    on them."""
    if not _runs_alone(node) or reads_opaque_buffer(node.target):
        return None
    devices = {t.device for t in tensors_of([meta_val(a) for a in node.all_input_nodes])}
    fork = [d for d in devices if d.type == "cuda"]  # a random op keeps the step's generator
    try:
        with real_tensors(), torch.no_grad(), torch.random.fork_rng(devices=fork):
            args, kwargs = _real_args(node, lambda d: d, layouts)
            out = node.target(*args, **kwargs)
    except Exception:  # an op synthetic inputs cannot drive
        return None
    values = out if isinstance(out, (tuple, list)) else (out,)
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in values]


def scratch_measurable(device: str | torch.device) -> bool:
    """Whether ``kernel_memory`` can measure scratch on ``device`` now: not on CPU while a
    profiler runs (``remat.memory.profiler_active``)."""
    from remat.memory import profiler_active

    return torch.device(device).type != "cpu" or not profiler_active()


def _signature(tree: Any) -> tuple:
    """Hashable description of fx args: tensors by shape/stride/dtype/device, others by
    value."""

    def describe(a: Any) -> Any:
        v = meta_val(a) if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            shape, stride = tuple(hint(s) for s in v.shape), tuple(hint(s) for s in v.stride())
            return (shape, stride, v.dtype, v.device)
        if isinstance(v, (list, tuple)):
            return tuple(describe(x) for x in v)
        return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)

    if isinstance(tree, dict):
        return tuple(sorted((k, describe(v)) for k, v in tree.items()))
    return tuple(describe(a) for a in tree)
