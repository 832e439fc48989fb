"""The disk offload engine behind :class:`~lightning_gradhooks.offload.save_on_disk`: pack (forward)
and unpack (backward), the writer thread, the reader thread (reads, prefetch and the reaping of
dead handles), CUDA side streams, statistics, fork safety and teardown.

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
import itertools
import os
import queue
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from lightning_gradhooks.offload._common import _ALIGN, DiskOffloadError, OffloadStats, _round_up
from lightning_gradhooks.offload._files import (
    Failure,
    _close_all,
    _Files,
    _free_bytes,
    _HandleRef,
    _in_thread,
    _open_folder,
    _open_unnamed,
    _pread_all,
    _pwrite_all,
    _Record,
    _Segment,
    _State,
)
from lightning_gradhooks.offload._memory import (
    _bytes_at,
    _fix_mmap_threshold,
    _host_buffer,
    _to_device,
    _to_pinned,
    _use_here,
)

_STOP = object()  # tells a thread to finish
_WAIT_S = 1.0  # how often a wait for a thread checks that the threads still run (a slow disk is waited for)
_ENGINES: set[weakref.ref[_Engine]] = set()  # engines whose threads run: for fork handling and exit


_set_versions = torch._C._autograd._unsafe_set_version_counter


class _Handle:
    """What autograd keeps instead of an offloaded tensor: metadata, its record and what checks its
    version at unpack. No ``__del__``."""

    __slots__ = ("record", "dtype", "size", "stride", "storage_offset", "rel_offset", "keeper", "version", "uses",
                 "__weakref__")

    def __init__(self, record: _Record, t: torch.Tensor, keeper: torch.Tensor, version: int) -> None:
        self.record, self.dtype = record, t.dtype
        self.size, self.stride, self.storage_offset = t.size(), t.stride(), t.storage_offset()
        self.rel_offset = (t.storage_offset() * t.element_size() - record.byte_start) // t.element_size()
        self.keeper, self.version = keeper, version
        self.uses = 0  # unpacks served to this handle


def _version_keeper(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A tensor that shares ``t``'s version counter but none of its memory, and ``t``'s version now;
    None where torch refuses. Autograd's own saved variables keep the same: the counter, which every
    view and ``detach()`` alias of the storage bumps, not the data."""
    version = t._version
    try:
        keeper = t.detach()
        keeper.set_()  # an empty storage; this bumps the shared counter...
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    _set_versions((keeper,), (version,))  # ...which is set back at once (one thread: the forward's)
    return keeper, version


def _held_elsewhere(src: torch.Tensor) -> bool:
    """Whether a tensor other than the engine's own alias ``src`` uses its storage (the batch, a tensor
    the caller keeps, a view): writing it would free nothing."""
    try:  # src, and the storage object made for the call
        return torch._C._storage_Use_Count(src.untyped_storage()._cdata) > 2
    except (AttributeError, RuntimeError):
        return False


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


def _view(storage: torch.UntypedStorage, h: _Handle, offset: int) -> torch.Tensor:
    return torch.empty(0, dtype=h.dtype, device=storage.device).set_(storage, offset, h.size, h.stride)


def _failure(exc: BaseException, message: str) -> Failure:
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


def _raise(failure: Failure) -> None:
    cls, args, cause = failure
    raise cls(*args) from cause


def _where(rec: _Record) -> str:
    """Which record: its file (they have no name: numbered from 0 per engine), offset and step."""
    seg = rec.segment
    return f"file #{seg.index}, offset {rec.offset}, step {rec.step}" if seg is not None else f"step {rec.step}"


def _writer_main(engine_ref: weakref.ref[_Engine], writes: queue.SimpleQueue, events: queue.SimpleQueue) -> None:
    try:
        while True:
            item = writes.get()
            if type(item) is not _Record:  # close(), or the engine was collected (its weak reference)
                return
            engine = engine_ref()
            if engine is not None:
                try:
                    engine._write(item)
                except BaseException as exc:  # noqa: BLE001 - closes the engine, which tells the training thread
                    engine._crash("writer", exc, item)
            del engine, item
    finally:
        events.put(_STOP)  # however the writer ends, the reader then closes the files: no write can run


