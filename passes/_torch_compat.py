"""Every private PyTorch API remat touches. One file because a torch upgrade then edits
one place.

Private means a name or module path with a leading underscore (``torch._dynamo``,
``torch.utils._pytree``, ``torch._C``) or an underscored attribute of a public object.
Every other module of ``remat`` reaches them through this one; ``tests/test_layout.py``
checks it. ``torch.compiler.reset`` and ``torch.utils.checkpoint`` are public and used
directly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

SUPPORTED = ">=2.11,<2.16"  # the torch releases remat runs on (pyproject.toml declares it)


@contextlib.contextmanager
def needed() -> Iterator[None]:
    """Around imports of torch's private names: where the installed torch lacks one, an
    ``ImportError`` naming that release, what it lacks and the releases remat runs on,
    raised when remat is imported or when the call that first needs the name runs."""
    try:
        yield
    except ImportError as e:
        raise ImportError(
            f"remat cannot run on torch {torch.__version__}: {e}; remat runs on torch{SUPPORTED}"
        ) from None


with needed():
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit
    from torch._dynamo.utils import orig_code_map
    from torch._functorch.partitioners import _extract_fwd_bwd_modules
    from torch._guards import CompileContext, CompileId
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        ConstraintViolationError,
        statically_known_true,
        sym_eq,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    try:  # a size's hint, read without adding a guard
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch 2.11 and 2.12 name it size_hint
        from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

__all__ = [
    "SUPPORTED",
    "TRACE_CHECKPOINT_SIDE_EFFECTS",
    "needed",
    "graph_copy",
    "profiler_range_notes_off",
    "after_backward",
    "backward_holds_tangents",
    "BackendCompilerFailed",
    "CompileContext",
    "CompileId",
    "ConstraintViolationError",
    "FailOnRecompileLimitHit",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "aot_autograd",
    "autograd_in_kernel",
    "compile_caches_off",
    "cpu_allocations",
    "current_dispatch_mode",
    "custom_partitioner_base",
    "declared_maxima",
    "dispatch_modes_off",
    "dynamo_config",
    "dynamo_compiled_code",
    "fsdp_resized_tensors",
    "has_fsdp",
    "inductor",
    "min_cut_partition",
    "pop_dispatch_mode",
    "profiler_enabled",
    "push_dispatch_mode",
    "storage_key",
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "boxed",
    "extract_fwd_bwd_modules",
    "is_python_random",
    "is_torch_assert",
    "mark_dynamic_up_to",
    "mutated_inputs",
    "op_schema",
    "optimization_hint",
    "plain_dispatch",
    "real_tensors",
    "storage_of",
    "tree_flatten",
    "tree_map",
]


def extract_fwd_bwd_modules(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split ``joint`` into forward and backward modules that exchange ``saved_*``.

    torch's helper builds the signatures AOTAutograd's runtime expects (saved
    tensors vs symbolic sizes, tangents, RNG seeds); remat then fixes the order.
    """
    return _extract_fwd_bwd_modules(
        joint, saved_values, saved_sym_nodes, num_fwd_outputs=num_fwd_outputs
    )


def boxed(gm: fx.GraphModule):
    """Compile ``gm`` to plain Python that takes one list and clears it, so each input
    can be freed right after its last use (as torch's aot_eager does)."""
    with needed():
        from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, [])


