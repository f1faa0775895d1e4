"""Storages counted while they live: the bookkeeping of a dispatch mode that counts the
bytes ops allocate (``runtime.outside.OutsideMemory``, ``as_given``'s fake step)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import torch

from remat.passes._torch_compat import TorchDispatchMode, storage_key, tree_flatten


class StorageCounter(TorchDispatchMode):
    """``live``: bytes per storage counted and not yet dead (a weak reference on each);
    ``level`` their sum. Subclasses decide what to count and keep their own peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.level = 0

    def _track(self, t: torch.Tensor) -> int:
        """Count ``t``'s storage until it dies; the bytes newly counted (0 if counted)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return 0
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        self.level += nbytes
        weakref.finalize(storage, self._freed, key)
        return nbytes

    def _freed(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.level -= nbytes
            self._released(key, nbytes)

    def _released(self, key: int, nbytes: int) -> None:
        """A counted storage died (or was forgotten): a hook for subclasses."""


def fresh(args, kwargs, out, counted: Callable[[object], bool]) -> Iterator[torch.Tensor]:
    """The tensors of an op's ``out`` that ``counted`` accepts and that live in a storage
    none of its inputs does: new storages, not views or in-place results."""
    read = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if counted(t)}
    return (t for t in tree_flatten(out)[0] if counted(t) and storage_key(t) not in read)
