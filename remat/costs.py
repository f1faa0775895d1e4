"""Per-node cost model for an AOTAutograd joint graph.

Pure functions over ``torch.fx`` nodes whose ``meta["val"]`` holds FakeTensors (or a
tuple/list of them, a SymInt, or None). No global state: everything is read off the node,
its op schema and its fake metadata.

Memory model (what the planner and the simulator may rely on)
-------------------------------------------------------------
* ``output_bytes(n)``: bytes of the tensors ``n``'s value refers to (``numel * itemsize``,
  summed over tuple outputs; aliases are not deduplicated).
* ``aliased_input(n)``: the input node whose storage ``n``'s output shares at runtime, or
  None when ``n`` returns fresh memory. Follow it repeatedly to reach the storage owner.
* ``allocated_bytes(n)``: bytes that come into existence when ``n`` runs. A multi-output op
  (``native_layer_norm``, ``native_dropout``) allocates all its fresh outputs at once, so
  the tuple node carries the allocation; each ``getitem`` of it allocates 0 but is *not* an
  alias: it owns its own storage of ``output_bytes(getitem)`` bytes, which can outlive its
  siblings. Outputs nobody reads (no getitem) die right after the op. Counting the bytes on
  both the tuple node and the getitems would double count; counting them only on the
  getitems would miss that the outputs coexist with the op's inputs while it runs.

Time model
----------
``estimate_seconds`` is a roofline: ``max(flops / peak, bytes_moved / bandwidth)`` plus a
fixed per-op launch overhead. Matmul/conv/attention flops come from torch's own
``flop_registry``; every other op counts one flop per element (the bytes term dominates
for those on every device we model, so the flop estimate rarely matters). ``profile_seconds``
replaces the estimate by measurements on the real device.

Private torch APIs used (check on a torch upgrade): ``torch._ops`` (OpOverload,
HigherOrderOperator), ``torch.utils.flop_counter.flop_registry`` / ``shape_wrapper``,
``torch.fx.experimental.symbolic_shapes.optimization_hint``,
``torch._library.utils._RANDOM_FUNCTIONS``, ``StorageWeakRef``.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

import remat.passes.rng  # noqa: F401  (registers remat::dropout_mask, read below)
from remat.passes._torch_compat import storage_of

log = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = [
    "DeviceSpec",
    "ProfileResult",
    "aliased_input",
    "allocated_bytes",
    "bytes_moved",
    "estimate_seconds",
    "flops",
    "has_side_effects",
    "is_random",
    "output_bytes",
    "profile_seconds",
]


# --------------------------------------------------------------------------------------
# Device specs
# --------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) peaks from NVIDIA's public datasheets, SXM parts unless the name
# says otherwise: (fp32 non-tensor FLOP/s, tf32 tensor FLOP/s, bf16/fp16 tensor FLOP/s,
# bytes/s of HBM/GDDR). Matched by substring of torch.cuda.get_device_properties().name,
# first match wins, so more specific names come first. B200 figures are approximate
# (derived from HGX B200 8-GPU totals).
_GPU_TABLE: tuple[tuple[str, float, float, float, float], ...] = (
    ("GH200", 67e12, 494.5e12, 989.5e12, 4.0e12),
    ("H200 NVL", 60e12, 417.5e12, 835.5e12, 4.8e12),
    ("H200", 67e12, 494.5e12, 989.5e12, 4.8e12),
    ("H100 PCIe", 51e12, 378e12, 756.5e12, 2.0e12),
    ("H100 NVL", 60e12, 417.5e12, 835.5e12, 3.9e12),
    ("H100", 67e12, 494.5e12, 989.5e12, 3.35e12),
    ("B200", 75e12, 1.125e15, 2.25e15, 8.0e12),
    ("A100", 19.5e12, 156e12, 312e12, 2.0e12),  # 40 GB parts: 1.555e12, fixed up below
    ("L40S", 91.6e12, 183e12, 362e12, 864e9),
    ("L40", 90.5e12, 90.5e12, 181e12, 864e9),
    ("L4", 30.3e12, 60e12, 121e12, 300e9),
    ("A10", 31.2e12, 62.5e12, 125e12, 600e9),  # also matches A10G (slightly slower)
    ("RTX 4090", 82.6e12, 82.6e12, 165.2e12, 1.008e12),
    ("RTX 3090", 35.6e12, 35.6e12, 71e12, 936e9),
    ("V100", 15.7e12, 15.7e12, 125e12, 900e9),  # no bf16 tensor cores: fp16 figure
    ("T4", 8.1e12, 8.1e12, 65e12, 320e9),
)
# Unknown GPU: deliberately conservative (roughly a T4/V100-class card).
_GPU_DEFAULT = (1e13, 1e13, 5e13, 5e11)

# CPU: an AVX2 core does 2 FMA x 8 fp32 lanes = 32 FLOP/cycle, ~96 GFLOP/s at 3 GHz; eager
# matmuls reach about half of that, hence 5e10 per thread. 2e10 B/s is a typical STREAM
# figure for the memory channels a few cores can drive.
_CPU_FLOPS_PER_THREAD = 5e10
_CPU_BANDWIDTH = 2e10
# Per-op eager cost (python + dispatcher, kernel launch on CUDA): a few microseconds.
_CPU_LAUNCH = 5e-6
# CPU random numbers (mt19937, one per element: dropout masks, bernoulli, rand): a
# Bernoulli draw of 4M floats took 33 ms on one Xeon thread here, 6x what the roofline
# charges a pointwise op that size. GPUs draw inside the kernel (Philox): no extra term.
_CPU_RANDOM_PER_SECOND = 1.2e8
_CUDA_LAUNCH = 6e-6


@dataclass(frozen=True)
class DeviceSpec:
    """Roofline parameters of one device.

    ``peak_flops`` is the non-tensor-core (vector) fp32 peak, used for pointwise work.
    ``matmul_peaks`` maps dtype names to the peak for matmul/conv/attention in that dtype
    (tensor cores on GPUs); dtypes missing from it use ``peak_flops``.
    """

    name: str
    peak_flops: float
    bandwidth: float
    launch_overhead: float
    matmul_peaks: tuple[tuple[str, float], ...] = ()
    random_per_second: float = math.inf  # random numbers drawn per second

    def matmul_peak(self, dtype: torch.dtype | None) -> float:
        """Peak FLOP/s of a matmul-class op computing in ``dtype``."""
        key = str(dtype).removeprefix("torch.")
        for name, peak in self.matmul_peaks:
            if name == key:
                return peak
        return self.peak_flops

    @staticmethod
    def for_device(device: str | torch.device) -> DeviceSpec:
        """Spec for ``device``: a datasheet table for known GPUs, conservative otherwise."""
        dev = torch.device(device)
        if dev.type == "cpu":
            threads = max(1, torch.get_num_threads())
            return DeviceSpec(
                name=f"cpu ({threads} threads)",
                peak_flops=_CPU_FLOPS_PER_THREAD * threads,
                bandwidth=_CPU_BANDWIDTH,
                launch_overhead=_CPU_LAUNCH,
                random_per_second=_CPU_RANDOM_PER_SECOND,
            )
        if dev.type == "cuda":
            return _cuda_spec(dev)
        fp32, _, half, bw = _GPU_DEFAULT
        return DeviceSpec(
            name=f"{dev.type} (unknown, conservative)",
            peak_flops=fp32,
            bandwidth=bw,
            launch_overhead=_CUDA_LAUNCH,
            matmul_peaks=(("bfloat16", half), ("float16", half)),
        )


def _cuda_spec(dev: torch.device) -> DeviceSpec:
    """Look the GPU up by name; fp32 matmuls use TF32 peak only if torch allows TF32."""
    name, total_mem = "cuda (unknown)", None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(
            dev.index if dev.index is not None else torch.cuda.current_device()
        )
        name, total_mem = props.name, props.total_memory
    fp32, tf32, half, bw = _GPU_DEFAULT
    for key, *row in _GPU_TABLE:
        if key in name:
            fp32, tf32, half, bw = row
            if key == "A100" and total_mem is not None and total_mem < 60 * 2**30:
                bw = 1.555e12
            break
    else:
        name = f"{name} (not in table, conservative)"
    fp32_mm = tf32 if torch.get_float32_matmul_precision() != "highest" else fp32
    return DeviceSpec(
        name=name,
        peak_flops=fp32,
        bandwidth=bw,
        launch_overhead=_CUDA_LAUNCH,
        matmul_peaks=(("float32", fp32_mm), ("bfloat16", half), ("float16", half)),
    )


# --------------------------------------------------------------------------------------
# Small helpers over fake values
# --------------------------------------------------------------------------------------


def _hint(x: Any) -> int:
    """Concrete int for an int or SymInt (its optimisation hint; 8192 for unbacked)."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(x, fallback=8192))
    return int(x)


