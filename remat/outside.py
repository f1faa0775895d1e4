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
    storage_key,
    tree_flatten,
)


class OutsideMemory(TorchDispatchMode):
    """Bytes of the storages code outside remat's programs allocates during a recorded
    step, live and at their peak. On only between remat's programs (``active``); a storage
    is counted until it dies (a weak reference on it). ``ignore_compile_internals``: dynamo
    compiles and runs graphs under it (it does not fall back to eager as it does for other
    dispatch modes)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.level = 0
        self.peak = 0
        self.live: dict[int, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            read = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if _real(t)}
            for t in tree_flatten(out)[0]:
                if _real(t) and storage_key(t) not in read:  # a new storage, not a view or in-place
                    self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        self.level += nbytes
        self.peak = max(self.peak, self.level)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.level -= nbytes

    def forget(self, tensors: Sequence) -> None:
        """Stop counting ``tensors`` (a backward's tangents: its problem counts them)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._freed(t.untyped_storage()._cdata)

    def section(self) -> tuple[int, int]:
        """A program starts: the level live through it and the peak since the last one."""
        self.active = False
        level, peak, self.peak = self.level, self.peak, self.level
        return level, max(peak, level)

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
