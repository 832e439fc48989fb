"""Host memory of the disk offload engine: zero-copy byte views of raw addresses, page aligned
buffers to read into, and the pool of page-locked buffers that stage CUDA copies."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import threading
from typing import Any

import torch

from lightning_gradhooks.offload._common import _ALIGN, _round_up

_PINNED_GRANULE = 1 << 20  # pinned host buffers are pooled by size rounded up to this

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MMAP_THRESHOLD_MIN, _MMAP_THRESHOLD_MAX = 1 << 20, 32 << 20  # glibc caps it at 32 MiB on 64-bit
_mmap_threshold: int | None = None  # what this module set, process-wide


def _fix_mmap_threshold(threshold_bytes: int) -> int | None:
    """On glibc, fix malloc's mmap threshold at ``threshold_bytes`` (within 1 to 32 MiB) unless the
    user chose one (``MALLOC_MMAP_THRESHOLD_`` or a ``glibc.malloc.mmap_threshold`` tunable); return
    the threshold set by this module, or None. Says so in one INFO line when it sets it.

    glibc's default threshold is dynamic: once a large block is freed, blocks of that size come from
    the heap, which keeps the memory that offload frees early, so the process's peak does not fall.
    A fixed threshold maps every block of at least that size on its own and unmaps it when freed.
    Process-wide and kept after the engine closes (glibc has no way back to its dynamic threshold);
    only ever lowered. Cost: a fresh block is page-faulted in at each allocation instead of reused
    from the heap (about +10 % on an allocation-heavy CPU step, see docs/offload.md)."""
    global _mmap_threshold
    value = min(max(threshold_bytes, _MMAP_THRESHOLD_MIN), _MMAP_THRESHOLD_MAX)
    if (not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ
            or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")):
        return None
    if _mmap_threshold is not None and _mmap_threshold <= value:
        return _mmap_threshold
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no such knob
            return None
        if not libc.mallopt(_M_MMAP_THRESHOLD, value):
            return None
    except (OSError, AttributeError):
        return None
    _mmap_threshold = value
    logging.getLogger("lightning_gradhooks.offload").info(
        "save_on_disk: set glibc's mmap threshold to %d bytes for this process (mallopt(M_MMAP_THRESHOLD)), so "
        "that the memory of offloaded CPU tensors goes back to the system; it stays set after offload ends and "
        "costs about +10%% on allocation-heavy CPU work; fix_mmap_threshold=False (GradHooks: "
        "offload_fix_mmap_threshold=False) leaves the allocator alone", value)
    return value


def _buffer(address: int, nbytes: int) -> memoryview:
    """A zero-copy byte view of ``nbytes`` of host memory; the caller keeps the owner alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _host_buffer(nbytes: int) -> torch.Tensor:
    """A CPU byte tensor of ``nbytes`` over a fresh anonymous mapping: it uses huge pages where Linux
    allows, and is unmapped as soon as the tensor dies, so reads back do not grow the heap."""
    mapping = mmap.mmap(-1, _round_up(nbytes, _ALIGN), flags=mmap.MAP_PRIVATE)  # shared = shmem, no THP
    with contextlib.suppress(AttributeError, OSError):  # MADV_HUGEPAGE is Linux only
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


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
