"""The writer thread of a disk offload engine: it opens the files (through
:class:`~lightning_gradhooks.offload.segments.Segments`) and appends the records handed to it.

A failed write or file creation fails its record and its step (the training thread is told at its
next pack, unpack or step); the engine goes on. Anything else raised here closes the engine.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

from lightning_gradhooks.offload._common import STOP, Failure, failure
from lightning_gradhooks.offload._files import close_all, pwrite_all
from lightning_gradhooks.offload._memory import bytes_at
from lightning_gradhooks.offload.gate import Gate
from lightning_gradhooks.offload.ledger import Ledger
from lightning_gradhooks.offload.records import Record
from lightning_gradhooks.offload.segments import Segment, Segments

__all__ = ["Writer"]


def _writer_main(writer_ref: weakref.ref[Writer], jobs: queue.SimpleQueue, events: queue.SimpleQueue) -> None:
    try:
        while True:
            item = jobs.get()
            if type(item) is not Record:  # stop(), or the writer was collected (its weak reference)
                return
            writer = writer_ref()
            if writer is not None:
                writer.write(item)
            del writer, item
    finally:
        events.put(STOP)  # however the writer ends, the reader then closes the files: no write can run


class Writer:
    """The writer thread and its queue of records (``jobs``): the thread's one owner. It holds nothing of
    the engine: once the writer is collected with the engine, its weak reference stops the thread.
    When the thread ends, it tells the reader thread through ``events``, which then closes the files."""

    def __init__(self, gate: Gate, ledger: Ledger, segments: Segments, events: queue.SimpleQueue[Any]) -> None:
        self.gate, self.ledger, self.segments = gate, ledger, segments
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.failed_step, self.step_failure = -1, None  # the step whose write failed, and how
        me = weakref.ref(self, self.jobs.put)  # collected: the thread stops (a C call)
        self.thread = threading.Thread(target=_writer_main, args=(me, self.jobs, events), daemon=True,
                                       name="save_on_disk-writer")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """The thread finishes the records queued before, then ends. Idempotent."""
        self.jobs.put(STOP)

    def hand_over(self, rec: Record) -> None:
        """Queue a parked record (with the lock held). The queue's C ``put`` comes first: an interrupt lands
        before it (the record stays parked) or right after it (the writer then unparks the record, which
        is not counted in flight)."""
        self.jobs.put(rec)
        self.ledger.handed_over(rec)

    def write(self, rec: Record) -> None:
        """Write ``rec`` (writer thread); an error other than a failed write or file creation closes the engine."""
        try:
            self._write(rec)
        except BaseException as exc:  # noqa: BLE001 - closes the engine, which tells the training thread
            self.gate.crash("writer", exc, rec)

    def _write(self, rec: Record) -> None:
        with self.gate.lock:
            seg, fault = self._claim(rec)
            fd = -1 if seg is None else seg.fd
            src, pinned, event = rec.src, rec.pinned, rec.event
        if seg is not None:
            try:
                if event is not None:
                    event.synchronize()
                address = pinned.data_ptr() if pinned is not None else src.untyped_storage().data_ptr() + rec.byte_start
                pwrite_all(fd, bytes_at(address, rec.nbytes), rec.offset)
            except Exception as exc:  # noqa: BLE001 - the step fails, the training thread is told
                fault = failure(exc, f"save_on_disk: could not write {rec.nbytes} bytes to folder "
                                     f"{self.gate.folder!r} ({rec.where()})")
        del src
        with self.gate.lock:
            self.ledger.write_done(rec, pinned, written=seg is not None and fault is None)
            if seg is not None:
                seg.io -= 1
            if fault is not None:
                self._fail(rec, seg, fault)
            fds = self.segments.release(seg)
            self.gate.notify()
        close_all(fds)

    def _claim(self, rec: Record) -> tuple[Segment | None, Failure | None]:
        """The segment ``rec`` is appended to (None: it is not written), or why its file could not be
        created (with the lock held)."""
        failed = self.step_failure if rec.step == self.failed_step else None
        if not self.ledger.to_write(rec, failed, self.gate.closed):
            return None, None
        try:
            seg = self.segments.for_record(rec)  # opens a file: under the lock, so a fork sees it
        except Exception as exc:  # noqa: BLE001 - the step fails, the training thread is told
            return None, failure(exc, f"save_on_disk: could not create a file for {rec.nbytes} bytes in folder "
                                      f"{self.gate.folder!r}")
        self.segments.place(rec, seg)
        return seg, None

    def _fail(self, rec: Record, seg: Segment | None, fault: Failure) -> None:
        """The step's tensors can no longer come back: drop what they hold, surface the error."""
        ledger = self.ledger
        ledger.fail(rec, fault)
        self.failed_step, self.step_failure = rec.step, fault
        if self.gate.error is None:
            self.gate.error = fault
        if seg is not None and seg.failed is None:
            seg.failed = fault
            for r in seg.records:
                ledger.fail(r, fault)
        for r in [r for r in ledger.parked if r.step == rec.step]:  # kept in memory: dropped too
            ledger.unpark(r)
            ledger.fail(r, fault)

