"""Shared by the disk offload modules: the public error and statistics types of
:mod:`lightning_gradhooks.offload` (defined here so that the engine's parts can raise and return them
without importing that module; re-exported from there), the failures that threads hand to the
training thread, the alignment constant and the marker that stops a thread."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ALIGN", "STOP", "DiskOffloadError", "Failure", "OffloadStats", "failure", "raise_failure", "round_up"]

ALIGN = 4096  # file offset alignment of each saved region
STOP = object()  # put in a thread's queue: the thread finishes

# An error for the training thread, kept without traceback or frames: its class, its arguments and
# the exception that caused it (its traceback dropped), which it is raised from.
Failure = tuple[type[BaseException], tuple[Any, ...], BaseException]


class DiskOffloadError(OSError):
    """The offload folder cannot hold an unnamed file, or a write or read failed.

    ``errno`` is the operating system's error number (``errno.ENOSPC`` for a full disk,
    ``errno.EFBIG`` over a file size limit); the message names the folder and the bytes
    attempted.
    """

    __module__ = "lightning_gradhooks.offload"  # where users import it from


@dataclasses.dataclass(frozen=True)
class OffloadStats:
    """A snapshot of a :class:`save_on_disk` engine, from :meth:`save_on_disk.stats`."""

    __module__ = "lightning_gradhooks.offload"  # where users import it from

    directory: str  #: the folder in which the (unnamed) files live
    bytes_in_memory: int  #: offloadable tensors held by the engine: kept under the budget, pending writes, read ahead
    bytes_pending_write: int  #: handed to the writer, not yet on disk
    bytes_prefetched: int  #: read back (or being read) ahead of the backward pass
    bytes_offloaded: int  #: handed to the writer since construction (after deduplication)
    bytes_written: int  #: written since construction (a tensor used up before its turn is not)
    bytes_read: int  #: total read back since construction
    bytes_on_disk: int  #: size of the files open now (they have no name)
    files_on_disk: int  #: number of files open now
    tensors_offloaded: int  #: storage regions written (after deduplication)
    tensors_deduplicated: int  #: saves answered by a region already written
    tensors_kept: int  #: saves left in memory (small, parameters, unsupported)
    bytes_parked: int = 0  #: offloadable tensors kept in memory under the budget (the newest saves)
    bytes_in_memory_peak: int = 0  #: high-water mark of ``bytes_in_memory`` since construction
    budget_bytes: int | None = None  #: the engine's budget (None: every offloadable tensor is written)


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def failure(exc: BaseException, message: str) -> Failure:
    """``exc``, caught in a thread, as the error the training thread raises: a DiskOffloadError whose
    message ends with the reason, keeping ``errno``, raised from ``exc``. The tracebacks of ``exc`` and
    of what it chains are dropped: their frames hold the engine and its buffers."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    if isinstance(exc, OSError) and exc.errno is not None:
        return DiskOffloadError, (exc.errno, f"{message}: {exc.strerror or exc}"), exc
    return DiskOffloadError, (f"{message}: {type(exc).__name__}: {exc}",), exc


def raise_failure(kept: Failure) -> None:
    cls, args, cause = kept
    raise cls(*args) from cause
