"""The disk offload engine behind :class:`~lightning_gradhooks.offload.save_on_disk`: the
writer and reader threads, pack (forward) and unpack (backward) with prefetch, the handles
autograd keeps, CUDA side streams, statistics and teardown."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_gradhooks.offload._common import _ALIGN, DiskOffloadError, OffloadStats, _round_up
from lightning_gradhooks.offload._files import (
    _cleanup,
    _make_private_folder,
    _pread_all,
    _pwrite_all,
    _Record,
    _Segment,
)
from lightning_gradhooks.offload._memory import _buffer, _host_buffer, _PinnedPool


class _Handle:
    """What autograd keeps instead of an offloaded tensor: metadata and a record reference."""

    __slots__ = ("engine", "record", "dtype", "size", "stride", "storage_offset", "rel_offset")

    def __init__(self, engine: _Engine, record: _Record, t: torch.Tensor) -> None:
        self.engine, self.record, self.dtype = engine, record, t.dtype
        self.size, self.stride, self.storage_offset = t.size(), t.stride(), t.storage_offset()
        self.rel_offset = (t.storage_offset() * t.element_size() - record.byte_start) // t.element_size()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # may run at interpreter shutdown
            self.engine.handle_died(self.record)


def _view(storage: torch.UntypedStorage, h: _Handle, offset: int) -> torch.Tensor:
    return torch.empty(0, dtype=h.dtype, device=storage.device).set_(storage, offset, h.size, h.stride)


class _Engine:
    """Owns the folder, files, threads and records of one :class:`save_on_disk`."""

    def __init__(self, threshold: int, directory: str | os.PathLike[str] | None, max_in_flight: int,
                 prefetch_bytes: int, segment_bytes: int, drop_page_cache: bool) -> None:
        self.threshold, self.max_in_flight, self.drop_page_cache = threshold, max_in_flight, drop_page_cache
        self.prefetch_bytes, self.segment_bytes = prefetch_bytes, segment_bytes
        self.folder = _make_private_folder(directory)
        self.closed = False
        self._pid = os.getpid()  # a forked child must not delete its parent's files
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._dead: collections.deque[_Record] = collections.deque()  # handles died, not yet counted
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="save_on_disk-writer")
        self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix="save_on_disk-reader")
        self._segments: dict[int, _Segment] = {}
        self._current: _Segment | None = None
        self._indices = itertools.count()
        self._dedupe: dict[tuple[torch.device, int], list[_Record]] = {}
        self._resident_modules: list[weakref.ref[nn.Module]] = []
        self._resident_ptrs: set[int] = set()
        self._error: BaseException | None = None
        self._in_flight = self._prefetched = self._bytes_offloaded = self._bytes_written = self._bytes_read = 0
        self._offloaded = self._deduplicated = self._kept = 0
        self._pool: _PinnedPool | None = None
        self._streams: dict[tuple[str, torch.device], Any] = {}
        self._finalizer = weakref.finalize(
            self, _cleanup, self.folder, self._segments, (self._writer, self._reader), self._pid
        )

    # -- locking: handles die in any thread (even inside our own critical sections, via the
    # garbage collector), so a death is queued and counted by whoever holds the lock.
    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        with self._lock:
            try:
                yield
            finally:
                self._reap()
        while self._dead and self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def handle_died(self, record: _Record) -> None:
        self._dead.append(record)
        if self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def _reap(self) -> None:
        while self._dead:
            rec = self._dead.popleft()
            rec.handles -= 1
            if rec.handles == 0:
                self._drop(rec)

    def _drop(self, rec: _Record) -> None:
        seg = rec.segment
        rec.src = None  # a running write keeps its own reference until done
        if not rec.written and rec.write_future is not None and rec.write_future.cancel():
            self._in_flight -= rec.nbytes  # the queued write will not run
            seg.io -= 1
            self._cond.notify_all()
            if rec.pinned is not None and self._pool is not None:
                self._pool.put(rec.pinned, rec.event)
                rec.pinned = rec.event = None
        if rec.loaded is not None:
            self._unhold(rec)
        if rec.loading is not None and rec.loading.cancel():
            rec.loading = None
            self._prefetched -= rec.nbytes
            seg.io -= 1
        seg.live -= 1
        self._maybe_release(seg)

    def _unhold(self, rec: _Record) -> None:
        rec.loaded = rec.load_event = None
        self._prefetched -= rec.nbytes

    def _maybe_release(self, seg: _Segment) -> None:
        """Delete a sealed segment's file once no handle needs it; close it once its I/O is done."""
        if seg.sealed and seg.live == 0 and os.getpid() == self._pid:
            seg.unlink()  # a write still running goes to the nameless file
            if seg.io == 0 and seg.fd >= 0:
                seg.close()
                self._segments.pop(seg.index, None)

    def _raise_error(self) -> None:
        if self.closed:
            raise RuntimeError("save_on_disk is closed: its offloaded tensors were deleted")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- steps
    def begin_step(self) -> None:
        with self._guard():
            self._raise_error()
            self._resident_ptrs = {
                t.untyped_storage().data_ptr()
                for ref in self._resident_modules if (module := ref()) is not None
                for t in itertools.chain(module.parameters(), module.buffers())
            }

    def end_step(self, raise_error: bool) -> None:
        with self._guard():
            self._seal()
            self._dedupe.clear()
            if raise_error and self._error is not None:
                self._raise_error()

    def _seal(self) -> None:
        if self._current is not None:
            self._current.sealed = True
            self._current.cursor = len(self._current.records) - 1  # prefetch may come from a later file
            self._maybe_release(self._current)
            self._current = None

    def keep_in_memory(self, modules: tuple[nn.Module, ...]) -> None:
        with self._guard():
            self._resident_modules.extend(weakref.ref(m) for m in modules)
            self._resident_ptrs.update(
                t.untyped_storage().data_ptr() for m in modules for t in itertools.chain(m.parameters(), m.buffers())
            )

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

    def pack(self, t: torch.Tensor) -> Any:
        region = self._region(t)
        if region is None:
            with self._guard():
                self._raise_error()
                self._kept += 1
            return t.detach()
        storage, start, nbytes, region_start, region_bytes = region
        with self._guard():
            self._raise_error()
            rec = self._find_duplicate(t, storage, start, nbytes)
            new = rec is None
            if rec is None:
                rec = self._new_record(t, storage, region_start, region_bytes)
            rec.handles += 1
            handle = _Handle(self, rec, t)
        if new:
            try:
                if rec.device.type == "cuda":
                    self._copy_to_host(rec, storage)
                rec.write_future = self._writer.submit(self._write, rec)
            except BaseException:
                with self._guard():  # the write will never run: give back what it reserved
                    rec.src = None
                    self._in_flight -= rec.nbytes
                    rec.segment.io -= 1
                    self._cond.notify_all()
                raise
        return handle

    def _find_duplicate(
        self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int
    ) -> _Record | None:
        elsize = t.element_size()
        for rec in self._dedupe.get((t.device, storage.data_ptr()), ()):
            if (rec.handles > 0 and rec.segment.failed is None and not rec.storage_ref.expired()
                    and rec.version == t._version and rec.byte_start <= start
                    and start + nbytes <= rec.byte_start + rec.nbytes and rec.byte_start % elsize == 0):
                self._deduplicated += 1
                return rec
        return None

    def _new_record(self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int) -> _Record:
        while self._in_flight and self._in_flight + nbytes > self.max_in_flight:  # backpressure
            self._cond.wait()
            self._raise_error()
        seg = previous = self._current
        if seg is not None and seg.records and seg.size + nbytes > self.segment_bytes:
            self._seal()
            seg = None
        if seg is None:
            index = next(self._indices)
            path = os.path.join(self.folder, f"{index:06d}.bin")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise DiskOffloadError(exc.errno, f"save_on_disk: could not create a file for {nbytes} bytes in "
                                                  f"folder {self.folder!r}: {exc.strerror or exc}") from exc
            seg = self._current = self._segments[index] = _Segment(index, path, fd)
            seg.previous = previous
            if self.drop_page_cache and hasattr(os, "O_DIRECT"):
                with contextlib.suppress(OSError):  # e.g. tmpfs: buffered reads instead
                    seg.direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        # O_DIRECT moves whole aligned blocks between aligned memory and aligned file offsets:
        # place the record at a file offset congruent to its address, so that all but a head and
        # a tail (written through the page cache) can go straight to the device.
        address = storage.data_ptr() + start
        direct = seg.direct_fd >= 0 and t.device.type == "cpu" and address % 64 == 0
        rec = _Record(seg, _round_up(seg.size, _ALIGN) + (address % _ALIGN if direct else 0), nbytes, start, t,
                      storage)
        rec.direct = direct
        seg.records.append(rec)
        seg.size = rec.offset + nbytes
        seg.live += 1
        seg.io += 1  # the write
        self._in_flight += nbytes
        self._bytes_offloaded += nbytes
        self._offloaded += 1
        self._dedupe.setdefault((t.device, storage.data_ptr()), []).append(rec)
        return rec

    def _stream(self, kind: str, device: torch.device) -> Any:
        with self._lock:
            if (kind, device) not in self._streams:
                self._streams[kind, device] = torch.cuda.Stream(device)
            if self._pool is None:
                self._pool = _PinnedPool(self.max_in_flight + self.prefetch_bytes)
            return self._streams[kind, device]

    def _copy_to_host(self, rec: _Record, storage: torch.UntypedStorage) -> None:
        """Start the device-to-host copy on a side stream into a pooled pinned buffer."""
        stream = self._stream("d2h", rec.device)
        assert self._pool is not None
        pinned = self._pool.get(rec.nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=rec.device).set_(storage, rec.byte_start, (rec.nbytes,), (1,))
        stream.wait_stream(torch.cuda.current_stream(rec.device))  # the tensor is computed
        with torch.cuda.stream(stream):
            pinned[: rec.nbytes].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # the allocator keeps the memory until the copy is done
        rec.pinned, rec.event = pinned, event

    # -- writer thread
    def _write(self, rec: _Record) -> None:
        seg = rec.segment
        with self._guard():
            src, pinned, event = rec.src, rec.pinned, rec.event
            skip = rec.handles == 0 or seg.failed is not None or self.closed or (src is None and pinned is None)
        error: BaseException | None = None
        try:
            if not skip:
                if event is not None:
                    event.synchronize()
                address = pinned.data_ptr() if pinned is not None else src.untyped_storage().data_ptr() + rec.byte_start
                n, head = rec.nbytes, min(rec.nbytes, -rec.offset % _ALIGN) if rec.direct else rec.nbytes
                body = (n - head) // _ALIGN * _ALIGN
                for fd, at, length in ((seg.fd, 0, head), (seg.direct_fd, head, body), (seg.fd, head + body,
                                                                                        n - head - body)):
                    if length:
                        _pwrite_all(fd, _buffer(address + at, length), rec.offset + at)
                if self.drop_page_cache and not rec.direct:
                    os.fdatasync(seg.fd)
                    os.posix_fadvise(seg.fd, rec.offset, rec.nbytes, os.POSIX_FADV_DONTNEED)
                if src is not None and src._version != rec.version:
                    rec.error = RuntimeError(
                        "save_on_disk: a tensor saved for backward was modified by an in-place operation before it "
                        f"was written (version {rec.version}, now {src._version}); autograd cannot use it"
                    )
        except OSError as exc:
            error = DiskOffloadError(exc.errno, f"save_on_disk: could not write {rec.nbytes} bytes to folder "
                                                f"{self.folder!r} (file {os.path.basename(seg.path)}, offset "
                                                f"{rec.offset}): {exc.strerror or exc}")
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
            error = exc
        finally:
            del src
            with self._guard():
                rec.src = None
                rec.written = not skip and error is None
                if pinned is not None:
                    rec.pinned = rec.event = None
                    assert self._pool is not None
                    self._pool.put(pinned, event)  # a skipped write may leave its copy running
                self._in_flight -= rec.nbytes
                if error is not None:
                    self._fail(seg, error)
                elif rec.written:
                    self._bytes_written += rec.nbytes
                seg.io -= 1
                self._cond.notify_all()
                self._maybe_release(seg)

    def _fail(self, seg: _Segment, error: BaseException) -> None:
        """Poison the segment and remove its file now; the error surfaces in the training thread."""
        if seg.failed is None:
            seg.failed = error
            seg.unlink()
            if self._error is None:
                self._error = error

    # -- unpack (backward)
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        h, rec = packed, packed.record
        while True:
            read_here = None
            with self._guard():
                self._raise_error()
                for error in (rec.segment.failed, rec.error):
                    if error is not None:
                        raise error
                if rec.read_error is not None:
                    error, rec.read_error = rec.read_error, None
                    raise error
                src = rec.src
                if src is not None:  # CPU, not written yet: still in memory
                    if src._version != rec.version:
                        raise RuntimeError("save_on_disk: a tensor saved for backward was modified by an in-place "
                                           "operation; autograd cannot use it")
                    self._prefetch(rec)
                    return _view(src.untyped_storage(), h, h.storage_offset)
                if rec.loaded is not None:
                    buf, event = rec.loaded, rec.load_event
                    rec.served += 1
                    if rec.served >= rec.handles:
                        self._unhold(rec)
                    self._prefetch(rec)
                    break
                if rec.loading is not None:  # being read ahead
                    wait = rec.loading
                elif not rec.written:  # CUDA: its host copy is being written
                    wait = rec.write_future
                    if wait is None or wait.done():
                        raise RuntimeError("save_on_disk: internal error: a saved tensor was never written")
                else:
                    wait = read_here = rec.loading = cf.Future()
                    wait.set_running_or_notify_cancel()
                    self._prefetched += rec.nbytes
                    rec.segment.io += 1
            if read_here is not None:
                self._load(rec, read_here)
            else:
                cf.wait([wait])
        if event is not None:
            stream = torch.cuda.current_stream(buf.device)
            stream.wait_event(event)  # the host-to-device copy is done
            buf.record_stream(stream)
        return _view(buf.untyped_storage(), h, h.rel_offset)

    def _prefetch(self, rec: _Record) -> None:
        """Queue reads of the records saved before ``rec``, newest first, within the budget."""
        seg = rec.segment
        seg.cursor = rec.index - 1 if rec.index > seg.last_unpacked else min(seg.cursor, rec.index - 1)
        seg.last_unpacked = rec.index
        while seg is not None and seg.fd >= 0 and seg.failed is None and self.prefetch_bytes:
            while seg.cursor >= 0:
                r = seg.records[seg.cursor]
                if r.handles > 0 and r.written and r.loaded is None and r.loading is None:
                    if self._prefetched and self._prefetched + r.nbytes > self.prefetch_bytes:
                        return
                    self._prefetched += r.nbytes
                    seg.io += 1
                    r.loading = self._reader.submit(self._load, r)
                seg.cursor -= 1
            seg = seg.previous

    def _load(self, rec: _Record, future: cf.Future[Any] | None = None) -> None:
        """Read ``rec`` back (reader thread, or the caller when not prefetched)."""
        buf = event = error = None
        try:
            buf, event = self._read_back(rec)
        except OSError as exc:
            error = DiskOffloadError(exc.errno, f"save_on_disk: could not read {rec.nbytes} bytes from folder "
                                                f"{self.folder!r}: {exc.strerror or exc}")
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
            error = exc
        with self._guard():
            rec.loading = None
            rec.segment.io -= 1
            if error is None:
                self._bytes_read += rec.nbytes
            if error is None and rec.handles > 0:
                rec.loaded, rec.load_event, rec.served = buf, event, 0
            else:
                self._prefetched -= rec.nbytes
                rec.read_error = error
            self._maybe_release(rec.segment)
        if future is not None:
            future.set_result(None)

    def _read_back(self, rec: _Record) -> tuple[torch.Tensor, Any]:
        fd, n = rec.segment.fd, rec.nbytes
        if rec.device.type == "cpu":
            if rec.direct:  # whole aligned blocks, the record at its offset within the first one
                skip = rec.offset % _ALIGN
                buf, address = _host_buffer(n, skip)
                span = _round_up(skip + n, _ALIGN)
                _pread_all(rec.segment.direct_fd, _buffer(address, span), rec.offset - skip, skip + n)
                return buf, None
            buf, _ = _host_buffer(n)
            _pread_all(fd, _buffer(buf.data_ptr(), n), rec.offset)
            self._after_read(fd, rec)
            return buf, None
        stream = self._stream("h2d", rec.device)
        assert self._pool is not None
        pinned, event = self._pool.get(n), None
        try:
            _pread_all(fd, _buffer(pinned.data_ptr(), n), rec.offset)
            self._after_read(fd, rec)
            with torch.cuda.device(rec.device), torch.cuda.stream(stream):
                buf = torch.empty(n, dtype=torch.uint8, device=rec.device)  # allocated on the side stream
                buf.copy_(pinned[:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        finally:
            self._pool.put(pinned, event)
        return buf, event

    def _after_read(self, fd: int, rec: _Record) -> None:
        if self.drop_page_cache:
            os.posix_fadvise(fd, rec.offset, rec.nbytes, os.POSIX_FADV_DONTNEED)

    # -- introspection and teardown
    def stats(self) -> OffloadStats:
        with self._guard():
            linked = [s for s in self._segments.values() if s.linked]
            return OffloadStats(
                directory=self.folder,
                bytes_in_memory=self._in_flight + self._prefetched,
                bytes_pending_write=self._in_flight,
                bytes_prefetched=self._prefetched,
                bytes_offloaded=self._bytes_offloaded,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                bytes_on_disk=sum(os.fstat(s.fd).st_size for s in linked if s.fd >= 0),
                files_on_disk=len(linked),
                tensors_offloaded=self._offloaded,
                tensors_deduplicated=self._deduplicated,
                tensors_kept=self._kept,
            )

    def flush(self) -> None:
        with self._guard():
            while self._in_flight and not self.closed:
                self._cond.wait()
            self._raise_error()

    def close(self) -> None:
        with self._guard():
            if self.closed:
                return
            self.closed = True
            self._current = None
            self._cond.notify_all()
        current = threading.current_thread().name
        for executor in (self._writer, self._reader):
            executor.shutdown(wait=not current.startswith("save_on_disk-"), cancel_futures=True)
        self._finalizer()