def _reader_main(engine_ref: weakref.ref[_Engine], events: queue.SimpleQueue, files: _Files) -> None:
    more = False  # prefetch may have more to read
    while True:
        item = None if more and events.empty() else events.get()
        if item is _STOP:
            try:
                files.close_all()
            finally:
                _ENGINES.discard(engine_ref)  # both threads are done
            return
        if type(item) is queue.SimpleQueue:  # a caller waits until everything before is handled
            item.put(None)
            continue
        engine = engine_ref()
        if engine is None:
            more = False
            continue
        rec = None
        try:
            if type(item) is _HandleRef:
                rec = item.record
                engine._reap(item)
            elif type(item) is _Record:  # unpack needs it
                rec = item
                engine._demand(item, load=True)
            elif item is not None:  # (record,): unpack was served; prefetch from there
                rec = item[0]
                engine._demand(rec, load=False)
            rec = None  # what follows reads ahead
            more = engine._prefetch_one()
        except BaseException as exc:  # noqa: BLE001 - closes the engine, which tells the training thread
            engine._crash("reader", exc, rec)
            more = False
        del engine, item, rec


class _Engine:
    """Owns the files, threads and records of one :class:`save_on_disk`."""

    def __init__(self, threshold: int, directory: str, max_in_flight: int, prefetch_bytes: int,
                 segment_bytes: int, budget: int | None = None, fix_mmap_threshold: bool = True) -> None:
        self.threshold, self.max_in_flight = threshold, max_in_flight
        self.budget = budget  # bytes of offloadable tensors held in memory at once (None: write all)
        self.prefetch_bytes, self.segment_bytes = prefetch_bytes, segment_bytes
        self.folder = os.path.abspath(directory)
        # Fix glibc's mmap threshold at the first CPU tensor written (never for CUDA tensors), so that
        # freed offloaded tensors leave the process: False once done or not asked for.
        self._fix_malloc = fix_mmap_threshold
        dir_fd, tmpfile = _in_thread("save_on_disk-setup", _open_folder, self.folder)
        self._files = _Files(self.folder, dir_fd, tmpfile)
        self._segments = self._files.segments
        self.closed = False
        self._pid = os.getpid()
        self._writes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiters: list[queue.SimpleQueue[None]] = []
        self._current: _Segment | None = None
        self._indices = itertools.count()
        self._step = 0
        self._failed_step, self._step_failure = -1, None  # the step whose write failed, and how
        self._dedupe: dict[tuple[torch.device, int], list[_Record]] = {}
        self._resident_modules: list[weakref.ref[nn.Module]] = []
        self._resident_ptrs: set[int] = set()
        self._error: Failure | None = None
        self._broken: Failure | None = None  # a thread failed: the engine closed itself, and raises this
        self._in_flight = self._prefetched = self._bytes_offloaded = self._bytes_written = self._bytes_read = 0
        # Offloadable tensors kept in memory, oldest first (an insertion-ordered set): under a budget
        # the newest stay, and the oldest are handed to the writer when the total would exceed it.
        self._parked: dict[_Record, None] = {}
        self._queued: dict[_Record, None] = {}  # handed to the writer and counted in _in_flight
        self._parked_bytes = self._held_peak = 0
        self._space_warned = False
        self._step_offloaded = 0  # bytes handed to the writer before this step began
        self._offloaded = self._deduplicated = self._kept = 0
        self._prefetch_seg: _Segment | None = None
        self._streams: dict[torch.device, Any] = {}  # CUDA: one side stream per device, for the copies
        me = self._me = weakref.ref(self, self._writes.put)  # collected: the writer stops (a C call)
        _ENGINES.add(me)
        self._threads = (
            threading.Thread(target=_writer_main, args=(me, self._writes, self._events), daemon=True,
                             name="save_on_disk-writer"),
            threading.Thread(target=_reader_main, args=(me, self._events, self._files), daemon=True,
                             name="save_on_disk-reader"),
        )
        for thread in self._threads:
            thread.start()
        # At setup a step's size is unknown: only a nearly full folder can be told.
        self._check_space(self.max_in_flight, "at setup, a step's size is not known yet; this is max_bytes_in_flight")

    @property
    def tmpfile(self) -> bool:
        """Whether files are opened with O_TMPFILE (else created and unlinked at once)."""
        return self._files.tmpfile

    # -- helpers (called with the lock held)
    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(f"save_on_disk: this engine belongs to process {self._pid}; a forked child "
                               "cannot use it (its files were closed in the child)")
        if self._broken is not None:
            _raise(self._broken)
        if self.closed:
            raise RuntimeError("save_on_disk is closed: its offloaded tensors were deleted")

    def _raise_pending(self) -> None:
        if self._error is not None:
            failure, self._error = self._error, None
            # The failed step's records still queued fail with it, without a second error: the
            # next step (a new step number) is a new attempt.
            _raise(failure)

    def _waiter(self) -> queue.SimpleQueue[None]:
        waiter: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiters.append(waiter)
        return waiter

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.put(None)

    def _wait(self, waiter: queue.SimpleQueue[None]) -> None:
        """Wait (a C-level get, without the lock) until a thread answers: a slow disk is waited for however
        long it takes, but threads that have ended cannot answer, so that raises why instead of hanging."""
        while True:
            try:
                waiter.get(timeout=_WAIT_S)
                return
            except queue.Empty:
                if all(t.is_alive() for t in self._threads):
                    continue
            with self._files.lock:
                self._check_usable()  # closed, failed or forked: the reason
            raise DiskOffloadError(f"save_on_disk: the engine's threads ended (folder {self.folder!r})")

    def _crash(self, thread: str, exc: BaseException, rec: _Record | None) -> None:
        """An error other than a failed read, write or file creation escaped a thread's work: the engine's
        state can no longer be trusted, so it closes itself, and every later use raises this error."""
        doing = "while reading ahead" if rec is None else f"on a record of {rec.nbytes} bytes ({_where(rec)})"
        failure = _failure(exc, f"save_on_disk: the {thread} thread failed {doing} in folder {self.folder!r}, "
                                "so the engine closed itself: the tensors it saved are lost (create a new "
                                "save_on_disk)")
        with self._files.lock:
            if self._broken is None:
                self._broken = failure
        self.close()

    def _release(self, seg: _Segment | None) -> tuple[int, ...]:
        """Take out the descriptor of a segment no handle needs and no I/O uses (threads close it)."""
        if seg is None or seg.fd < 0 or seg.io or (seg.live and seg.failed is None):
            return ()
        self._segments.pop(seg.index, None)
        if self._current is seg:
            self._current = None
        if self._prefetch_seg is seg:
            self._prefetch_seg = None
        return (seg.take_fd(),)

    def _own(self) -> list[_Record]:
        """The parked records that the budget counts, oldest first: all but the inputs that the caller
        still holds (a tensor not computed by the graph, such as the batch, that a tensor other than
        the engine's uses), which cost their memory whether written or not: writing them frees nothing."""
        return [r for r in self._parked if r.src is not None and not (r.input and _held_elsewhere(r.src))]

    def _held(self) -> int:
        """Bytes of offloadable tensors the engine alone keeps in memory: kept under the budget, being
        written, read back."""
        return sum(r.nbytes for r in self._own()) + self._in_flight + self._prefetched

    def _note_held(self) -> None:
        held = self._held()
        if held > self._held_peak:
            self._held_peak = held

    def _unpark(self, rec: _Record) -> None:
        del self._parked[rec]
        self._parked_bytes -= rec.nbytes

    def _sync(self) -> None:
        """Wait until the reader thread has handled every handle death queued so far."""
        if self._threads[1].is_alive() and os.getpid() == self._pid:
            marker: queue.SimpleQueue[None] = queue.SimpleQueue()
            self._events.put(marker)
            self._wait(marker)

    # -- steps
    def begin_step(self) -> None:
        resident = {
            getattr(t, "_local_tensor", t).untyped_storage().data_ptr()  # a DTensor (FSDP2, TP): its shard
            for ref in self._resident_modules if (module := ref()) is not None
            for t in itertools.chain(module.parameters(), module.buffers())
        }
        with self._files.lock:
            self._check_usable()
            self._raise_pending()
            self._step += 1  # the writer starts a new file for each step
            self._dedupe = {}
            self._step_offloaded = self._bytes_offloaded
            self._resident_ptrs = resident

    def end_step(self, raise_error: bool) -> None:
        with self._files.lock:
            self._dedupe = {}
            if raise_error:
                self._raise_pending()
            step_bytes = self._bytes_offloaded - self._step_offloaded
            self._step_offloaded = self._bytes_offloaded
        if raise_error and step_bytes and not self._space_warned:
            self._check_space(step_bytes, "what the step just ended handed to the writer")

    def _check_space(self, step_bytes: int, what: str) -> None:
        """Warn once when the folder cannot hold two steps: before ENOSPC, not after."""
        with self._files.lock:
            if self._space_warned or self.closed or self._files.dir_fd < 0:
                return
            fds = [s.fd for s in self._segments.values() if s.fd >= 0]
            try:  # our files are given back after each backward; what is still to be written is not there yet
                free = _free_bytes(self._files.dir_fd) + sum(os.fstat(fd).st_size for fd in fds) - self._in_flight
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

    def keep_in_memory(self, modules: tuple[nn.Module, ...]) -> None:
        ptrs = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for m in modules for t in itertools.chain(m.parameters(), m.buffers())}
        refs = [weakref.ref(m) for m in modules]
        with self._files.lock:
            self._resident_modules = self._resident_modules + refs
            self._resident_ptrs = self._resident_ptrs | ptrs

    # -- pack (forward)
    def _region(self, t: torch.Tensor) -> tuple[torch.UntypedStorage, int, int, int, int] | None:
        """(storage, tensor start, tensor bytes, region start, region bytes), or None: keep."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            return None
        if (t.is_leaf and t.requires_grad) or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg():
            return None
        base = t._base
        if base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
            return None
        if t.numel() == 0:
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. functorch wrappers
            return None
        elsize = t.element_size()
        nbytes = elsize * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))
        if nbytes < self.threshold or storage.data_ptr() in self._resident_ptrs:
            return None
        start, total = t.storage_offset() * elsize, storage.nbytes()
        if 2 * nbytes >= total:  # mostly the whole storage: save it all, so other views share it
            return storage, start, nbytes, 0, total
        return storage, start, nbytes, start, nbytes

    def _new_handle(self, rec: _Record, t: torch.Tensor, keeper: tuple[torch.Tensor, int]) -> _Handle:
        handle = _Handle(rec, t, *keeper)
        ref = _HandleRef(handle, self._events.put)
        ref.record = rec
        rec.refs.append(ref)
        return handle

    def pack(self, t: torch.Tensor) -> Any:
        region = self._region(t)
        keeper = None if region is None else _version_keeper(t)
        if keeper is None:
            with self._files.lock:
                self._check_usable()
                self._raise_pending()
                self._kept += 1
            return t.detach(), t._version  # kept in memory; its version is checked at unpack
        storage, start, nbytes, region_start, region_bytes = region
        with self._files.lock:
            self._check_usable()
            self._raise_pending()
            rec = self._find_duplicate(t, storage, start, nbytes)
            if rec is not None:
                self._deduplicated += 1
                return self._new_handle(rec, t, keeper)
        # An interrupt before the record is parked leaves a record that nobody knows; after, its
        # handle dies with the interrupted pack, and the reader thread unparks it.
        if self._fix_malloc and t.device.type == "cpu":
            self._fix_malloc = False
            _fix_mmap_threshold(self.threshold)
        rec = _Record(t, storage, region_start, region_bytes)
        handle = self._new_handle(rec, t, keeper)
        with self._files.lock:
            self._check_usable()
            rec.step = self._step
            self._parked[rec] = None
            self._parked_bytes += region_bytes
            self._note_held()
            self._dedupe.setdefault((t.device, storage.data_ptr()), []).append(rec)
        self._spill(region_bytes)
        return handle

    def _spill(self, newest: int) -> None:
        """Hand the oldest kept records to the writer: all of them without a budget, else until what the
        engine holds, once written, leaves room in it for one more tensor (``newest`` bytes). Wait
        (backpressure) while more than ``max_in_flight`` bytes are being written, or, under a budget,
        while what is held exceeds it: the next save then finds at most the budget held."""
        while True:
            copy = None
            with self._files.lock:
                self._check_usable()
                self._raise_pending()
                budget = self.budget
                # Spill until what stays once the writes are done leaves room for one more tensor, which
                # can then be written while the forward goes on. Without a budget every parked record is
                # written; under one, those it counts (not the inputs the caller holds), oldest first.
                keep = None if budget is None else budget - newest
                candidates = list(self._parked) if keep is None else self._own()
                own = 0 if keep is None else sum(r.nbytes for r in candidates)
                left = len(candidates)
                for rec in candidates:
                    if keep is not None and own + self._prefetched <= keep:
                        break
                    if rec.src is None:  # failed or dead meanwhile: nothing to write
                        self._unpark(rec)
                        left -= 1
                        continue
                    if self._in_flight and self._in_flight + rec.nbytes > self.max_in_flight:
                        break
                    if rec.device.type == "cuda" and rec.pinned is None:
                        copy = rec, rec.src  # the device-to-host copy runs outside the lock
                        break
                    self._queue(rec)
                    own -= rec.nbytes
                    left -= 1
                if copy is None:
                    blocked = left > 0 and (keep is None or own + self._prefetched > keep)
                    if not (blocked or (budget is not None and self._in_flight and self._held() > budget)):
                        return
                    waiter = self._waiter()
            if copy is not None:
                rec, src = copy
                if src is not None:
                    self._copy_to_host(rec, src.untyped_storage())
                continue
            self._wait(waiter)

    def _queue(self, rec: _Record) -> None:
        """Hand a parked record to the writer (with the lock held). The queue's C ``put`` comes first
        and no call follows it: an interrupt lands before it (the record stays parked) or right after
        it (the writer then unparks the record, which is not counted in flight). What follows the
        transition makes no call."""
        self._writes.put(rec)
        rec.to(_State.QUEUED)  # an interrupt at this call leaves it PARKED, in _parked and not counted
        self._queued[rec] = None
        del self._parked[rec]
        self._parked_bytes -= rec.nbytes
        self._in_flight += rec.nbytes
        self._bytes_offloaded += rec.nbytes
        self._offloaded += 1
        if rec.device.type == "cuda":
            rec.src = None  # its pinned host copy is written; the device memory goes back

    def _find_duplicate(self, t: torch.Tensor, storage: torch.UntypedStorage, start: int,
                        nbytes: int) -> _Record | None:
        elsize = t.element_size()
        for rec in self._dedupe.get((t.device, storage.data_ptr()), ()):
            if (rec.state is not _State.DEAD and rec.state is not _State.FAILED and rec.step == self._step and rec.version == t._version
                    and rec.storage_ref() is not None and rec.byte_start <= start
                    and start + nbytes <= rec.byte_start + rec.nbytes and rec.byte_start % elsize == 0
                    and rec.alive()):
                return rec
        return None

    def _stream(self, device: torch.device) -> Any:
        with self._files.lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def _copy_to_host(self, rec: _Record, storage: torch.UntypedStorage) -> None:
        """CUDA: start copying the record's bytes to a pinned host buffer, which the writer writes."""
        src = torch.empty(0, dtype=torch.uint8, device=rec.device).set_(storage, rec.byte_start, (rec.nbytes,), (1,))
        rec.pinned, rec.event = _to_pinned(src, self._stream(rec.device))

    # -- writer thread
    def _segment_for(self, rec: _Record) -> _Segment:
        """The file ``rec`` goes to: the current one, or a new one per step and past segment_bytes."""
        seg = self._current
        if (seg is not None and seg.fd >= 0 and seg.failed is None and seg.step == rec.step
                and not (seg.records and seg.size + rec.nbytes > self.segment_bytes)):
            return seg
        fd, _ = _open_unnamed(self._files.dir_fd)
        new = _Segment(next(self._indices), rec.step, fd)
        self._current = self._segments[new.index] = new
        new.previous = seg if seg is not None and seg.step == rec.step and seg.fd >= 0 else None
        return new

    def _write(self, rec: _Record) -> None:
        seg = None
        failure: Failure | None = None
        n = rec.nbytes
        with self._files.lock:
            if rec in self._parked:  # its hand-over was interrupted right after the put
                self._unpark(rec)
            if rec.state is not _State.PARKED and rec.state is not _State.QUEUED:
                pass  # dead, failed, or handed over twice: nothing to write
            elif not rec.alive():
                rec.to(_State.DEAD)
            elif rec.step == self._failed_step:
                rec.to(_State.FAILED)
                rec.failure = self._step_failure
            elif self.closed:
                rec.to(_State.DEAD)
            else:
                try:
                    seg = self._segment_for(rec)  # opens a file: under the lock, so a fork sees it
                except Exception as exc:  # noqa: BLE001 - the step fails, the training thread is told
                    failure = _failure(exc, f"save_on_disk: could not create a file for {n} bytes in folder "
                                            f"{self.folder!r}")
            if seg is not None:
                rec.offset = _round_up(seg.size, _ALIGN)
                rec.segment, rec.index = seg, len(seg.records)
                seg.records.append(rec)
                seg.size = rec.offset + n
                seg.live += 1
                seg.io += 1
                fd = seg.fd
            src, pinned, event = rec.src, rec.pinned, rec.event
        if seg is not None:
            try:
                if event is not None:
                    event.synchronize()
                address = pinned.data_ptr() if pinned is not None else src.untyped_storage().data_ptr() + rec.byte_start
                _pwrite_all(fd, _bytes_at(address, n), rec.offset)
            except Exception as exc:  # noqa: BLE001 - the step fails, the training thread is told
                failure = _failure(exc, f"save_on_disk: could not write {n} bytes to folder {self.folder!r} "
                                        f"({_where(rec)})")
        del src
        with self._files.lock:
            rec.src = None
            if pinned is not None:  # torch's host allocator keeps it until a skipped write's copy is done
                rec.pinned = rec.event = None
            if rec in self._queued:
                del self._queued[rec]
                self._in_flight -= n
            if seg is not None:
                seg.io -= 1
            if failure is not None:
                self._fail(rec, seg, failure)
            elif seg is not None:
                if rec.state is _State.PARKED or rec.state is _State.QUEUED:  # not dead or failed meanwhile
                    rec.to(_State.WRITTEN)
                self._bytes_written += n
            fds = self._release(seg)
            self._notify()
        _close_all(fds)

    def _fail(self, rec: _Record, seg: _Segment | None, failure: Failure) -> None:
        """The step's tensors can no longer come back: drop what they hold, surface the error."""
        self._fail_record(rec, failure)
        self._failed_step, self._step_failure = rec.step, failure
        if self._error is None:
            self._error = failure
        if seg is not None and seg.failed is None:
            seg.failed = failure
            for r in seg.records:
                self._fail_record(r, failure)
        for r in [r for r in self._parked if r.step == rec.step]:  # kept in memory: dropped too
            self._unpark(r)
            self._fail_record(r, failure)

    def _fail_record(self, rec: _Record, failure: Failure) -> None:
        """``rec`` can no longer come back: FAILED, holding nothing (a dead record stays dead)."""
        if rec.state is _State.DEAD:
            return
        if rec.state is not _State.FAILED:
            rec.to(_State.FAILED)
        rec.failure, rec.src = failure, None
        if rec.loaded is not None:
            rec.loaded = rec.load_event = None
            self._prefetched -= rec.nbytes

    # -- unpack (backward)
    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is tuple:  # kept in memory
            tensor, version = packed
            _check_version(tensor, version, tensor.dtype, tensor.shape)
            return tensor
        h, rec = packed, packed.record
        _check_version(h.keeper, h.version, h.dtype, h.size)
        asked = False
        while True:
            ask = False
            with self._files.lock:
                self._check_usable()
                state = rec.state
                if state is _State.FAILED:
                    if self._error is rec.failure:  # told here: the next step must not tell it again
                        self._error = None
                    _raise(rec.failure)
                if rec.read_error is not None:
                    failure, rec.read_error = rec.read_error, None
                    _raise(failure)
                src = rec.src
                if src is not None:  # not written yet: still in memory
                    buf = event = None
                    h.uses += 1
                    break
                if state is _State.LOADED:
                    buf, event = rec.loaded, rec.load_event
                    h.uses += 1
                    if all(other.uses >= h.uses for other in rec.handles()):  # every live handle served
                        rec.to(_State.WRITTEN)  # first: what follows makes no call
                        rec.loaded = rec.load_event = None
                        self._prefetched -= rec.nbytes
                    rec.asked = False
                    break
                if state is _State.DEAD:
                    raise RuntimeError("save_on_disk: internal error: a saved tensor was never written")
                ask = (state is _State.WRITTEN or state is _State.LOADING) and not asked
                if ask:
                    rec.asked = True
                else:
                    waiter = self._waiter()
            if ask:
                self._events.put(rec)  # the reader loads it (and what was saved before it)
                asked = True
            else:
                self._wait(waiter)
        if self.prefetch_bytes and not asked:
            self._events.put((rec,))  # prefetch from here
        if src is not None:
            return _view(src.untyped_storage(), h, h.storage_offset)
        if event is not None:
            _use_here(buf, event)
        return _view(buf.untyped_storage(), h, h.rel_offset)

    # -- reader thread: deaths, demanded reads, prefetch
    def _reap(self, ref: _HandleRef) -> None:
        rec = ref.record
        with self._files.lock:
            if ref in rec.refs:
                rec.refs.remove(ref)
            if rec.state is _State.DEAD or rec.alive():
                return
            rec.to(_State.DEAD)
            rec.src = None  # a running write keeps its own reference until done
            if rec in self._parked:
                self._unpark(rec)
            if rec.loaded is not None:
                rec.loaded = rec.load_event = None
                self._prefetched -= rec.nbytes
            seg = rec.segment
            if seg is not None:
                seg.live -= 1
            fds = self._release(seg)
            self._notify()
        _close_all(fds)

    def _needs_load(self, rec: _Record) -> bool:
        seg = rec.segment
        return rec.state is _State.WRITTEN and seg is not None and seg.fd >= 0 and rec.alive()

    def _demand(self, rec: _Record, load: bool) -> None:
        with self._files.lock:
            seg = rec.segment
            if seg is None:  # kept in memory: read ahead from the newest record of its step on disk
                if rec.step > 0 and (self._prefetch_seg is None or self._prefetch_seg.step != rec.step):
                    newest = max((s for s in self._segments.values() if s.step == rec.step and s.fd >= 0),
                                 key=lambda s: s.index, default=None)
                    if newest is not None and newest.last_unpacked < 0:
                        newest.cursor = len(newest.records) - 1
                    self._prefetch_seg = newest
                return
            seg.cursor = rec.index - 1 if rec.index > seg.last_unpacked else min(seg.cursor, rec.index - 1)
            seg.last_unpacked = rec.index
            self._prefetch_seg = seg
            load = load and rec.asked and self._needs_load(rec)  # not if a prefetch served it meanwhile
            if load:
                self._start_load(rec)
        if load:
            self._load(rec)

    def _start_load(self, rec: _Record) -> None:
        rec.to(_State.LOADING)
        self._prefetched += rec.nbytes
        self._note_held()
        rec.segment.io += 1

    def _prefetch_one(self) -> bool:
        """Read the newest record saved before the last one unpacked, within the budget."""
        with self._files.lock:
            seg, found = self._prefetch_seg, None
            while seg is not None and found is None and self.prefetch_bytes:
                while seg.cursor >= 0 and found is None and seg.fd >= 0 and seg.failed is None:
                    r = seg.records[seg.cursor]
                    if self._needs_load(r) and r.awaited():  # not one this pass already used
                        if self._prefetched and self._prefetched + r.nbytes > self.prefetch_bytes:
                            return False
                        held = self._held()
                        if self.budget is not None and held and held + r.nbytes > self.budget:
                            return False  # reads ahead count against the budget: wait for room
                        found = r
                        self._start_load(r)
                    seg.cursor -= 1
                if found is None:
                    seg = self._prefetch_seg = seg.previous
        if found is None:
            return False
        self._load(found)
        return True

    def _load(self, rec: _Record) -> None:
        """Read ``rec`` back (reader thread)."""
        buf = event = failure = None
        try:
            buf, event = self._read_back(rec)
        except Exception as exc:  # noqa: BLE001 - the unpack that needs it is told
            failure = _failure(exc, f"save_on_disk: could not read {rec.nbytes} bytes from folder {self.folder!r} "
                                    f"({_where(rec)})")
        with self._files.lock:
            rec.segment.io -= 1
            if failure is None:
                self._bytes_read += rec.nbytes
            if rec.state is not _State.LOADING:  # dead or failed meanwhile: the bytes are not needed
                self._prefetched -= rec.nbytes
            elif failure is None:
                rec.to(_State.LOADED)
                rec.loaded, rec.load_event = buf, event
            else:
                rec.to(_State.WRITTEN)  # a later unpack asks again
                self._prefetched -= rec.nbytes
                rec.read_error = failure
            fds = self._release(rec.segment)
            self._notify()
        del buf
        _close_all(fds)

    def _read_back(self, rec: _Record) -> tuple[torch.Tensor, Any]:
        seg, n = rec.segment, rec.nbytes
        fd = seg.fd
        if rec.device.type == "cpu":
            buf = _host_buffer(n)
            _pread_all(fd, _bytes_at(buf.data_ptr(), n), rec.offset)
            return buf, None
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        _pread_all(fd, _bytes_at(pinned.data_ptr(), n), rec.offset)
        return _to_device(pinned, rec.device, self._stream(rec.device))

    # -- introspection and teardown
    def stats(self) -> OffloadStats:
        self._sync()
        with self._files.lock:
            fds = [s.fd for s in self._segments.values() if s.fd >= 0]
            return OffloadStats(
                directory=self.folder,
                bytes_in_memory=self._held(),
                bytes_pending_write=self._in_flight,
                bytes_prefetched=self._prefetched,
                bytes_offloaded=self._bytes_offloaded,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                bytes_on_disk=sum(os.fstat(fd).st_size for fd in fds),
                files_on_disk=len(fds),
                tensors_offloaded=self._offloaded,
                tensors_deduplicated=self._deduplicated,
                tensors_kept=self._kept,
                bytes_parked=self._parked_bytes,
                bytes_in_memory_peak=self._held_peak,
                budget_bytes=self.budget,
            )

    def flush(self) -> None:
        while True:
            with self._files.lock:
                if not self._in_flight or self.closed or os.getpid() != self._pid:
                    break
                waiter = self._waiter()
            self._wait(waiter)
        self._sync()
        with self._files.lock:
            self._check_usable()
            self._raise_pending()

    def close(self) -> None:
        with self._files.lock:
            self.closed = True
            for r in self._parked:
                r.to(_State.DEAD)
                r.src = None
            self._parked.clear()
            self._parked_bytes = 0
            self._notify()
        if os.getpid() != self._pid:
            _ENGINES.discard(self._me)
            return  # a forked child: its copies were closed after the fork
        self._writes.put(_STOP)  # the writer finishes, then the reader closes every file
        if threading.current_thread() not in self._threads:
            self._threads[1].join()

    def after_fork_in_child(self) -> None:
        """Close this process's copies of the parent's files: a forked child (a DataLoader worker)
        must not keep their blocks alive. The child has one thread; the lock may be held by a
        thread that no longer exists (the files replace it)."""
        self.closed = True
        _close_all(self._files.take_all_after_fork())


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
