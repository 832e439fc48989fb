"""Disk offload of tensors saved for backward: :class:`save_on_disk`.

``save_on_disk`` is a :class:`torch.autograd.graph.saved_tensors_hooks`, like torch's
``save_on_cpu``. Inside its ``with`` block every tensor that autograd saves for the backward
pass and that spans at least ``threshold_bytes`` of storage is handed to a background writer
thread and replaced by a small handle; its memory is released as soon as it is on disk. The
backward pass reads it back, prefetching in reverse order of saving. Smaller tensors,
parameters and views of parameters stay in memory. Pure PyTorch: no Lightning import.

One engine serves many steps. Create it once, enter it once per step (entering the same
object again is supported: ``saved_tensors_hooks`` just pushes and pops the hooks), and close
it at the end (it is also closed at interpreter exit)::

    offload = save_on_disk(threshold_bytes=1 << 20, directory="/scratch")
    for x, y in batches:
        with offload:                 # one step: one file (or more, see segment_bytes)
            loss = loss_fn(model(x), y)
        loss.backward()               # may run inside or outside the with block
        optimizer.step()
    offload.close()

Each step's tensors are appended to one file that never has a name (``O_TMPFILE``, else created
and unlinked at once), closed as soon as that step's graph is freed: the kernel gives the space
back however the process ends, even on SIGKILL.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_gradhooks.summary.checks import check_bool, check_folder, check_int
from lightning_gradhooks.offload._common import DiskOffloadError, OffloadStats
from lightning_gradhooks.offload.engine import Engine

__all__ = ["DiskOffloadError", "OffloadStats", "save_on_disk"]


class save_on_disk(saved_tensors_hooks):  # noqa: N801 - named like torch's save_on_cpu
    """Context manager that offloads large tensors saved for backward to disk.

    Under the context, a saved tensor spanning at least ``threshold_bytes`` of storage is
    queued for a background writer thread that appends its raw bytes to the current step's
    file and then drops the engine's reference, so its memory is freed once written (under
    ``budget_bytes``, only the oldest that do not fit in the budget are). The
    forward pass waits only when ``max_bytes_in_flight`` bytes are queued (backpressure).
    During backward the first unpack of a tensor starts reading the tensors saved before it,
    in reverse order, up to ``prefetch_bytes`` ahead. Results are bitwise identical to
    running without the context, and a saved tensor changed in place after it was saved is
    refused at unpack with autograd's ``RuntimeError`` (torch skips that check whenever
    saved-tensor hooks are set; this engine makes it for every saved tensor). Metadata (dtype, shape, strides, offsets) stays in memory;
    files hold raw bytes only and are never unpickled.

    Not offloaded: parameters and other leaves that require grad, views of those, tensors of
    modules given to :meth:`keep_in_memory`, tensor subclasses, non-strided, conjugate or
    negative-bit tensors, and devices other than CPU and CUDA. Views saved twice share one
    written region (per step). CUDA tensors are copied to reused pinned host buffers on a
    side stream and read back the same way.

    On glibc Linux, the first CPU tensor offloaded fixes malloc's mmap threshold at
    ``threshold_bytes`` (clamped to 1-32 MiB; process-wide and for the rest of the process,
    unless ``MALLOC_MMAP_THRESHOLD_`` is set or ``fix_mmap_threshold=False``; one INFO line of
    the ``lightning_gradhooks.offload`` logger says so), so that the memory of written tensors
    goes back to the system: with glibc's dynamic default the heap keeps it and offload does
    not lower the process's peak. It costs about +10 % on later allocation-heavy CPU work (see
    docs/offload.md). CUDA tensors never touch it.

    Args:
        threshold_bytes: offload a saved tensor if the storage region it spans has at least
            this many bytes.
        directory: an existing folder in which the unnamed files are opened; ``None`` uses the
            system temporary folder. Nothing in it is ever visible by name (see docs/offload.md).
        max_bytes_in_flight: bytes queued for writing before the forward pass waits (32 MiB:
            a write overlaps the next layer's compute, and the forward never runs far ahead
            of the disk holding what it has not written yet).
        prefetch_bytes: bytes read ahead of need during backward (at least one tensor);
            0 disables prefetching.
        segment_bytes: a step's file is closed and a new one started past this size, so
            space is returned sooner when a context spans many steps.
        budget_bytes: hold at most this many bytes of offloadable saved tensors (at least
            ``threshold_bytes``, not parameters) at any moment, plus the one being saved:
            tensors kept in memory, writes in flight and reads ahead together. The newest stay
            in memory (backward needs them first) and the oldest are written; reads ahead wait
            for room. Inputs the caller still holds (tensors not computed by the graph, such
            as the batch) are not counted and not written under a budget: writing them would
            free nothing. ``None``: every offloadable tensor is written.
        fix_mmap_threshold: on glibc Linux, fix malloc's mmap threshold (see above) at the first
            CPU tensor offloaded; False leaves the allocator alone (offload then lowers the peak
            only where the allocator gives freed memory back).

    Raises:
        ValueError: an argument has the wrong type or is out of range (naming it, what is
            accepted and the value received).
        DiskOffloadError: at construction, the folder is missing or cannot hold an unnamed file
            (the message names the folder and the reason); later, a write or read fails (full
            disk, I/O error, short read), naming the folder, the bytes and the record, raised from
            the original error: in the forward pass, at the latest at the first unpack or when
            the context exits (a read error: at the unpack that needs the tensor). Any other
            error in the engine's threads closes the engine: every later use raises it, naming
            the thread.
        RuntimeError: at unpack, a saved tensor was changed in place since it was saved (as
            autograd raises without hooks).

    Warns:
        UserWarning: once, when the folder's free space is less than two steps' offloaded bytes
            (at construction: less than twice ``max_bytes_in_flight``), naming the folder, the
            bytes free and the bytes needed.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
        >>> offload = save_on_disk(threshold_bytes=64 << 10)
        >>> with offload:
        ...     loss = model(torch.randn(512, 256)).square().sum()
        >>> loss.backward()
        >>> offload.stats().bytes_offloaded > 0
        True
        >>> offload.close()
    """

    def __init__(
        self,
        threshold_bytes: int,
        directory: str | os.PathLike[str] | None = None,
        *,
        max_bytes_in_flight: int = 32 << 20,
        prefetch_bytes: int = 32 << 20,
        segment_bytes: int = 1 << 30,
        budget_bytes: int | None = None,
        fix_mmap_threshold: bool = True,
    ) -> None:
        check_int("threshold_bytes", threshold_bytes, minimum=0)
        check_int("max_bytes_in_flight", max_bytes_in_flight)
        check_int("prefetch_bytes", prefetch_bytes, minimum=0)
        check_int("segment_bytes", segment_bytes)
        check_int("budget_bytes", budget_bytes, allow_none=True)
        check_bool("fix_mmap_threshold", fix_mmap_threshold)
        directory = check_folder("directory", directory, pathlike=True) or tempfile.gettempdir()
        self._engine = Engine(threshold_bytes, directory, max_bytes_in_flight, prefetch_bytes, segment_bytes,
                              budget_bytes, fix_mmap_threshold)
        self._depth = 0
        super().__init__(self._engine.pack, self._engine.unpack)

    def __enter__(self) -> save_on_disk:  # type: ignore[override]
        if self._depth == 0:
            self._engine.begin_step()
        pack = self.pack_hook
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(pack, self.unpack_hook)
        except BaseException:  # e.g. a KeyboardInterrupt just after the push: leave no hooks behind
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if self._depth == 0 and top is not None and top[0] is pack:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            raise
        self._depth += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *args: object) -> None:
        self._depth -= 1  # before the pop: an interrupt after it leaves a consistent depth
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if self._depth == 0:
            self._engine.end_step(raise_error=exc_type is None)

    @property
    def active(self) -> bool:
        """Whether the hooks are on (inside the ``with`` block)."""
        return self._depth > 0

    @property
    def directory(self) -> str:
        """The folder (absolute path) in which this engine's unnamed files live."""
        return self._engine.folder

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._engine.closed

    def stats(self) -> OffloadStats:
        """Return a snapshot of the engine's memory, disk and traffic counters."""
        return self._engine.stats()

    def flush(self) -> None:
        """Wait until every queued write is on disk and every dead handle's file is closed; raise a
        pending write error."""
        self._engine.flush()

    def keep_in_memory(self, *modules: nn.Module) -> None:
        """Never offload tensors sharing storage with these modules' parameters or buffers."""
        for module in modules:
            if not isinstance(module, nn.Module):
                raise TypeError(f"expected torch.nn.Module, got {type(module).__name__}")
        self._engine.keep_in_memory(modules)

    def close(self) -> None:
        """Stop the threads and close every file (their space is returned). Idempotent.

        Graphs still holding offloaded tensors can no longer run backward afterwards.
        """
        self._engine.close()

    def __repr__(self) -> str:
        budget = "" if self._engine.budget is None else f", budget_bytes={self._engine.budget}"
        return f"save_on_disk(threshold_bytes={self._engine.threshold}, directory={self.directory!r}{budget})"