def _tensors(val: Any) -> list[torch.Tensor]:
    """The tensors in a node value (a tensor, or a tuple/list possibly holding None)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return _hint(t.numel()) * t.element_size()


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel really reads from ``t``: broadcast (stride-0) dims count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        size = _hint(size)
        if size == 0:
            return 0
        if _hint(stride) != 0:
            n *= size
    return n * t.element_size()


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_storage(a: StorageWeakRef | None, b: StorageWeakRef | None) -> bool:
    return a is not None and b is not None and a.cdata == b.cdata


def _schema(target: Any) -> torch.FunctionSchema | None:
    return getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None


def _arg_value(node: fx.Node, schema: torch.FunctionSchema, name: str) -> Any:
    """Value passed for schema argument ``name`` (positional, keyword or default)."""
    for i, arg in enumerate(schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and i < len(node.args):
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        return arg.default_value if arg.has_default_value() else None
    return None


def _input_nodes(node: fx.Node) -> Iterator[fx.Node]:
    """Distinct fx.Node inputs, in argument order."""
    seen: set[fx.Node] = set()
    for a in tree_flatten((node.args, node.kwargs))[0]:
        if isinstance(a, fx.Node) and a not in seen:
            seen.add(a)
            yield a


# --------------------------------------------------------------------------------------
# Aliasing and bytes
# --------------------------------------------------------------------------------------

# Ops whose schema has no alias annotation but whose kernel returns its input's storage.
# _unsafe_view: verified with data_ptr (tests): it is `view` minus autograd view tracking,
# which is why AOT emits it after `clone` when decomposing a non-viewable reshape. Only
# consulted when the node has no fake metadata; otherwise fake storages decide.
_RUNTIME_ALIAS_OPS = frozenset({"aten::_unsafe_view"})


def _schema_alias_arg(node: fx.Node, ret_index: int | None) -> tuple[Any, bool] | None:
    """(argument value, is_write) that return ``ret_index`` aliases per the schema.

    ``ret_index=None`` asks about any return (single-output ops). A ``Tensor(a)[]`` return
    (split, unbind, chunk) has its alias set on the list elements, so its before_set is
    empty; it then aliases the one annotated argument.
    """
    schema = _schema(node.target)
    if schema is None:
        return None
    rets = list(schema.returns)
    if len(rets) == 1:
        ret_index = 0
    if ret_index is None or ret_index >= len(rets):
        return None
    info = rets[ret_index].alias_info
    if info is None:
        return None
    annotated = [a for a in schema.arguments if a.alias_info is not None]
    for arg in annotated:
        if info.before_set and info.before_set & arg.alias_info.before_set:
            return _arg_value(node, schema, arg.name), info.is_write
    if not info.before_set and len(annotated) == 1:
        return _arg_value(node, schema, annotated[0].name), info.is_write
    return None


def _alias_of(node: fx.Node, op_node: fx.Node, ret_index: int | None) -> fx.Node | None:
    """Input of ``op_node`` that ``node`` (its output, or a getitem of it) shares storage with.

    Fake tensors record storage sharing exactly as the kernels do at runtime, so they are
    the arbiter when present: they veto schema aliases that copy at runtime (reshape or
    contiguous of a non-viewable input) and find unannotated aliases (_unsafe_view).
    """
    out_storage = storage_of(_val(node))
    claim = _schema_alias_arg(op_node, ret_index)
    if claim is not None and isinstance(claim[0], fx.Node):
        base = claim[0]
        base_storage = storage_of(_val(base))
        if out_storage is None or base_storage is None or _same_storage(out_storage, base_storage):
            return base
        return None
    if out_storage is not None:
        for inp in _input_nodes(op_node):
            if _same_storage(storage_of(_val(inp)), out_storage):
                return inp
        return None
    schema = _schema(op_node.target)
    if schema is not None and schema.name in _RUNTIME_ALIAS_OPS and op_node.args:
        first = op_node.args[0]
        return first if isinstance(first, fx.Node) else None
    return None


def aliased_input(node: fx.Node) -> fx.Node | None:
    """Input node whose storage ``node``'s output shares at runtime, else None.

    Views (schema ``Tensor(a)`` returns: view, t, transpose, permute, expand, slice,
    select, split/unbind/chunk outputs, detach, alias, ...) alias their base; so do
    ``_unsafe_view`` (no annotation, but shares storage) and in-place/out= ops, whose
    result *is* the mutated tensor (``Tensor(a!)``): none of them allocate. A getitem of a
    multi-output op aliases that op's input only when the op returns views (split), never
    the tuple node itself: outputs of native_layer_norm/native_dropout are fresh tensors.
    """
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent, index = node.args[0], node.args[1]
        if not isinstance(parent, fx.Node) or parent.op != "call_function":
            return None
        return _alias_of(node, parent, index if isinstance(index, int) else None)
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    if isinstance(_val(node), (list, tuple)):
        # split/unbind/chunk: the list is views of the input; other multi-output ops are
        # decided per getitem.
        if not _is_view(node):
            return None
        claim = _schema_alias_arg(node, 0)
        return claim[0] if claim is not None and isinstance(claim[0], fx.Node) else None
    return _alias_of(node, node, None)


def _is_view(node: fx.Node) -> bool:
    """A free op: it only builds new tensor metadata over an input's storage.

    In-place ops alias their input too but do work, so they are not views.
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    schema = _schema(node.target)
    if schema is None or schema.is_mutable:
        return False
    if isinstance(_val(node), (list, tuple)):
        # split/unbind/chunk: every tensor output is a view of the (single) input.
        rets = schema.returns
        return bool(rets) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in rets
        )
    return aliased_input(node) is not None


