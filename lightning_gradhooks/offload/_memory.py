"""Host memory of the disk offload engine: zero-copy byte views of raw addresses, page aligned
buffers to read into, and the pool of page-locked buffers that stage CUDA copies."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from typing import Any

import torch

from lightning_gradhooks.offload._common import _ALIGN, _round_up

_PINNED_GRANULE = 1 << 20  # pinned host buffers are pooled by size rounded up to this


def _buffer(address: int, nbytes: int) -> memoryview:
    """A zero-copy byte view of ``nbytes`` of host memory; the caller keeps the owner alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _host_buffer(nbytes: int, skip: int = 0) -> tuple[torch.Tensor, int]:
    """A CPU byte tensor of ``nbytes`` at ``skip`` bytes into a fresh anonymous mapping, and the
    mapping's address. The mapping is page aligned (as O_DIRECT needs), uses huge pages where
    Linux allows, and is unmapped as soon as the tensor dies, so reads do not fragment the heap."""
    mapping = mmap.mmap(-1, _round_up(skip + nbytes, _ALIGN), flags=mmap.MAP_PRIVATE)  # shared = shmem, no THP
    with contextlib.suppress(AttributeError, OSError):  # MADV_HUGEPAGE is Linux only
        mapping.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=skip), address


class _PinnedPool:
    """Page-locked host buffers reused across CUDA copies, pooled by rounded size."""

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._capacity = capacity

    def get(self, nbytes: int) -> torch.Tensor:
        size = _round_up(nbytes, _PINNED_GRANULE)
        with self._lock:
            for i, (buf, event) in enumerate(self._free):
                if buf.numel() == size and (event is None or event.query()):
                    del self._free[i]
                    return buf
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def put(self, buf: torch.Tensor, event: Any = None) -> None:
        with self._lock:
            self._free.append((buf, event))
            total = sum(b.numel() for b, _ in self._free)
            while total > self._capacity:  # torch records copy events, so freeing is safe
                total -= self._free.pop(0)[0].numel()
