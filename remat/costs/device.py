"""Device specs and the roofline time model.

``estimate_seconds`` is ``max(flops / peak, bytes_moved / bandwidth, random numbers /
rate)`` plus a fixed per-op launch overhead. Matmul/conv/attention flops come from torch's
own ``flop_registry`` and use the device's matmul (tensor-core) peak for their dtype;
every other op counts one flop per element (the bytes term dominates for those on every
device modelled, so the flop estimate rarely matters). The figures and their sources:
docs/cost-model.md, "Time model: the roofline".
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from remat.passes._torch_compat import OpOverload, op_schema
from remat.passes.rng import APPLY_DROPOUT_MASK
from remat.passes.sizes import hint

from ._fx import arg_value, input_nodes, meta_val, tensors_of
from .flags import random_numbers
from .graph import (
    bytes_moved,
    flop_formula,
    flops,
    is_kernel,
    is_pointwise,
    is_view,
    output_bytes,
)

__all__ = ["DeviceSpec", "estimate_seconds", "fused_seconds"]

aten = torch.ops.aten


# Datasheet peaks (fp32 non-tensor FLOP/s, tf32 tensor FLOP/s, bf16/fp16 tensor FLOP/s,
# bytes/s of HBM/GDDR), matched by substring of torch.cuda.get_device_properties().name:
# first match wins, so more specific names come first. Sources: docs/cost-model.md,
# "GPU table".
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

# CPU figures: docs/cost-model.md, "CPU roofline".
_CPU_FLOPS_PER_THREAD = 5e10  # what eager matmuls reach: half an AVX2 core's fp32 peak
_CPU_BANDWIDTH = 2e10  # a typical STREAM figure for the channels a few cores drive
_CPU_LAUNCH = 5e-6  # per-op eager cost: python and the dispatcher
# mt19937 draws one number per element, far slower than a pointwise op; GPUs draw inside
# the kernel (Philox), so their specs have no random term.
_CPU_RANDOM_PER_SECOND = 1.2e8
_CUDA_LAUNCH = 6e-6  # per-op eager cost, kernel launch included


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
    # measured (dtype, ((inner side, FLOP/s), ...)) of matmuls (``calibration``)
    matmul_sides: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    # measured (dtype, inner side, FLOP/s) of attention's batched matmuls (``calibration``):
    # a batched matmul runs at ``matmul_sides``' rate scaled as this one is at its side
    batched_matmul: tuple[tuple[str, int, float], ...] = ()
    random_per_second: float = math.inf  # random numbers drawn per second
    # measured (output bytes, bytes moved per second) of a pointwise kernel writing a fresh
    # output, ascending (``calibration``); empty: ``bandwidth`` at every size
    stream: tuple[tuple[int, float], ...] = ()
    # bytes moved per second by pointwise kernels over a float and a bool: arithmetic,
    # selection (``masked_fill``, ``where``), a cast; measured (``calibration``), else no
    # slower than any kernel
    mixed_rate: float = math.inf
    select_rate: float = math.inf
    cast_rate: float = math.inf
    # elements per second of a transcendental function (exp): softmax's and gelu's roof
    transcendental_rate: float = math.inf
    # elements per second of ``tanh`` (GPT-2's gelu), which CPU kernels evaluate below
    # ``exp``'s rate; measured (``calibration``), else ``transcendental_rate``
    tanh_rate: float = math.inf
    # elements per second of remat's dropout replay (``passes.rng.apply_dropout_mask``)
    # on a random mask read cold; measured (``calibration``), else priced as its kernels
    replay_rate: float = math.inf
    # elements per second of ``_safe_softmax``'s mask kernels (``_other_kernels_seconds``);
    # measured (``calibration``), else their bytes at the stream rate
    softmax_mask_rate: float = math.inf
    cpu: bool = False  # whose kernels: some ops run other kernels on CPU than on GPUs

    def stream_rate(self, nbytes: float) -> float:
        """Bytes moved per second by a kernel writing ``nbytes``: ``stream`` interpolated
        in log size (held flat past its ends), else ``bandwidth``. By output size, since
        a fresh output is where the cliffs are (on CPU, page faults past 32 MiB)."""
        return _interpolated(self.stream, nbytes) if self.stream else self.bandwidth

    def matmul_rate(
        self, dtype: torch.dtype | None, side: int | None, *, batched: bool = False
    ) -> float:
        """FLOP/s of a matmul in ``dtype`` whose smallest dimension is ``side``: the
        measured ``matmul_sides`` interpolated in log side (flat past their ends), else
        the peak. ``batched`` (``bmm``): times the measured batched matmul's rate over the
        single one's at its side, where measured."""
        key = str(dtype).removeprefix("torch.")
        rates = dict(self.matmul_sides).get(key)
        if side is None or not rates:
            return self.matmul_peak(dtype)
        rate = _interpolated(rates, side)
        measured = {name: (at, r) for name, at, r in self.batched_matmul}.get(key)
        if batched and measured:
            at, batched_rate = measured
            rate *= batched_rate / _interpolated(rates, at)
        return rate

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
                cpu=True,
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