def output_bytes(node: fx.Node) -> int:
    """Bytes of the tensors ``node`` returns (numel * itemsize, summed over tuple outputs).

    0 for SymInts, None and other non-tensor values. A view reports the size it spans,
    not the size of its base's storage.
    """
    return sum(_nbytes(t) for t in _tensors(_val(node)))


def allocated_bytes(node: fx.Node) -> int:
    """Bytes newly allocated when ``node`` runs.

    0 for placeholders/get_attr (resident before the step), aliases, getitems (the
    multi-output op they index allocated them) and view multi-output ops (split);
    otherwise the bytes of the fresh outputs.
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    val = _val(node)
    if isinstance(val, (list, tuple)):
        if _is_view(node):
            return 0
        total = 0
        for i, t in enumerate(val):
            if isinstance(t, torch.Tensor):
                claim = _schema_alias_arg(node, i)
                if claim is None or not isinstance(claim[0], fx.Node):
                    total += _nbytes(t)
        return total
    if aliased_input(node) is not None:
        return 0
    return output_bytes(node)


# Ops that read only the rows an index selects: reading the whole source would overcharge
# an embedding lookup by the size of the vocabulary.
_GATHER_OPS = frozenset(
    {"aten::embedding", "aten::index_select", "aten::gather", "aten::index", "aten::take"}
)


def bytes_moved(node: fx.Node) -> int:
    """Bytes read (distinct elements of tensor inputs) plus bytes written (outputs).

    Views, getitems and non-op nodes move nothing. Gather-like ops read at most as many
    source bytes as they write. An in-place op with no tensor return writes its mutated
    arguments.
    """
    if node.op != "call_function" or node.target is operator.getitem or _is_view(node):
        return 0
    if not _is_kernel(node):
        return 0
    written = output_bytes(node)
    schema = _schema(node.target)
    reads = 0
    gather = schema is not None and schema.name in _GATHER_OPS
    for i, inp in enumerate(_input_nodes(node)):
        for t in _tensors(_val(inp)):
            b = _distinct_bytes(t)
            reads += min(b, written) if gather and i == 0 else b
    if written == 0 and schema is not None and schema.is_mutable:
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += sum(
                    _nbytes(t) for t in _tensors(_val(_arg_value(node, schema, arg.name)))
                )
    return reads + written


# --------------------------------------------------------------------------------------
# Flops and time
# --------------------------------------------------------------------------------------


def _mv_flops(a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _addmv_flops(c, a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _dot_flops(a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _addbmm_flops(c, a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a) * b[-1]


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    """Formulas torch's flop_registry lacks: CPU flash attention, mv/dot/addmv/addbmm."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    extra: dict[Any, Callable[..., int]] = {
        aten.mv: shape_wrapper(_mv_flops),
        aten.addmv: shape_wrapper(_addmv_flops),
        aten.dot: shape_wrapper(_dot_flops),
        aten.addbmm: shape_wrapper(_addbmm_flops),
    }
    # The CPU kernels take (q, k, v, ...) / (grad_out, q, k, v, ...) first, like the flash
    # ops whose formulas only read those leading shapes.
    for cpu_name, flash in (
        ("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            aten._scaled_dot_product_flash_attention_backward,
        ),
    ):
        packet = getattr(aten, cpu_name, None)
        if packet is not None and flash in flop_registry:
            extra[packet] = flop_registry[flash]
    return extra


