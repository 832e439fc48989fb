"""Host memory of the disk offload engine: glibc's mmap threshold, zero-copy byte views of raw
addresses, buffers to read into, and the CUDA copies (staged through page-locked buffers) with the
side streams they run on."""

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

from lightning_gradhooks.offload._common import ALIGN, round_up

__all__ = ["Streams", "bytes_at", "fix_mmap_threshold", "host_buffer", "to_device", "to_pinned", "use_here"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MMAP_THRESHOLD_MIN, _MMAP_THRESHOLD_MAX = 1 << 20, 32 << 20  # glibc caps it at 32 MiB on 64-bit
_mmap_threshold: int | None = None  # what this module set, process-wide


def fix_mmap_threshold(threshold_bytes: int) -> None:
    """On glibc, fix malloc's mmap threshold at ``threshold_bytes`` (within 1 to 32 MiB) unless the
    user chose one (``MALLOC_MMAP_THRESHOLD_`` or a ``glibc.malloc.mmap_threshold`` tunable); the
    threshold set is kept in ``_mmap_threshold``. Says so in one INFO line when it sets it.

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
        return
    if _mmap_threshold is not None and _mmap_threshold <= value:
        return
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no such knob
            return
        if not libc.mallopt(_M_MMAP_THRESHOLD, value):
            return
    except (OSError, AttributeError):
        return
    _mmap_threshold = value
    logging.getLogger("lightning_gradhooks.offload").info(
        "save_on_disk: set glibc's mmap threshold to %d bytes for this process (mallopt(M_MMAP_THRESHOLD)), so "
        "that the memory of offloaded CPU tensors goes back to the system; it stays set after offload ends and "
        "costs about +10%% on allocation-heavy CPU work; fix_mmap_threshold=False (GradHooks: "
        "offload_fix_mmap_threshold=False) leaves the allocator alone", value)


def bytes_at(address: int, nbytes: int) -> memoryview:
    """A zero-copy byte view of ``nbytes`` of host memory; the caller keeps the owner alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def host_buffer(nbytes: int) -> torch.Tensor:
    """A CPU byte tensor of ``nbytes`` over a fresh anonymous mapping: it uses huge pages where Linux
    allows, and is unmapped as soon as the tensor dies, so reads back do not grow the heap."""
    mapping = mmap.mmap(-1, round_up(nbytes, ALIGN), flags=mmap.MAP_PRIVATE)  # shared = shmem, no THP
    with contextlib.suppress(AttributeError, OSError):  # MADV_HUGEPAGE is Linux only
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


# -- CUDA: the only device-specific code of the engine. A CUDA tensor is copied to a pinned host
# buffer on a side stream and written from there; read back into a pinned buffer and copied to the
# device on the side stream. Pinned buffers come from torch's caching host allocator: pinned during
# the first steps (which synchronises), reused after; it keeps a buffer until the copies recorded
# on it are done, so a buffer dropped early is never reused under a running copy.


class Streams:
    """The CUDA side streams of one engine, one per device, made at first use: the copies to and from
    pinned host buffers run on them. Their one owner (torch frees a stream with its last reference)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}

    def of(self, device: torch.device) -> Any:
        """The side stream of ``device``."""
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]


def to_pinned(src: torch.Tensor, stream: Any) -> tuple[torch.Tensor, Any]:
    """Start copying the CUDA byte tensor ``src`` to a new pinned host buffer on the side ``stream``,
    after the work queued so far on the caller's current stream (which computed ``src``); return the
    buffer and the event that marks the copy done."""
    pinned = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(src.device))  # the caller's stream: read before switching
    with torch.cuda.stream(stream):
        pinned.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    src.record_stream(stream)  # the caching allocator keeps src's memory until the copy is done
    return pinned, event


def to_device(pinned: torch.Tensor, device: torch.device, stream: Any) -> tuple[torch.Tensor, Any]:
    """Start copying the pinned host bytes to a new tensor of ``device`` on the side ``stream``; return it
    and the event that marks the copy done (see :func:`use_here`)."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        buf = torch.empty(pinned.numel(), dtype=torch.uint8, device=device)  # allocated on the side stream
        buf.copy_(pinned, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return buf, event


def use_here(buf: torch.Tensor, event: Any) -> None:
    """Make the current stream (the backward's) wait for ``buf``'s copy, and tell the caching allocator
    that ``buf``, allocated on the side stream, is used on it."""
    stream = torch.cuda.current_stream(buf.device)
    stream.wait_event(event)
    buf.record_stream(stream)
