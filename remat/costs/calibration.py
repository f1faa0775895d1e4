"""The roofline's figures measured on the machine that runs the step, not read off a
datasheet: what a matmul reaches in each dtype the graph computes in (alone, and batched
as attention runs it), what a pointwise kernel streams at each size (caches, and on CPU
the page faults of fresh outputs), what an op costs to launch, and how fast the CPU draws
random numbers.

Each figure is the median of three rounds, each the median of a few timed runs of one
small kernel, a few seconds in all on one CPU thread; the plan cache keeps them per
machine (``machine_key``), so a process with the cache on measures once per machine and
torch release. Why calibrate, and the figures against the datasheet ones:
docs/cost-model.md, "Calibration".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import torch

try:
    import resource  # page faults, where the platform counts them (not on Windows)
except ImportError:
    resource = None

from remat.passes._torch_compat import plain_dispatch
from remat.passes.rng import apply_dropout_mask

from .device import DeviceSpec
from .measured import concrete_device, timed_runs

aten = torch.ops.aten

__all__ = ["calibrated", "enabled", "figures_source", "machine_key", "measure"]

# A change to what is measured or how: older entries in the cache are measured again.
VERSION = 7
# Output sizes a pointwise kernel is timed at: from within a core's cache to past the
# last level and (on CPU) glibc's 32 MiB mmap threshold, where fresh outputs page-fault.
CPU_SIZES = tuple(2**k for k in (18, 20, 22, 24, 26, 28))
CUDA_SIZES = tuple(2**k for k in (20, 22, 24, 26, 28, 30))
# the inner sides of the matmuls timed: a matmul whose smallest dimension is small (an
# attention head's 64) runs below the rate of a large one (docs/cost-model.md)
MATMUL_SIDES = {"cpu": (64, 128, 256, 512), "cuda": (64, 256, 1024, 4096)}
# a batched matmul timed as attention runs it: heads of (SEQ x HEAD) @ (HEAD x SEQ), and
# the scores times the values; its operands and outputs pass the caches, where the single
# matmul's stay in them (docs/cost-model.md, "Calibration")
ATTENTION = {"heads": 16, "seq": 512, "head": 64}
RUNS = 5  # timed runs per figure, after one untimed
# whole calibrations made, each figure the median of theirs: a slow spell of a shared
# machine moves every figure timed in it, so one round of three it lasts is outvoted
# (docs/cost-model.md, "Figures that stay put")
ROUNDS = 3
RETRIES = 10  # on CPU, runs more where runs faulted pages in (see ``_typical_seconds``)
FAULT_SLACK = 16  # pages a run may fault that are the interpreter's, not the kernel's output
MIXED_ELEMENTS = 1 << 22  # a dropout-sized activation
# bytes: a block glibc maps, whose free raises its mmap threshold to its size; under the
# 32 MiB cap with its header (a 32 MiB block raised nothing), see ``measure``
ALLOCATOR_WARMUP = 31 << 20
SCORE_ROW = 512  # an attention score row's length: a sequence
REPLAY_MASKS = 4  # masks the replay is timed over: past a core's caches, few to draw
DROPOUT_KEEP = 0.9  # the keep probability drawn: CPU's bernoulli_ runs 2x slower at 0.5


def enabled() -> bool:
    """Off with ``REMAT_CALIBRATE=0``: the datasheet's figures, the same plans on every
    machine of a kind (docs/cost-model.md, "Calibration")."""
    return os.environ.get("REMAT_CALIBRATE", "1").strip().lower() not in ("0", "false", "off", "no")


def figures_source() -> str:
    """Whose figures an estimate made now uses: "calibrated" or "datasheet"."""
    return "calibrated" if enabled() else "datasheet"


def machine_key(device: torch.device) -> str:
    """What the figures depend on: the device model, the CPU model and thread count, the
    torch release and ``VERSION``."""
    parts = [
        DeviceSpec.for_device(device).name,
        platform.machine(),
        _cpu_model(),
        str(torch.get_num_threads()),
        torch.__version__,
        str(VERSION),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def calibrated(
    device: torch.device,
    dtypes: Iterable[torch.dtype],
    stored: Callable[[str, Callable[[], dict]], dict] | None = None,
) -> DeviceSpec:
    """``device``'s roofline with measured figures for ``dtypes``' matmuls; ``stored(key,
    build)`` reads figures kept under ``key`` or builds and keeps them (the plan cache),
    else they are measured once per process."""
    device = concrete_device(device)
    names = tuple(sorted({_name(d) for d in dtypes}))
    key = f"{machine_key(device)}-{'-'.join(names)}"
    build = functools.partial(_figures, str(device), names)
    figures = build() if stored is None else stored(key, build)
    return _spec(device, figures)


@functools.cache
def _figures(device: str, dtypes: tuple[str, ...]) -> dict:
    """The figures, measured on the caller's thread, where the step's kernels run (a
    fresh thread timed thin matmuls slower), with dispatch as outside the compile that
    calls this (docs/cost-model.md, "Calibration")."""
    with plain_dispatch(), torch.no_grad():
        return measure(torch.device(device), [getattr(torch, d) for d in dtypes])


def measure(device: torch.device, dtypes: Iterable[torch.dtype]) -> dict:
    """The figures, timed now: matmul FLOP/s per dtype (single, and batched as attention
    runs them), pointwise FLOP/s, streaming bytes/s by output bytes (fresh outputs, as
    eager allocates them), bytes/s reading a value back from memory, bytes/s of pointwise
    kernels over two dtypes, elements/s of a transcendental function (``exp``, and
    ``tanh`` apart), elements/s of remat's dropout replay and of ``_safe_softmax``'s mask,
    seconds per launch, random numbers per second (CPU). Each the median of ``ROUNDS``
    rounds (``_round``); ``seconds`` is what they took."""
    start = time.perf_counter()
    # glibc maps a fresh block (page faults on every touch) for any allocation above a
    # threshold that rises to the largest mapped block freed, up to 32 MiB: a step's frees
    # raise it, so the allocator is measured as a step leaves it, not as a new process has it
    if device.type == "cpu":
        torch.empty(ALLOCATOR_WARMUP, dtype=torch.uint8).fill_(0)  # freed at once
    pool = torch.ones(max(_sizes(device)) // 4, device=device)  # past every cache
    dtypes = tuple(dtypes)
    figures = _median_figures([_round(pool, dtypes) for _ in range(ROUNDS)])
    figures["seconds"] = time.perf_counter() - start
    return figures


def _median_figures(rounds: list):
    """Figure by figure, the median of the rounds' figures (dicts and lists of them alike,
    ``None`` where a device has no such figure)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {name: _median_figures([r[name] for r in rounds]) for name in first}
    if isinstance(first, list):
        return [_median_figures(list(same)) for same in zip(*rounds, strict=True)]
    return None if first is None else statistics.median(rounds)