@functools.cache
def _formula(target: Any) -> Callable[..., int] | None:
    from torch.utils.flop_counter import flop_registry

    key = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    try:
        f = flop_registry.get(key)
    except TypeError:  # unhashable target
        return None
    return f if f is not None else _extra_formulas().get(key)


def _is_kernel(node: fx.Node) -> bool:
    """Whether ``node`` launches real work.

    Not a kernel: python callables (SymInt arithmetic), ``aten::sym_*`` metadata queries,
    and ops that neither touch a tensor nor mutate anything (``_assert_scalar``).
    """
    target = node.target
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return False
    if _tensors(_val(node)):
        return True
    schema = _schema(target)
    if schema is not None:
        if schema.is_mutable:
            return True
        if schema.name.startswith("aten::sym_"):
            return False
    return any(_tensors(_val(i)) for i in _input_nodes(node))


def _matmul_flops(node: fx.Node) -> float | None:
    """torch's formula for ``node``; None when there is none or it cannot be applied."""
    formula = _formula(node.target)
    if formula is None:
        return None
    args, kwargs = tree_map(
        lambda a: _val(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs)
    )
    try:
        return float(_hint(formula(*args, **kwargs, out_val=_val(node))))
    except Exception as e:  # a cost model must not abort planning: use the estimate
        log.debug("flop formula for %s failed (%s); using element count", node.name, e)
        return None


