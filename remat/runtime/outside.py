"""Memory a training step's own code holds between remat's programs: a loss computed on
the returned logits, the glue at a graph break. ``OutsideMemory`` counts it while the
step runner has it on the dispatch mode stack, so the step is planned with it."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from remat.passes._torch_compat import (
    TorchDispatchMode,
    current_dispatch_mode,
    push_dispatch_mode,
)
from remat.storages import StorageCounter, fresh


class OutsideMemory(StorageCounter):
    """Bytes of the storages code outside remat's programs allocates during a recorded
    step, live and at their peak. On only between remat's programs (``active``); a storage
    is counted until it dies (``StorageCounter``). ``ignore_compile_internals``: dynamo
    compiles and runs graphs under it (it does not fall back to eager as it does for other
    dispatch modes)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.peak = 0
        # storages resized outside the dispatcher (``watch``): key -> (storage, bytes it
        # had when first watched, were it not allocated in the step)
        self.resized: dict[int, tuple[weakref.ref, int]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # dynamo compiling a frame mid-step (fake tensors, example inputs) is not the step
        counting = self.active and not torch.compiler.is_compiling()
        if counting:
            self._resync()
        out = func(*args, **(kwargs or {}))
        if counting:
            for t in fresh(args, kwargs, out, _real):
                self._track(t)
            self.peak = max(self.peak, self.level)
        return out

    def adopt(self, t: torch.Tensor) -> int:
        """Count ``t``'s storage from now on, as if code outside had allocated it (a
        gradient a program returned: ``remat.handed``); the bytes newly counted."""
        nbytes = self._track(t)
        self.peak = max(self.peak, self.level)
        return nbytes

    def watch(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count ``tensors``' storages by their size from now on: FSDP2 frees and
        re-allocates unsharded parameters by resizing their storages, which no dispatch
        mode sees. A storage allocated before the step counts what it grows past its size
        now; one allocated in the step counts all it holds."""
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.resized and self.resized[key][0]() is storage:
                continue
            if key not in self.live:
                self.live[key] = 0
                weakref.finalize(storage, self._freed, key)
                base = storage.nbytes()
            else:
                base = 0
            self.resized[key] = (weakref.ref(storage), base)
        self._resync()

    def _resync(self) -> None:
        """Bring the watched storages' bytes to their sizes now."""
        for key, (ref, base) in self.resized.items():
            storage = ref()
            if storage is None or key not in self.live:
                continue
            nbytes = max(storage.nbytes() - base, 0)
            self.level += nbytes - self.live[key]
            self.live[key] = nbytes
        self.peak = max(self.peak, self.level)

    def forget(self, tensors: Sequence) -> None:
        """Stop counting ``tensors`` (a backward's tangents: its problem counts them)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._freed(t.untyped_storage()._cdata)

    def section(self) -> tuple[int, int]:
        """A program starts: the level live through it and the peak since the last one."""
        if self.active:
            self._resync()
        self.active = False
        level, peak, self.peak = self.level, self.peak, self.level
        return level, max(peak, level)

    def split_peak(self) -> int:
        """The peak since the last program started or the last split, counted anew from
        the level now: what was live at most before a moment and what after it."""
        peak, self.peak = max(self.peak, self.level), self.level
        return peak

    def resume(self) -> None:
        self.peak = self.level
        self.active = True

    def stop(self) -> None:
        """The step ended: inactive, it passes calls through until the next call of the
        compiled function pops it (``StepRunner.entering``)."""
        self.active = False


def _real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta


def push_if_not_top(mode: TorchDispatchMode) -> None:
    if current_dispatch_mode() is not mode:
        push_dispatch_mode(mode)
