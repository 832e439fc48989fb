"""The reader thread of a disk offload engine, and unpack, which it serves: it notices dead handles
(closing the files no handle needs), reads back what unpack waits for and reads ahead, newest first,
what was saved before it.

A failed read fails the unpack that needs the record, once (a later unpack asks again); the engine
goes on. Anything else raised here closes the engine.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_gradhooks.offload._common import STOP, failure, raise_failure
from lightning_gradhooks.offload._files import close_all, pread_all
from lightning_gradhooks.offload._memory import Streams, bytes_at, host_buffer, to_device, use_here
from lightning_gradhooks.offload.gate import Gate
from lightning_gradhooks.offload.ledger import Ledger
from lightning_gradhooks.offload.records import Handle, HandleRef, Record, State
from lightning_gradhooks.offload.segments import Segments

__all__ = ["Reader"]


def _reader_main(reader_ref: weakref.ref[Reader], events: queue.SimpleQueue, segments: Segments,
                 finished: Callable[[], None]) -> None:
    more = False  # prefetch may have more to read
    while True:
        item = None if more and events.empty() else events.get()
        if item is STOP:  # the writer has ended
            try:
                segments.close()
            finally:
                finished()  # both threads are done
            return
        if type(item) is queue.SimpleQueue:  # a caller waits until everything before is handled
            item.put(None)
            continue
        reader = reader_ref()
        more = False if reader is None else reader.handle(item)
        del reader, item


def _check_version(tensor: torch.Tensor, version: int, dtype: torch.dtype, size: torch.Size) -> None:
    """Raise, as autograd does without hooks, if a saved tensor changed since it was saved (torch skips its
    own check whenever saved-tensor hooks are set)."""
    now = tensor._version
    if now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a {dtype} tensor of shape {list(size)} saved for backward at version {version} is now at version "
            f"{now} (checked by save_on_disk, since torch skips this check under saved-tensor hooks; autograd "
            "raises the same error without offload). Hint: look for an in-place change of this tensor, or of a "
            "view of it, between the forward and this backward (an operation ending in '_', out=, an optimizer "
            "step); enable anomaly detection with torch.autograd.set_detect_anomaly(True) to find the operation "
            "that failed to compute its gradient."
        )


def _view(storage: torch.UntypedStorage, h: Handle, offset: int) -> torch.Tensor:
    """The tensor ``h`` stands for, over ``storage`` from element ``offset``."""
    return torch.empty(0, dtype=h.dtype, device=storage.device).set_(storage, offset, h.size, h.stride)


class Reader:
    """The reader thread and its queue of events: the thread's one owner. An event is a dead handle's
    :class:`~lightning_gradhooks.offload.records.HandleRef`, a record an unpack waits for, ``(record,)``
    (an unpack was served: read ahead from there), or a queue to answer once all before is handled.
    The thread holds nothing of the engine; it ends once the writer thread has (``STOP``), closing
    the files, then calls ``finished``."""

    def __init__(self, gate: Gate, ledger: Ledger, segments: Segments, streams: Streams, prefetch_bytes: int,
                 budget: int | None, finished: Callable[[], None]) -> None:
        self.gate, self.ledger, self.segments, self.streams = gate, ledger, segments, streams
        self.prefetch_bytes, self.budget = prefetch_bytes, budget
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_reader_main, args=(weakref.ref(self), self.events, segments, finished),
                                       daemon=True, name="save_on_disk-reader")

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        """Wait until the thread has ended (after the writer thread: it then closes the files)."""
        self.thread.join()

    def sync(self) -> None:
        """Wait until the reader thread has handled every handle death queued so far."""
        if self.thread.is_alive() and not self.gate.forked():
            marker: queue.SimpleQueue[None] = queue.SimpleQueue()
            self.events.put(marker)
            self.gate.wait(marker)

    # -- the training thread
    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor that ``packed`` (what pack returned) stands for."""
        if type(packed) is tuple:  # kept in memory
            tensor, version = packed
            _check_version(tensor, version, tensor.dtype, tensor.shape)
            return tensor
        h, rec = packed, packed.record
        _check_version(h.keeper, h.version, h.dtype, h.size)
        src, buf, event, asked = self._serve(h, rec)
        if self.prefetch_bytes and not asked:
            self.events.put((rec,))  # prefetch from here
        if src is not None:
            return _view(src.untyped_storage(), h, h.storage_offset)
        if event is not None:
            use_here(buf, event)
        return _view(buf.untyped_storage(), h, h.rel_offset)

    def _serve(self, h: Handle, rec: Record) -> tuple[torch.Tensor | None, torch.Tensor | None, Any, bool]:
        """(source in memory, or bytes read back and their copy's event, whether the reader was asked):
        wait until ``rec``'s bytes are in memory, asking the reader once."""
        gate, asked = self.gate, False
        while True:
            ask = False
            with gate.lock:
                gate.check_usable()
                state = rec.state
                if state is State.FAILED:
                    if gate.error is rec.failure:  # told here: the next step must not tell it again
                        gate.error = None
                    raise_failure(rec.failure)
                if rec.read_error is not None:
                    fault, rec.read_error = rec.read_error, None
                    raise_failure(fault)
                src = rec.src
                if src is not None:  # not written yet: still in memory
                    h.uses += 1
                    return src, None, None, asked
                if state is State.LOADED:
                    h.uses += 1
                    return (None, *self.ledger.serve_loaded(rec, h.uses), asked)
                if state is State.DEAD:
                    raise RuntimeError("save_on_disk: internal error: a saved tensor was never written")
                ask = (state is State.WRITTEN or state is State.LOADING) and not asked
                if ask:
                    rec.asked = True
                else:
                    waiter = gate.waiter()
            if ask:
                self.events.put(rec)  # the reader loads it (and what was saved before it)
                asked = True
            else:
                gate.wait(waiter)

    # -- the reader thread
    def handle(self, item: Any) -> bool:
        """Handle one event, then read ahead one record: whether there may be more to read ahead. An error
        other than a failed read closes the engine."""
        rec = None
        try:
            if type(item) is HandleRef:
                rec = item.record
                self._reap(item)
            elif type(item) is Record:  # unpack needs it
                rec = item
                self._demand(item, load=True)
            elif item is not None:  # (record,): unpack was served; prefetch from there
                rec = item[0]
                self._demand(rec, load=False)
            rec = None  # what follows reads ahead
            return self._prefetch_one()
        except BaseException as exc:  # noqa: BLE001 - closes the engine, which tells the training thread
            self.gate.crash("reader", exc, rec)
            return False

    def _reap(self, ref: HandleRef) -> None:
        rec = ref.record
        with self.gate.lock:
            if ref in rec.refs:
                rec.refs.remove(ref)
            if not self.ledger.die(rec):
                return
            seg = rec.segment
            if seg is not None:
                seg.live -= 1
            fds = self.segments.release(seg)
            self.gate.notify()
        close_all(fds)

    @staticmethod
    def _needs_load(rec: Record) -> bool:
        seg = rec.segment
        return rec.state is State.WRITTEN and seg is not None and seg.fd >= 0 and rec.alive()

    def _demand(self, rec: Record, load: bool) -> None:
        with self.gate.lock:
            segments, seg = self.segments, rec.segment
            if seg is None:  # kept in memory: read ahead from the newest record of its step on disk
                if rec.step > 0 and (segments.reading is None or segments.reading.step != rec.step):
                    newest = segments.newest(rec.step)
                    if newest is not None and newest.last_unpacked < 0:
                        newest.cursor = len(newest.records) - 1
                    segments.reading = newest
                return
            seg.cursor = rec.index - 1 if rec.index > seg.last_unpacked else min(seg.cursor, rec.index - 1)
            seg.last_unpacked = rec.index
            segments.reading = seg
            load = load and rec.asked and self._needs_load(rec)  # not if a prefetch served it meanwhile
            if load:
                self._start_load(rec)
        if load:
            self._load(rec)

    def _start_load(self, rec: Record) -> None:
        self.ledger.start_load(rec)
        rec.segment.io += 1

    def _prefetch_one(self) -> bool:
        """Read the newest record saved before the last one unpacked, within the budget."""
        ledger = self.ledger
        with self.gate.lock:
            seg, found = self.segments.reading, None
            while seg is not None and found is None and self.prefetch_bytes:
                while seg.cursor >= 0 and found is None and seg.fd >= 0 and seg.failed is None:
                    r = seg.records[seg.cursor]
                    if self._needs_load(r) and r.awaited():  # not one this pass already used
                        if ledger.prefetched and ledger.prefetched + r.nbytes > self.prefetch_bytes:
                            return False
                        held = ledger.held()
                        if self.budget is not None and held and held + r.nbytes > self.budget:
                            return False  # reads ahead count against the budget: wait for room
                        found = r
                        self._start_load(r)
                    seg.cursor -= 1
                if found is None:
                    seg = self.segments.reading = seg.previous
        if found is None:
            return False
        self._load(found)
        return True

    def _load(self, rec: Record) -> None:
        """Read ``rec`` back (reader thread)."""
        buf = event = fault = None
        try:
            buf, event = self._read_back(rec)
        except Exception as exc:  # noqa: BLE001 - the unpack that needs it is told
            fault = failure(exc, f"save_on_disk: could not read {rec.nbytes} bytes from folder "
                                 f"{self.gate.folder!r} ({rec.where()})")
        with self.gate.lock:
            rec.segment.io -= 1
            self.ledger.load_done(rec, buf, event, fault)
            fds = self.segments.release(rec.segment)
            self.gate.notify()
        del buf
        close_all(fds)

    def _read_back(self, rec: Record) -> tuple[torch.Tensor, Any]:
        seg, n = rec.segment, rec.nbytes
        fd = seg.fd
        if rec.device.type == "cpu":
            buf = host_buffer(n)
            pread_all(fd, bytes_at(buf.data_ptr(), n), rec.offset)
            return buf, None
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pread_all(fd, bytes_at(pinned.data_ptr(), n), rec.offset)
        return to_device(pinned, rec.device, self.streams.of(rec.device))
