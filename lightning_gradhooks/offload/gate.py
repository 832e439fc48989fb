"""Whether a disk offload engine may be used: its one lock, the process that owns it, whether it is
closed, the error a thread left for the training thread, and the waits for its threads."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_gradhooks.offload._common import DiskOffloadError, Failure, failure, raise_failure

if TYPE_CHECKING:
    from lightning_gradhooks.offload.records import Record

__all__ = ["Gate"]

_WAIT_S = 1.0  # how often a wait for a thread checks that the threads still run (a slow disk is waited for)


class Gate:
    """The engine's condition, shared by its parts, and the lock that guards their state (taken only
    through ``with``). ``closer`` returns the engine's ``close`` (or None once the engine is gone): a
    thread that fails closes the engine through it without keeping the engine alive."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.closed = False
        self.error: Failure | None = None  # a write failed: the training thread is told once
        self.broken: Failure | None = None  # a thread failed: the engine closed itself, and raises this
        self.threads: tuple[threading.Thread, ...] = ()  # what waits watch: the writer and the reader
        self.closer: Callable[[], Callable[[], None] | None] = lambda: None
        self._waiters: list[queue.SimpleQueue[None]] = []

    def forked(self) -> bool:
        """Whether this is a forked child of the process that made the engine."""
        return os.getpid() != self.pid

    # -- with the lock held
    def check_usable(self) -> None:
        if self.forked():
            raise RuntimeError(f"save_on_disk: this engine belongs to process {self.pid}; a forked child "
                               "cannot use it (its files were closed in the child)")
        if self.broken is not None:
            raise_failure(self.broken)
        if self.closed:
            raise RuntimeError("save_on_disk is closed: its offloaded tensors were deleted")

    def raise_pending(self) -> None:
        if self.error is not None:
            pending, self.error = self.error, None
            # The failed step's records still queued fail with it, without a second error: the
            # next step (a new step number) is a new attempt.
            raise_failure(pending)

    def waiter(self) -> queue.SimpleQueue[None]:
        """A queue that :meth:`notify` answers: the next change of state by a thread."""
        waiter: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiters.append(waiter)
        return waiter

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.put(None)

    # -- without the lock
    def wait(self, waiter: queue.SimpleQueue[None]) -> None:
        """Wait (a C-level get, without the lock) until a thread answers: a slow disk is waited for however
        long it takes, but threads that have ended cannot answer, so that raises why instead of hanging."""
        while True:
            try:
                waiter.get(timeout=_WAIT_S)
                return
            except queue.Empty:
                if all(t.is_alive() for t in self.threads):
                    continue
            with self.lock:
                self.check_usable()  # closed, failed or forked: the reason
            raise DiskOffloadError(f"save_on_disk: the engine's threads ended (folder {self.folder!r})")

    def crash(self, thread: str, exc: BaseException, rec: Record | None) -> None:
        """An error other than a failed read, write or file creation escaped a thread's work: the engine's
        state can no longer be trusted, so it closes itself, and every later use raises this error."""
        doing = "while reading ahead" if rec is None else f"on a record of {rec.nbytes} bytes ({rec.where()})"
        broken = failure(exc, f"save_on_disk: the {thread} thread failed {doing} in folder {self.folder!r}, "
                              "so the engine closed itself: the tensors it saved are lost (create a new "
                              "save_on_disk)")
        with self.lock:
            if self.broken is None:
                self.broken = broken
        close = self.closer()
        if close is not None:
            close()

    def after_fork(self) -> None:
        """In a forked child: closed, with a new lock (a thread that no longer exists may hold the old one)."""
        self.lock = threading.Lock()
        self.closed = True