def _interpolated(points: tuple[tuple[int, float], ...], x: float) -> float:
    """``points`` (ascending x, y) interpolated at ``x`` in log x, flat past their ends."""
    xs = [n for n, _ in points]
    k = bisect.bisect_left(xs, x)
    if k == 0:
        return points[0][1]
    if k == len(xs):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)


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


def _compute_dtype(node: fx.Node) -> torch.dtype | None:
    for i in input_nodes(node):
        ts = tensors_of(meta_val(i))
        if ts and ts[0].is_floating_point():
            return ts[0].dtype
    ts = tensors_of(meta_val(node))
    return ts[0].dtype if ts else None


def estimate_seconds(node: fx.Node, spec: DeviceSpec) -> float:
    """Roofline time: max(flops / peak, bytes_moved / bandwidth, random numbers / rate)
    + launch overhead.

    0 for placeholders, get_attr, output, getitem, views and pure SymInt arithmetic,
    which launch no kernel. Matmul-class ops use the tensor-core peak of their dtype.
    """
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0.0
    if not is_kernel(node):
        return 0.0
    if node.target is APPLY_DROPOUT_MASK:
        return _apply_dropout_mask_seconds(node, spec)
    f = flops(node)
    if flop_formula(node.target):
        batched = node.target in _BATCHED_MATMULS
        peak = spec.matmul_rate(_compute_dtype(node), _smallest_side(node), batched=batched)
    else:
        peak = spec.peak_flops
    drawing = random_numbers(node) / spec.random_per_second
    moved = bytes_moved(node)
    rate = spec.stream_rate(output_bytes(node))
    if _mixes_dtypes(node):
        if node.target in _SELECTORS:
            rate = min(rate, spec.select_rate)
        elif node.target in _CASTS:
            rate = min(rate, spec.cast_rate)
        elif is_pointwise(node):
            rate = min(rate, spec.mixed_rate)
    computing = _transcendentals(node) / _transcendental_rate(node, spec)
    own = max(f / peak, moved / rate, drawing, computing) + spec.launch_overhead
    return own + _other_kernels_seconds(node, spec)


def _other_kernels_seconds(node: fx.Node, spec: DeviceSpec) -> float:
    """The kernels an op runs besides the one its bytes and flops describe:

    - ``_safe_softmax`` (torch's attention softmax with a mask; a composite on every
      device): ``isneginf`` over its input, ``all`` over the softmax dimension, then
      ``where`` over the output, at their measured rate (about 14 bytes moved per
      float32 element, at the stream rate, where not measured).
    - ``native_dropout_backward`` on CPU: ``grad * mask`` (the mixed-dtype kernel its
      bytes describe), then ``* scale``, a second pass over the output at the stream
      rate.
    """
    if node.target is aten._safe_softmax.default:
        elements = sum(hint(t.numel()) for t in tensors_of(meta_val(node)))
        if spec.softmax_mask_rate < math.inf:
            return elements / spec.softmax_mask_rate + 3 * spec.launch_overhead
        # isneginf reads the input and writes bools, all reads them, where reads the
        # softmax and writes the output
        out = output_bytes(node)
        moved = (out + elements) + elements + 2 * out
        return moved / spec.stream_rate(out) + 3 * spec.launch_overhead
    if spec.cpu and node.target is aten.native_dropout_backward.default:
        out = output_bytes(node)
        return 2 * out / spec.stream_rate(out) + spec.launch_overhead
    return 0.0


def _transcendental_rate(node: fx.Node, spec: DeviceSpec) -> float:
    if node.target is aten.tanh.default and spec.tanh_rate < math.inf:
        return spec.tanh_rate
    return spec.transcendental_rate