def flops(node: fx.Node) -> float:
    """Floating-point operations of ``node``.

    Matmul, conv and attention ops (forward and backward) use torch's flop_registry
    formulas on the fake shapes. Every other kernel is charged one flop per element of the
    larger of its output and its largest input: that is one per output element for
    pointwise ops and one per input element for reductions (tagged or not, e.g. the
    parameter-gradient sums of native_layer_norm_backward). Gather-like ops charge only
    their output. Views, getitems and placeholders: 0.
    """
    if node.op != "call_function" or node.target is operator.getitem or _is_view(node):
        return 0.0
    if not _is_kernel(node):
        return 0.0
    exact = _matmul_flops(node)
    if exact is not None:
        return exact
    out = sum(_hint(t.numel()) for t in _tensors(_val(node)))
    schema = _schema(node.target)
    if schema is not None and schema.name in _GATHER_OPS:
        return float(out)
    largest_in = max(
        (_hint(t.numel()) for i in _input_nodes(node) for t in _tensors(_val(i))), default=0
    )
    return float(max(out, largest_in))


def _compute_dtype(node: fx.Node) -> torch.dtype | None:
    for i in _input_nodes(node):
        ts = _tensors(_val(i))
        if ts and ts[0].is_floating_point():
            return ts[0].dtype
    ts = _tensors(_val(node))
    return ts[0].dtype if ts else None