def _round(pool: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> dict:
    """One round of every figure, timed one after another, reading cold from ``pool``."""
    device = pool.device
    return {
        "matmul": {_name(d): _matmul_rates(pool, d) for d in dtypes},
        "batched": {_name(d): _batched_rate(pool, d) for d in dtypes},
        "pointwise": _in_cache_rate(device, lambda x: x.mul_(1.0)),
        "stream": [[n, _stream_rate(n, pool)] for n in _sizes(device)],
        "read": _read_rate(pool),
        **_two_dtype_rates(pool),
        "transcendental": _in_cache_rate(device, torch.exp),
        "tanh": _in_cache_rate(device, torch.tanh),
        "replay": _replay_rate(pool),
        "softmax mask": _softmax_mask_rate(pool),
        "launch": _launch_seconds(device),
        "random": _random_rate(device) if device.type == "cpu" else None,
    }


def _spec(device: torch.device, figures: dict) -> DeviceSpec:
    base = DeviceSpec.for_device(device)
    random = figures.get("random")
    return dataclasses.replace(
        base,
        name=f"{base.name}, calibrated",
        peak_flops=figures["pointwise"],
        bandwidth=figures["read"],
        launch_overhead=figures["launch"],
        matmul_peaks=tuple(
            sorted({**dict(base.matmul_peaks), **_peaks(figures["matmul"])}.items())
        ),
        matmul_sides=tuple(
            (dtype, tuple((int(n), float(r)) for n, r in rates))
            for dtype, rates in sorted(figures["matmul"].items())
        ),
        batched_matmul=tuple(
            (dtype, ATTENTION["head"], float(rate))
            for dtype, rate in sorted(figures["batched"].items())
        ),
        random_per_second=base.random_per_second if random is None else random,
        mixed_rate=figures["mixed"],
        select_rate=figures["select"],
        cast_rate=figures["cast"],
        transcendental_rate=figures["transcendental"],
        tanh_rate=figures["tanh"],
        replay_rate=figures["replay"],
        softmax_mask_rate=figures["softmax mask"],
        stream=tuple((int(n), float(r)) for n, r in figures["stream"]),
    )


# ----------------------------------------------------------------------------- timing


def _typical_seconds(
    run: Callable[[], object], device: torch.device, *, fresh_output: bool = False
) -> float:
    """The median of ``RUNS`` timed runs after one untimed: a step meets its kernels at
    their typical speed, and the median moves less between processes than the fastest
    run, which a short quiet or busy spell of a shared machine decides.

    On CPU, of runs that faulted no pages in: whether an output lands on pages the process
    already holds depends on what it freed before, not on the kernel, and a run that
    faults them in takes several times as long (docs/cost-model.md, "Calibration"). With
    ``fresh_output`` (an output above glibc's mmap threshold, mapped afresh every time)
    the faults are the kernel's cost and count."""
    if fresh_output or device.type != "cpu" or resource is None:
        return statistics.median(timed_runs(run, device, RUNS, warmup=1))
    run()
    clean, faulted = [], []
    while len(clean) < RUNS and len(clean) + len(faulted) < RUNS + RETRIES:
        before = _minor_faults()
        seconds = timed_runs(run, device, 1, warmup=0)[0]
        (faulted if _minor_faults() - before > FAULT_SLACK else clean).append(seconds)
    return statistics.median(clean or faulted)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _matmul_rates(pool: torch.Tensor, dtype: torch.dtype) -> list[list[float]]:
    """[side, FLOP/s] of matmuls in ``dtype`` whose inner dimension is ``side`` and whose
    others are the largest side (an attention head's (512 x 64) @ (64 x 512)), ascending.
    Each run multiplies another pair of slices of ``pool``: inputs read cold, as a step's
    matmuls read what earlier kernels wrote."""
    sides = MATMUL_SIDES.get(pool.device.type, MATMUL_SIDES["cuda"])
    m = sides[-1]
    source = pool if pool.dtype == dtype else pool.to(dtype)
    warm = source[: m * m].view(m, m)
    for _ in range(RUNS):  # the math library's first calls in a process run slower
        warm @ warm
    rates = []
    for k in sides:
        pairs = source[: source.numel() // (2 * m * k) * (2 * m * k)].view(-1, 2, m * k)
        products = (a.view(m, k) @ b.view(k, m) for a, b in itertools.cycle(pairs))
        rates.append([k, 2 * m * m * k / _typical_seconds(lambda p=products: next(p), pool.device)])
    return rates


def _batched_rate(pool: torch.Tensor, dtype: torch.dtype) -> float:
    """FLOP/s of attention's two batched matmuls in ``dtype`` (``ATTENTION``): the queries
    times the keys, writing the scores, and the scores times the values, reading them;
    operands sliced from ``pool``, read cold."""
    h, n, d = ATTENTION["heads"], ATTENTION["seq"], ATTENTION["head"]
    parts = [h * n * d] * 3 + [h * n * n]
    source = pool[: sum(parts)].to(dtype)  # a view where ``dtype`` is pool's
    q, k, v, scores = source.split(parts)
    q, k, v, scores = q.view(h, n, d), k.view(h, d, n), v.view(h, n, d), scores.view(h, n, n)
    seconds = _typical_seconds(lambda: torch.bmm(q, k), pool.device)
    seconds += _typical_seconds(lambda: torch.bmm(scores, v), pool.device)
    return 2 * (2 * h * n * n * d) / seconds


def _peaks(matmul: dict[str, list]) -> dict[str, float]:
    return {dtype: max(rate for _, rate in rates) for dtype, rates in matmul.items()}


def _in_cache_rate(device: torch.device, op: Callable[[torch.Tensor], object]) -> float:
    """Elements per second of ``op(x)`` on a tensor that stays in cache: a pointwise
    kernel's flops (one an element), or a function whose evaluation, not its bytes, bounds
    it (``exp``, ``tanh``: docs/cost-model.md)."""
    x = torch.ones(2**16, device=device)
    return x.numel() / _typical_seconds(lambda: op(x), device)


def _stream_rate(nbytes: int, pool: torch.Tensor) -> float:
    """Bytes moved per second by ``x + 1`` into a fresh output of ``nbytes``, each run's
    ``x`` another slice of ``pool``: read cold, as a step reads what an earlier kernel
    wrote long before (a warm input streams up to 2x faster)."""
    count = max(1, pool.numel() * 4 // nbytes)
    inputs = pool[: count * (nbytes // 4)].view(count, -1) if count > 1 else pool.view(1, -1)
    slices = itertools.cycle(inputs)
    fresh = nbytes > ALLOCATOR_WARMUP
    return 2 * nbytes / _typical_seconds(lambda: next(slices) + 1, pool.device, fresh_output=fresh)


def _read_rate(pool: torch.Tensor) -> float:
    """Bytes per second reading a value that is no longer in any cache: what a saved
    value costs the backward that reads it back."""
    return pool.numel() * 4 / _typical_seconds(pool.sum, pool.device)


def _two_dtype_rates(pool: torch.Tensor) -> dict[str, float]:
    """Bytes moved per second by pointwise kernels over a float and a bool mask: the
    arithmetic (``x * mask``, as dropout's backward runs), a selection
    (``masked_fill``) and a cast (``mask.to(float)``, as dropout's replay runs). CPU
    kernels convert element by element there, 3-10x slower than ``x * y``."""
    n = MIXED_ELEMENTS
    mask = torch.ones(n, dtype=torch.bool, device=pool.device)
    x, device = pool[:n], pool.device
    return {
        "mixed": (4 + 1 + 4) * n / _typical_seconds(lambda: x * mask, device),
        "select": (4 + 1 + 4) * n / _typical_seconds(lambda: x.masked_fill(mask, 0.0), device),
        "cast": (1 + 4) * n / _typical_seconds(lambda: mask.to(torch.float32), device),
    }


def _replay_rate(pool: torch.Tensor) -> float:
    """Elements per second of remat's dropout replay (``apply_dropout_mask``: a cast and
    two multiplies) on a random mask of a dropout-sized activation, read cold with its
    input as a step's backward reads them."""
    n = MIXED_ELEMENTS
    count = max(1, pool.numel() // n)
    inputs = pool[: count * n].view(count, n)
    generator = torch.Generator(pool.device).manual_seed(0)  # the run's stream untouched
    draw = functools.partial(torch.rand, n, generator=generator, device=pool.device)
    masks = [draw() < DROPOUT_KEEP for _ in range(REPLAY_MASKS)]
    pairs = itertools.cycle(zip(inputs, itertools.cycle(masks)))
    return n / _typical_seconds(
        lambda: apply_dropout_mask(*next(pairs), 1 / DROPOUT_KEEP), pool.device
    )


def _softmax_mask_rate(pool: torch.Tensor) -> float:
    """Elements per second of what ``_safe_softmax`` (attention's softmax under a mask)
    runs besides its softmax: its time less ``_softmax``'s, over rows of an attention
    score's length (512), read cold: those kernels run far below their bytes' rate."""
    n = MIXED_ELEMENTS
    rows = itertools.cycle(pool[: (pool.numel() // n) * n].view(-1, n // SCORE_ROW, SCORE_ROW))

    def seconds(op) -> float:
        return _typical_seconds(lambda: op(next(rows), -1), pool.device)

    softmax = seconds(functools.partial(aten._softmax, half_to_float=False))
    mask = seconds(aten._safe_softmax) - softmax
    return n / max(mask, softmax / 100)  # never free, should the two times meet


def _launch_seconds(device: torch.device) -> float:
    x = torch.zeros(1, device=device)
    return _typical_seconds(lambda: [x + 1 for _ in range(100)], device) / 100


def _random_rate(device: torch.device) -> float:
    x = torch.empty(2**20, device=device)
    generator = torch.Generator(device).manual_seed(0)  # the run's random stream untouched
    return x.numel() / _typical_seconds(
        lambda: x.bernoulli_(DROPOUT_KEEP, generator=generator), device
    )


# ----------------------------------------------------------------------------- helpers


def _sizes(device: torch.device) -> tuple[int, ...]:
    return CPU_SIZES if device.type == "cpu" else CUDA_SIZES


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