def mutated_inputs(joint: fx.GraphModule) -> set[fx.Node]:
    """Placeholders the AOT runtime overwrites after the forward (BatchNorm running stats).

    Read from the output node's AOT descriptors: an ``InputMutationAOTOutput``
    names the input whose new value it carries.
    """
    descs = joint.graph.output_node().meta.get("desc") or []
    mutated = [d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"]
    return {n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated}


def real_tensors():
    """Context in which tensors are real even inside a compile (where a FakeTensorMode
    is active): needed to measure ops on the device while planning."""
    with needed():
        from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def storage_of(value) -> StorageWeakRef | None:
    """A hashable handle on the storage a tensor (real or fake) lives in, equal for every
    view of it; None for non-tensors and tensors without one storage (sparse, nested)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # sparse and nested tensors have no single storage
        return None


def op_schema(target) -> torch.FunctionSchema | None:
    """The schema of an op overload (``aten.mm.default``); None for anything else: python
    callables, overload packets, higher-order operators."""
    return getattr(target, "_schema", None) if isinstance(target, OpOverload) else None


def is_torch_assert(target) -> bool:
    """Whether ``target`` is ``torch._assert``, the assert fx traces from python code."""
    return target is torch._assert


def is_python_random(target) -> bool:
    """Whether ``target`` is a python-level torch function that draws random numbers
    (``torch.rand`` & co., in torch IR graphs rather than aten joint graphs)."""
    with needed():
        import torch._library.utils as lib_utils

    return target in getattr(lib_utils, "_RANDOM_FUNCTIONS", ())


# ----------------------------------------------------------------------------- storages


def storage_key(t: torch.Tensor) -> int:
    """An integer naming the storage ``t`` lives in (equal for all its views) while that
    storage is alive: the address of its C++ object."""
    return t.untyped_storage()._cdata


# ----------------------------------------------------------------------------- compiling


def aot_autograd(**kwargs):
    """dynamo's AOTAutograd backend factory (``fw_compiler``, ``bw_compiler``,
    ``partition_fn``)."""
    with needed():
        from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def inductor(gm: fx.GraphModule, example_inputs):
    """Compile ``gm`` with inductor, partitioned by torch's own min-cut."""
    with needed():
        from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


# inductor's C++ backend fuses no two kernels of which neither reads the other in a program
# remat wrote: such a fusion computes values the plan schedules apart at once, holding its
# inputs and outputs together (docs/benchmarks.md, "The first step with the loss outside")
NO_HORIZONTAL_FUSION = {"cpp.max_horizontal_fusion_size": 1}
# nor reorders its kernels for memory: the program's order is remat's schedule, and a
# dropout's mask is drawn right after its generator state is read (``passes.rng``); nor
# lays out a convolution's output otherwise than traced: the program that reads it was
# compiled for the traced layout
AS_SCHEDULED = {
    **NO_HORIZONTAL_FUSION,
    "reorder_for_peak_memory": False,
    "layout_optimization": False,
}


def inductor_decompositions() -> dict:
    """The decompositions inductor traces a graph with: a program inductor compiles must
    hold only ops it lowers (``inductor_program``)."""
    with needed():
        from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_program(gm: fx.GraphModule, *, backward: bool = False, inference: bool = False):
    """``gm`` (a forward or backward program remat wrote) compiled by inductor, through
    its decompositions, fusing kernels in the order ``gm`` runs them (``AS_SCHEDULED``):
    a callable taking one list, which it clears. Compiled apart from any compile in
    progress (AOTAutograd's record of output strides is its forward's alone). None where
    its sizes are symbolic, no dynamo compile is in progress, and inductor's compile added
    guards on them: nothing would check those at later sizes (dynamo installs a frame's
    guards when its compile ends)."""
    with needed():
        from torch._guards import tracing
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = next(v.fake_mode for v in inputs if isinstance(v, FakeTensor))
    shape_env = mode.shape_env
    guards = len(shape_env.guards) if shape_env is not None else 0
    decomposed = _decomposed(gm, inputs, mode)
    if decomposed is None:
        return None
    with tracing(None), config.patch(AS_SCHEDULED):
        compiled = compile_fx_inner(
            decomposed, inputs, is_backward=backward, is_inference=inference
        )
    unchecked = shape_env is not None and len(shape_env.guards) > guards
    if unchecked and CompileContext.current_compile_id() is None:
        del shape_env.guards[guards:]
        return None
    return compiled