def estimate_seconds(node: fx.Node, spec: DeviceSpec) -> float:
    """Roofline time: max(flops / peak, bytes_moved / bandwidth, random numbers / rate)
    + launch overhead.

    0 for placeholders, get_attr, output, getitem, views and pure SymInt arithmetic,
    which launch no kernel. Matmul-class ops use the tensor-core peak of their dtype.
    """
    if node.op != "call_function" or node.target is operator.getitem or _is_view(node):
        return 0.0
    if not _is_kernel(node):
        return 0.0
    f = flops(node)
    peak = spec.matmul_peak(_compute_dtype(node)) if _formula(node.target) else spec.peak_flops
    drawing = random_numbers(node) / spec.random_per_second
    return max(f / peak, bytes_moved(node) / spec.bandwidth, drawing) + spec.launch_overhead


def random_numbers(node: fx.Node) -> int:
    """Random numbers ``node`` draws: one per output element of a random op or of a
    dropout mask (``remat::dropout_mask``, which is not random to the planner: it replays)."""
    if not (is_random(node) or node.target is torch.ops.remat.dropout_mask.default):
        return 0
    return sum(_hint(t.numel()) for t in _tensors(_val(node)))


# --------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------

_HOP_RANDOM = frozenset({"run_and_save_rng_state"})


