"""The disk offload engine behind :class:`~lightning_gradhooks.offload.save_on_disk`: a small front over
its parts, each the one owner of what it makes.

- :class:`~lightning_gradhooks.offload.gate.Gate`: the lock, closed or failed, waits for the threads;
- :class:`~lightning_gradhooks.offload.segments.Segments`: the folder and its unnamed files;
- :class:`~lightning_gradhooks.offload.ledger.Ledger`: the records' lifecycle and the bytes it holds;
- :class:`~lightning_gradhooks.offload.spill.Spill`: pack (the forward) and the hand-over to the writer;
- :class:`~lightning_gradhooks.offload.writer.Writer`: the writer thread;
- :class:`~lightning_gradhooks.offload.reader.Reader`: the reader thread (deaths, reads, read-ahead) and unpack;
- :class:`~lightning_gradhooks.offload._memory.Streams`: the CUDA side streams.

The front adds the steps, statistics, flush, close, and the process's fork and exit handlers.

Interrupt safety: a ``KeyboardInterrupt`` is raised only in the main thread, at a Python call or
loop boundary. So the main thread never opens, closes or deletes a file and never does I/O:
it takes the lock only through ``with``, hands work to the threads with a queue's C ``put`` and
waits on a fresh queue's C ``get``. A handle runs no engine code when it dies (a weak reference
whose callback is a C ``put`` tells the reader thread). Errors are kept as a class and its
arguments, and the exception that caused them without its traceback, whose frames would keep the
engine, buffers (and graphs) alive.

A failed read, write or file creation fails its record (and a write its step); the engine goes on.
Anything else raised in a thread closes the engine, which then raises that error, naming the thread,
wherever it is used: a thread never dies silently, and no wait outlives the threads.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from lightning_gradhooks.offload._common import OffloadStats
from lightning_gradhooks.offload._files import close_all
from lightning_gradhooks.offload._memory import Streams
from lightning_gradhooks.offload.gate import Gate
from lightning_gradhooks.offload.ledger import Ledger
from lightning_gradhooks.offload.reader import Reader
from lightning_gradhooks.offload.segments import Segments
from lightning_gradhooks.offload.spill import Spill
from lightning_gradhooks.offload.writer import Writer

__all__ = ["Engine"]

_ENGINES: set[weakref.ref[Engine]] = set()  # engines whose threads run: for fork handling and exit


class Engine:
    """One :class:`save_on_disk`'s files, threads and records. Graphs that need the engine keep it alive
    (autograd holds :meth:`unpack`); once it is collected, its writer thread stops, and the reader
    thread closes the files."""

    def __init__(self, threshold: int, directory: str, max_in_flight: int, prefetch_bytes: int,
                 segment_bytes: int, budget: int | None = None, fix_mmap_threshold: bool = True) -> None:
        self.threshold, self.budget = threshold, budget
        self.folder = os.path.abspath(directory)
        self.gate = gate = Gate(self.folder)
        self.segments = Segments(self.folder, gate, segment_bytes)
        self.ledger = Ledger()
        streams = Streams()
        me = self._me = weakref.ref(self)
        _ENGINES.add(me)
        self.reader = Reader(gate, self.ledger, self.segments, streams, prefetch_bytes, budget,
                             finished=functools.partial(_ENGINES.discard, me))
        self.writer = Writer(gate, self.ledger, self.segments, self.reader.events)
        self.spill = Spill(gate, self.ledger, self.writer, streams, self.reader.events.put, threshold,
                           max_in_flight, budget, fix_mmap_threshold)
        gate.threads = (self.writer.thread, self.reader.thread)
        gate.closer = weakref.WeakMethod(self.close)
        self.writer.start()
        self.reader.start()
        self._space_warned = False
        # At setup a step's size is unknown: only a nearly full folder can be told.
        self._check_space(max_in_flight, "at setup, a step's size is not known yet; this is max_bytes_in_flight")

    @property
    def closed(self) -> bool:
        return self.gate.closed

    @property
    def tmpfile(self) -> bool:
        """Whether files are opened with O_TMPFILE (else created and unlinked at once)."""
        return self.segments.tmpfile

    # -- the hooks and the steps
    def pack(self, t: torch.Tensor) -> Any:
        return self.spill.pack(t)

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.reader.unpack(packed)

    def begin_step(self) -> None:
        self.spill.begin_step()

    def end_step(self, raise_error: bool) -> None:
        step_bytes = self.spill.end_step(raise_error)
        if raise_error and step_bytes and not self._space_warned:
            self._check_space(step_bytes, "what the step just ended handed to the writer")

    def keep_in_memory(self, modules: tuple[nn.Module, ...]) -> None:
        self.spill.keep_in_memory(modules)

    def _check_space(self, step_bytes: int, what: str) -> None:
        """Warn once when the folder cannot hold two steps: before ENOSPC, not after."""
        with self.gate.lock:
            if self._space_warned or self.gate.closed or self.segments.dir_fd < 0:
                return
            try:  # our files are given back after each backward; what is still to be written is not there yet
                free = self.segments.room() - self.ledger.in_flight
            except OSError:
                return
            if free >= 2 * step_bytes:
                return
            self._space_warned = True
        warnings.warn(
            f"save_on_disk: the offload folder {self.folder!r} has {free} bytes ({free / (1 << 20):.0f} MiB) free "
            f"for this engine, less than twice a step: {2 * step_bytes} bytes needed ({step_bytes} bytes a step: "
            f"{what}). Offloading will fail with ENOSPC (DiskOffloadError) once it fills: free space there, "
            "choose another folder, raise threshold_bytes or set budget_bytes.",
            UserWarning, stacklevel=4)

    # -- introspection and teardown
    def stats(self) -> OffloadStats:
        self.reader.sync()
        ledger = self.ledger
        with self.gate.lock:
            return OffloadStats(
                directory=self.folder,
                bytes_in_memory=ledger.held(),
                bytes_pending_write=ledger.in_flight,
                bytes_prefetched=ledger.prefetched,
                bytes_offloaded=ledger.bytes_offloaded,
                bytes_written=ledger.bytes_written,
                bytes_read=ledger.bytes_read,
                bytes_on_disk=self.segments.bytes_on_disk(),
                files_on_disk=len(self.segments.fds()),
                tensors_offloaded=ledger.offloaded,
                tensors_deduplicated=ledger.deduplicated,
                tensors_kept=ledger.kept,
                bytes_parked=ledger.parked_bytes,
                bytes_in_memory_peak=ledger.held_peak,
                budget_bytes=self.budget,
            )

    def flush(self) -> None:
        gate = self.gate
        while True:
            with gate.lock:
                if not self.ledger.in_flight or gate.closed or gate.forked():
                    break
                waiter = gate.waiter()
            gate.wait(waiter)
        self.reader.sync()
        with gate.lock:
            gate.check_usable()
            gate.raise_pending()

    def close(self) -> None:
        """Stop the threads: the writer ends, then the reader closes every file. Idempotent."""
        gate = self.gate
        with gate.lock:
            gate.closed = True
            self.ledger.drop_parked()
            gate.notify()
        if gate.forked():
            _ENGINES.discard(self._me)
            return  # a forked child: its copies were closed after the fork
        self.writer.stop()
        if threading.current_thread() not in gate.threads:
            self.reader.join()

    def after_fork_in_child(self) -> None:
        """Close this process's copies of the parent's files: a forked child (a DataLoader worker)
        must not keep their blocks alive. The child has one thread; the lock may be held by a
        thread that no longer exists (the gate replaces it)."""
        self.gate.after_fork()
        close_all(self.segments.take_all())


def _after_fork_in_child() -> None:
    for ref in list(_ENGINES):
        engine = ref()
        if engine is not None:
            engine.after_fork_in_child()


def _close_at_exit() -> None:
    """Close the live engines while the interpreter is still whole: a daemon thread that frees a buffer
    read back (an mmap, which releases the GIL) once Python finalizes is stopped mid-way, which aborts
    the process ("terminate called without an active exception")."""
    for ref in list(_ENGINES):
        engine = ref()
        if engine is not None:
            engine.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