def _decomposed(gm: fx.GraphModule, inputs: list, mode: FakeTensorMode) -> fx.GraphModule | None:
    """``gm`` traced again through inductor's decompositions, each output laid out as
    ``gm``'s (a program that reads it was traced with that layout): a decomposition may
    lay out its result otherwise than the op it replaces, and inductor keeps an output's
    layout as its graph's says. None where such an output's sizes are symbolic."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with mode:
        new = make_fx(fx.Interpreter(gm).run, decomposition_table=inductor_decompositions())(
            *inputs
        )
    output = new.graph.output_node()
    outs = list(output.args[0])
    for k, (old, out) in enumerate(zip(gm.graph.output_node().args[0], outs, strict=True)):
        want = old.meta.get("val") if isinstance(old, fx.Node) else None
        got = out.meta.get("val") if isinstance(out, fx.Node) else None
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            continue
        if statically_known_true(sym_eq(want.stride(), got.stride())):
            continue
        layout = (*want.shape, *want.stride())
        if not all(isinstance(v, int) for v in layout):
            return None
        with new.graph.inserting_before(output):
            empty = new.graph.call_function(
                torch.ops.aten.empty_strided.default,
                (list(want.shape), list(want.stride())),
                {"dtype": want.dtype, "device": want.device},
            )
            outs[k] = new.graph.call_function(torch.ops.aten.copy.default, (empty, out))
        empty.meta["val"] = outs[k].meta["val"] = want
    output.args = (tuple(outs),)
    new.recompile()
    return new


# dynamo traces a checkpointed region with a Python side effect (a context variable set and
# reset: transformers' hub kernels inside each layer) rather than breaking the graph, the
# effect applied once: remat recomputes graph nodes, never Python code, so no region it
# recomputes replays one (docs/guide.md, "remat.optimize")
TRACE_CHECKPOINT_SIDE_EFFECTS = {
    key: True
    for key in ("skip_fwd_side_effects_in_bwd_under_checkpoint",)
    if hasattr(dynamo_config, key)
}


def custom_partitioner_base() -> type:
    """inductor's ``CustomPartitionerFn``, the base a custom partitioner subclasses."""
    with needed():
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm``, without the ``FutureWarning`` torch's own pytree specs in its
    metadata raise when copied (``isinstance(treespec, LeafSpec)``): torch's deprecation,
    nothing a user of remat can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        return copy.deepcopy(gm)


@contextlib.contextmanager
def profiler_range_notes_off() -> Iterator[None]:
    """Without dynamo's warning that a profiler range in the code it traces is left out of
    the compiled graph (``Profiler record function ... will be ignored``), while remat
    compiles a user's model: DDP's forward opens one at every call, and a range has no
    place inside a planned program; nothing a user of remat can act on."""
    notes = logging.getLogger("torch._dynamo.variables.ctx_manager")
    notes.addFilter(_profiler_range_note)
    try:
        yield
    finally:
        notes.removeFilter(_profiler_range_note)


def _profiler_range_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Profiler record function")


def min_cut_partition(
    joint: fx.GraphModule, joint_inputs, *, memory_budget: float | None = None, **kwargs
):
    """torch's ``min_cut_rematerialization_partition`` choosing from the ops inductor may
    recompute (its default set), for comparing against remat on the same graph; at
    ``activation_memory_budget = memory_budget`` where given, else at the configured one."""
    with needed():
        from torch._functorch import config
        from torch._functorch.partitioners import min_cut_rematerialization_partition

    patch = {} if memory_budget is None else {"activation_memory_budget": float(memory_budget)}
    with config.patch(**patch):
        return min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", **kwargs
        )


@contextlib.contextmanager
def compile_caches_off(activation_memory_budget: float | None = None) -> Iterator[None]:
    """AOTAutograd's and inductor's caches off (a cache hit skips the partitioner, so a
    partition made under other settings would be reused), and torch's
    ``activation_memory_budget`` set while its min-cut partitions, when given."""
    with needed():
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

    patches = {"enable_autograd_cache": False}
    if activation_memory_budget is not None:
        patches["activation_memory_budget"] = float(activation_memory_budget)
    with functorch_config.patch(**patches), inductor_config.patch(fx_graph_cache=False):
        yield


# ----------------------------------------------------------------------------- autograd


def dynamo_compiled_code(code) -> bool:
    """Whether ``code`` is bytecode dynamo made of a frame it compiled (a frame running it
    calls graphs, the code at its graph breaks, and functions resuming after them)."""
    return code in orig_code_map


def frames_compiled() -> int | None:
    """How many frames dynamo has set out to compile in this process (None where this
    torch keeps no such count). It only grows, unless torch's own test harness clears
    dynamo's counters."""
    try:
        from torch._dynamo.utils import counters

        return counters["frames"]["total"]
    except (ImportError, KeyError, TypeError):
        return None


def backward_holds_tangents() -> bool:
    """Whether a compiled graph's backward keeps every tangent it is fed until it returns.

    Since autograd can hand a ``Function``'s backward its gradients in a list the backward
    may empty (``boxed_grads_call``), AOTAutograd's backward drops each tangent before
    running the compiled program, which then frees it after its last use. Where autograd
    has no such call (torch 2.11), the backward takes the tangents as a tuple that holds
    them until it returns."""
    return not hasattr(torch.autograd.Function, "boxed_grads_call")