def is_random(node: fx.Node) -> bool:
    """Whether running ``node`` draws from the global RNG, so a recompute differs.

    Detected by ``torch.Tag.nondeterministic_seeded`` (native_dropout, bernoulli, rand*,
    randint, randperm, normal, uniform, ...). Attention kernels carry the tag for their
    dropout; with ``dropout_p == 0`` they draw nothing and are not random. Functionalised
    RNG (``rngprims.philox_rand``, ``run_with_rng_state``) takes its seed as an input and
    replays exactly, so it is not random; ``run_and_save_rng_state`` draws fresh state.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name() in _HOP_RANDOM
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded not in target.tags:
            return False
        schema = target._schema
        if any(a.name == "dropout_p" for a in schema.arguments):
            p = _arg_value(node, schema, "dropout_p")
            return not (isinstance(p, (int, float)) and p == 0)
        return True
    # Python-level torch.rand & co. (torch IR graphs, not aten joint graphs).
    import torch._library.utils as lib_utils

    return target in getattr(lib_utils, "_RANDOM_FUNCTIONS", ())


_ASSERT_OPS = frozenset(
    {
        "aten::_assert_async",
        "aten::_assert_scalar",
        "aten::_assert_tensor_metadata",
        "aten::_functional_assert_async",
        "aten::_functional_assert_scalar",
        "aten::sym_constrain_range",
        "aten::sym_constrain_range_for_size",
        "aten::_functional_sym_constrain_range",
        "aten::_functional_sym_constrain_range_for_size",
    }
)
_COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "symm_mem"}
)


def _is_assert(target: Any) -> bool:
    schema = _schema(target)
    if schema is not None:
        return schema.name in _ASSERT_OPS
    return target is torch._assert


def _is_collective(target: Any) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace in _COLLECTIVE_NAMESPACES
    return (getattr(target, "__module__", None) or "").startswith("torch.distributed")


# Backward kernels of fused RNNs: they read a buffer their forward kernel wrote in the
# library's own layout (offsets, sizes), which synthetic inputs cannot fake: on them
# mkldnn_rnn_layer_backward crashed the process (an nn.LSTM, allow_rnn). Never run alone:
# their memory is the outputs' nominal bytes, their time the roofline estimate.
_OPAQUE_BUFFER_OPS = frozenset(
    {"aten::mkldnn_rnn_layer_backward", "aten::_cudnn_rnn_backward", "aten::miopen_rnn_backward"}
)


def _reads_opaque_buffer(target: Any) -> bool:
    schema = _schema(target)
    return schema is not None and schema.name in _OPAQUE_BUFFER_OPS


# Ops that update running stats in place although their schema declares no mutation
# (non-functionalised graphs only; AOT's joint graph uses the *_functional variants),
# with the argument that turns the update on.
_RUNNING_STATS_OPS = {
    "aten::native_batch_norm": "training",
    "aten::cudnn_batch_norm": "training",
    "aten::miopen_batch_norm": "training",
    "aten::_batch_norm_impl_index": "training",
    "aten::batch_norm": "training",
    "aten::instance_norm": "use_input_stats",
}


def _mutates_running_stats(node: fx.Node) -> bool:
    schema = _schema(node.target)
    flag = _RUNNING_STATS_OPS.get(schema.name) if schema is not None else None
    if flag is None:
        return False
    return (
        _arg_value(node, schema, flag) is True
        and _arg_value(node, schema, "running_mean") is not None
    )


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must run exactly once (so it may never be recomputed).

    True for mutating ops (schema ``is_mutable``, and batch-norm variants that update
    running stats without declaring it), collectives, and whatever fx's ``is_impure``
    reports (effectful ops, profiler ranges, grad-mode switches). Randomness is reported
    by ``is_random`` instead. Asserts (``_assert_async``, ``_assert_scalar``,
    ``sym_constrain_range``...) are not side effects: re-running a check is harmless.
    """
    if node.op != "call_function":
        return node.op == "call_module" and node.is_impure()
    target = node.target
    if _is_assert(target):
        return False
    if _is_collective(target):
        return True
    schema = _schema(target)
    if schema is not None and schema.is_mutable:
        return True
    if _mutates_running_stats(node):
        return True
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # older fx without impure_random
        return node.is_impure() and not is_random(node)


# --------------------------------------------------------------------------------------
# Profiling
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


def _storage_numel(t: torch.Tensor) -> int:
    sizes = [_hint(s) for s in t.shape]
    if any(s == 0 for s in sizes):
        return 0
    strides = [_hint(s) for s in t.stride()]
    return (
        _hint(t.storage_offset())
        + 1
        + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True))
    )