# pointwise ops whose bool input selects rather than enters the arithmetic, and casts:
# each has its own measured rate (``calibration._two_dtype_rates``)
_SELECTORS = frozenset(
    (
        aten.masked_fill.Scalar,
        aten.masked_fill.Tensor,
        aten.masked_fill_.Scalar,
        aten.masked_fill_.Tensor,
        aten.where.self,
        aten.where.ScalarOther,
        aten.where.ScalarSelf,
        aten.where.Scalar,
    )
)
_CASTS = frozenset((aten._to_copy.default, aten.copy_.default, aten.copy.default))
# ops that evaluate a transcendental function per output element (exp, erf, tanh, log):
# on CPU they run at the measured ``exp`` rate, below their bytes' (softmax: 3x)
_TRANSCENDENTAL = frozenset(
    (
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "log2",
        "tanh",
        "tanh_backward",
        "sigmoid",
        "sigmoid_backward",
        "erf",
        "erfc",
        "erfinv",
        "gelu",
        "gelu_backward",
        "silu",
        "silu_backward",
        "mish",
        "softplus",
        "elu",
        "_softmax",
        "_safe_softmax",
        "_log_softmax",
        "sin",
        "cos",
        "pow",
        "rsqrt",
        "sqrt",
    )
)


_MATMULS = frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default))
_BATCHED_MATMULS = frozenset((aten.bmm.default, aten.baddbmm.default))


def _smallest_side(node: fx.Node) -> int | None:
    """The smallest dimension of a matmul (``_MATMULS``): its two matrices' last two
    dimensions; None for other matmul-class ops (convolution, attention)."""
    if node.target not in _MATMULS:
        return None
    operands = [t for i in input_nodes(node) for t in tensors_of(meta_val(i)) if t.dim() >= 2]
    sides = [hint(d) for t in operands[-2:] for d in t.shape[-2:]]
    return min(sides) if sides else None


def _transcendentals(node: fx.Node) -> int:
    """Elements ``node`` evaluates a transcendental function for: its outputs', if its op
    is one (``_TRANSCENDENTAL``) and not ``pow`` by an exponent ATen multiplies out."""
    target = node.target
    if not isinstance(target, OpOverload) or target.__name__.split(".")[0] not in _TRANSCENDENTAL:
        return 0
    if target is aten.pow.Tensor_Scalar:
        if arg_value(node, op_schema(target), "exponent") in _MULTIPLIED_OUT:
            return 0
    return sum(hint(t.numel()) for t in tensors_of(meta_val(node)))


# ``pow`` exponents ATen's CPU and CUDA kernels compute by multiplying (x*x, x*x*x, 1/x,
# 1/(x*x)): as fast as an add; other exponents evaluate ``exp`` and ``log``
# (docs/cost-model.md, "Calibration")
_MULTIPLIED_OUT = frozenset((2, 3, -1, -2))


def _apply_dropout_mask_seconds(node: fx.Node, spec: DeviceSpec) -> float:
    """remat's dropout replay at its measured rate; else priced as the three kernels it
    runs (``passes/rng.apply_dropout_mask``): the bool mask cast into the output (two
    dtypes), then ``* x`` and ``* scale`` in place."""
    out = output_bytes(node)
    mask = sum(hint(t.numel()) for t in tensors_of(meta_val(node)))  # one byte per element
    if spec.replay_rate < math.inf:
        return mask / spec.replay_rate + 3 * spec.launch_overhead
    cast = (mask + out) / min(spec.stream_rate(out), spec.cast_rate)
    multiplies = 5 * out / spec.stream_rate(out)  # read out and x, write; read, write
    return cast + multiplies + 3 * spec.launch_overhead


def _mixes_dtypes(node: fx.Node) -> bool:
    """Whether ``node``'s tensor inputs hold more than one dtype."""
    return len({t.dtype for i in input_nodes(node) for t in tensors_of(meta_val(i))}) > 1


def fused_seconds(node: fx.Node, spec: DeviceSpec) -> float:
    """A pointwise op's time inside a fused kernel: its flops alone. Its output is never
    written nor read back and it launches nothing; what it reads, its fused consumer would
    have read in its place (docs/cost-model.md, "Step time")."""
    return flops(node) / spec.peak_flops