def after_backward(callback) -> None:
    """Run ``callback`` when the backward pass running now has finished (FSDP2 ends its
    own backward work the same way); called from inside that backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ----------------------------------------------------------------------------- FSDP2


def has_fsdp(module: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) shards ``module`` or a module in its tree."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def fsdp_resized_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors whose storages FSDP2 (``fully_shard``) resizes to free and allocate
    again, over ``module``'s tree: each sharded parameter's all-gather outputs and
    unsharded tensors, those made so far (FSDP makes them at its first all-gather)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    found: list[torch.Tensor] = []
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            found += param.all_gather_outputs
            found += getattr(param, "_unsharded_inner_tensors", [])
    return found


# ----------------------------------------------------------------------------- dispatch modes


def current_dispatch_mode():
    """The innermost active ``TorchDispatchMode`` (None when there is none)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


@contextlib.contextmanager
def dispatch_modes_off(kind: type) -> Iterator[None]:
    """The dispatch modes of type ``kind``, and any above them, off the stack while the
    block runs, then back in their order."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    stack = _get_current_dispatch_mode_stack()
    first = next((i for i, m in enumerate(stack) if isinstance(m, kind)), len(stack))
    popped = [_pop_mode() for _ in range(len(stack) - first)]
    try:
        yield
    finally:
        for mode in reversed(popped):
            push_dispatch_mode(mode)


@contextlib.contextmanager
def plain_dispatch() -> Iterator[None]:
    """Ops dispatched as outside any compile: no dispatch mode (a compile's fake tensor
    mode included) and no Python dispatcher, which a compile turns on for its thread and
    under which every op launches slower (docs/cost-model.md, "Calibration")."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisablePythonDispatcher():
        yield


def push_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Make ``mode`` active without a ``with`` block (it stays until popped)."""
    from torch.utils._python_dispatch import _push_mode

    _push_mode(mode)


def pop_dispatch_mode() -> TorchDispatchMode:
    """Deactivate the innermost dispatch mode and return it."""
    from torch.utils._python_dispatch import _pop_mode

    return _pop_mode()


@contextlib.contextmanager
def autograd_in_kernel() -> Iterator[None]:
    """Autograd recording inside a custom op's kernel (``remat.nn``'s backward runs the
    blocks' backward there), with the dispatch state the kernel has when a program runs
    it. A kernel runs below autograd: its dispatch keys are excluded on the thread (under
    a dispatch mode ``ADInplaceOrView`` too); removing ``AutogradCPU`` removes the
    autograd functionality bit, so every backend's. Planning measures kernels under the
    Python dispatcher, under which the ops inside allocated 8 KiB more (seen with
    dropout in a block) than when a program runs them: it is left out."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set().remove(
        torch._C.DispatchKey.PythonDispatcher
    )
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


# ----------------------------------------------------------------------------- profiler


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or autograd profiler) session runs on this thread."""
    return torch._C._autograd._profiler_enabled()


def cpu_allocations(prof) -> list[tuple[int, int, int, int]]:
    """The CPU allocation events of a finished ``torch.profiler.profile(profile_memory=True)``,
    unordered: ``(start_time_ns, is_alloc, ptr, size)`` each, ``size`` negative on a free.

    Read from ``prof.profiler.kineto_results.experimental_event_tree()`` (the source
    ``torch.profiler._memory_profiler`` uses), whose allocation events, unlike
    ``kineto_results.events()``, carry the block address.
    """
    with needed():
        from torch._C._profiler import _EventType

    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag != _EventType.Allocation:
            continue
        fields = event.extra_fields
        if fields.device.type != "cpu":
            continue
        size = int(fields.alloc_size)
        found.append((event.start_time_ns, size > 0, int(fields.ptr), size))
    return found


def mark_dynamic_up_to(t: torch.Tensor, dim: int, maximum: int) -> None:
    """Mark ``t``'s dimension ``dim`` symbolic for dynamo, from 2 (dynamo keeps 0 and 1
    static) up to ``maximum``: traced once for every size in that range, which its guards
    then check. torch 2.13 refuses a ``max`` without a ``min``."""
    torch._dynamo.mark_dynamic(t, dim, min=2, max=maximum)


def declared_maxima(value) -> dict[int, int]:
    """Per dimension of ``value`` marked dynamic with a maximum (``mark_dynamic(..., max=)``,
    by remat or by the user), that maximum: dynamo keeps the marks on the tensor, which a
    backend is handed as an example input."""
    ranges = getattr(value, "_dynamo_dynamic_range", None) or ()
    return {r.dim: r.max for r in ranges if r.max is not None}