def _materialise(fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Real tensor with ``fake``'s shape, stride, offset and dtype on ``device``.

    Floats are standard normal, integers zero (a valid index into any non-empty
    dimension), bools runs of 64 True then 64 False. Not random bools: masks that ops
    branch on (``masked_fill``, ``where``) are causal or padding masks in practice, and
    a random mask mispredicts every other branch (``masked_fill`` of a 4x4x512x512
    tensor took 28 ms with one and 5.7 ms with a causal mask on one Xeon thread).
    """
    n = _storage_numel(fake)
    dtype = fake.dtype
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(n, dtype=dtype, device=device)
    elif dtype == torch.bool:
        base = torch.arange(n, device=device) // 64 % 2 == 0
    else:
        base = torch.zeros(n, dtype=dtype, device=device)
    sizes = [_hint(s) for s in fake.shape]
    strides = [_hint(s) for s in fake.stride()]
    return base.as_strided(sizes, strides, _hint(fake.storage_offset()))


def _real_args(node: fx.Node, place: Callable[[torch.device], torch.device]) -> tuple[tuple, dict]:
    """Concrete args for ``node``: tensors materialised where ``place`` puts them."""
    made: dict[fx.Node, Any] = {}

    def convert(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in made:
                v = _val(a)
                if isinstance(v, torch.Tensor):
                    made[a] = _materialise(v, place(v.device))
                elif isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
                    made[a] = _hint(v)
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
            return _hint(a)
        return a

    return tree_map(convert, (node.args, node.kwargs))


def _time_op(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int) -> float:
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
    return statistics.median(times)


def profile_seconds(
    gm: fx.GraphModule, device: str | torch.device, *, repeat: int = 5, warmup: int = 1
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
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    spec = DeviceSpec.for_device(dev)
    result = ProfileResult()
    # A graph traced for this device type keeps its tensors where they were (CPU seed or
    # scalar tensors stay on CPU); a graph traced elsewhere moves wholesale to ``dev``.
    traced_here = any(t.device.type == dev.type for n in gm.graph.nodes for t in _tensors(_val(n)))

    def place(d: torch.device) -> torch.device:
        return dev if not traced_here or d.type == dev.type else d

    fork_devices = [dev.index] if dev.type == "cuda" else []
    measured: dict[Any, float] = {}
    with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
        for node in gm.graph.nodes:
            if (
                node.op != "call_function"
                or node.target is operator.getitem
                or _is_view(node)
                or not _is_kernel(node)
            ):
                result[node.name] = 0.0
                continue
            if _is_collective(node.target) or _reads_opaque_buffer(node.target):
                result[node.name] = estimate_seconds(node, spec)
                result.fallbacks[node.name] = (
                    "collective: not run in isolation"
                    if _is_collective(node.target)
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
# Kernel memory (measured)
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
    predictable: on CPU convolutions unfold their input, flash attention's backward and
    batch norm's keep a buffer the size of an input, ``mse_loss`` and ``_safe_softmax`` a
    temporary, dropout a float noise tensor (a list of "kernels with scratch" missed the
    attention backward, and one model's measured peak came out 24% over its prediction).
    None for views, collectives and what is not a kernel, and for an op that cannot run
    on synthetic inputs (with a warning). ``cache`` shares results between nodes with the
    same op, shapes, strides and dtypes. Scratch is 0 where it cannot be measured now
    (``scratch_measurable``: on CPU inside a user's profiler session).
    """
    if (
        node.op != "call_function"
        or _schema(node.target) is None
        or _is_view(node)
        or not _is_kernel(node)
        or _is_collective(node.target)
    ):
        return None
    dev = torch.device(device)
    key = (node.target, _signature(node.args), _signature(node.kwargs), dev)
    if cache is not None and key in cache:
        return cache[key]
    if _reads_opaque_buffer(node.target):
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
        args, kwargs = _real_args(node, lambda _: dev)
        inputs = {storage_of(t) for t in tree_flatten((args, kwargs))[0]}
        # A measured random op must not move the generator the step's masks come from.
        fork = [dev] if dev.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=fork):
            # On CUDA a first call may allocate what later ones reuse (cuBLAS's workspace,
            # caches): resident during a training step, not this op's scratch, so it runs
            # once unmeasured. On CPU a first call measured the same as a second for all
            # 939 kernels of the six examples, and skipping it halves the time.
            if dev.type != "cpu" or not scratch_known:
                out = node.target(*args, **kwargs)
            if scratch_known:
                run = peak(lambda: node.target(*args, **kwargs), device=dev)
                out = run.result
        outputs = {storage_of(t): t for t in _tensors(out)}
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


def scratch_measurable(device: str | torch.device) -> bool:
    """Whether ``kernel_memory`` can measure scratch on ``device`` now: not on CPU while a
    profiler runs (``remat.memory.profiler_active``)."""
    from remat.memory import profiler_active

    return torch.device(device).type != "cpu" or not profiler_active()


def _signature(tree: Any) -> tuple:
    """Hashable description of fx args: tensors by shape/stride/dtype/device, others by
    value."""

    def describe(a: Any) -> Any:
        v = _val(a) if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            shape, stride = tuple(_hint(s) for s in v.shape), tuple(_hint(s) for s in v.stride())
            return (shape, stride, v.dtype, v.device)
        if isinstance(v, (list, tuple)):
            return tuple(describe(x) for x in v)
        return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)

    if isinstance(tree, dict):
        return tuple(sorted((k, describe(v)) for k, v in tree.items()))
    return tuple(describe(a) for a in tree)
