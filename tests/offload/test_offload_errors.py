"""Faults inside the offload engine's threads: a failed or short read while reading ahead, a failed
write, an unexpected error in the reader or the writer thread, a disk slower than the engine's waits.

Each test checks the error (type, message, the original exception as ``__cause__``) where it must
surface (the backward or the forward that needs the data), that nothing hangs, and that nothing is
left behind: the engine's threads end, every descriptor it opened is closed, the folder is as it was;
then that training goes on (the same engine after an I/O error, a new one after a thread failed).
"""

from __future__ import annotations

import errno
import gc
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gradhooks.offload import gate as offload_gate
from lightning_gradhooks.offload import reader, segments, writer  # their I/O calls are patched below
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk

from test_offload import batch, files, mlp, train_step

MiB = 1 << 20


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a helper thread; fail (instead of hanging the suite) if it takes longer."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: a hang"
    ok, value = box[0]
    if not ok:
        raise value
    return value


def open_fds() -> set[tuple[str, str]]:
    """This process's descriptors, with what each points to."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    return found


@pytest.fixture
def before(tmp_path: Path) -> set[tuple[str, str]]:
    """The descriptors open before the test's engine exists (after torch's own lazy set-up)."""
    train_step(mlp(), batch(), None)
    return open_fds()


def assert_left_nothing(e: save_on_disk, before: set[tuple[str, str]], folder: Path) -> None:
    """``e`` (closed here if it is not yet) left no thread, descriptor or file behind."""
    threads = e._engine.gate.threads
    within(10, e.close)
    for t in threads:
        t.join(10)
    assert not [t for t in threading.enumerate() if t in threads]
    assert open_fds() - before == set()
    assert os.listdir(folder) == []


def assert_caused_by(err: BaseException, kind: type[BaseException]) -> BaseException:
    """``err`` chains the original exception, kept without its traceback (whose frames would hold the
    engine and its buffers)."""
    cause = err.__cause__
    assert isinstance(cause, kind) and cause.__traceback__ is None
    assert err.__context__ is None  # nothing else (no queue.Empty) chained
    return cause


def frames() -> set[str]:
    """The names of the functions on the calling thread's stack."""
    names, f = set(), sys._getframe()
    while f is not None:
        names.add(f.f_code.co_name)
        f = f.f_back
    return names


# ---------------------------------------------------------------------------- I/O errors: the engine goes on


@pytest.mark.parametrize("fault", ["eio", "short", "no_memory"])
def test_read_ahead_failure_is_raised_at_the_unpack_that_needs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  before: set, fault: str) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    model, x = mlp(), batch()
    with e:
        loss = model(x).sum()
    e.flush()
    real_read, real_buffer = reader.pread_all, reader.host_buffer
    calls: list[set[str]] = []

    def buffer(nbytes: int, *a: Any) -> Any:  # each read starts here; the first one (on demand) works
        calls.append(frames())
        if len(calls) > 1 and fault == "no_memory":
            raise MemoryError(f"cannot map {nbytes} bytes")
        return real_buffer(nbytes, *a)

    def read(fd: int, data: memoryview, offset: int) -> None:
        if len(calls) > 1 and fault == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if len(calls) > 1 and fault == "short":
            os.ftruncate(fd, offset + len(data) // 2)  # the file lost its tail: half of the record is there
        real_read(fd, data, offset)

    monkeypatch.setattr(reader, "pread_all", read)
    monkeypatch.setattr(reader, "host_buffer", buffer)
    with pytest.raises(DiskOffloadError) as info:
        within(10, loss.backward)
    err = info.value
    assert "_prefetch_one" in calls[1]  # it failed while reading ahead
    message = str(err)
    assert f"could not read {MiB} bytes from folder {str(tmp_path)!r} (file #0, offset " in message
    if fault == "eio":
        assert err.errno == errno.EIO and assert_caused_by(err, OSError).errno == errno.EIO
    elif fault == "short":
        assert err.errno == errno.EIO and f"short read: {MiB // 2} of {MiB} bytes" in message
        assert assert_caused_by(err, OSError).errno == errno.EIO
    else:
        assert err.errno is None and f"MemoryError: cannot map {MiB} bytes" in message
        assert_caused_by(err, MemoryError)
    del info, err, loss
    gc.collect()
    assert files(e) == [] and e.stats().bytes_in_memory == 0  # freed with the graph
    monkeypatch.undo()
    ref = train_step(model, x, None)  # the disk works again: so does the engine
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, e), strict=True))
    assert_left_nothing(e, before, tmp_path)


@pytest.mark.parametrize("fault", ["full", "open_no_memory", "late"])
def test_write_failure_is_raised_in_the_forward_or_at_the_unpack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 before: set, fault: str) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    model, x = mlp(), batch()
    gate = threading.Event()
    real_open = segments.open_unnamed

    def write(*a: Any) -> None:
        if fault == "late":
            gate.wait(10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_unnamed(*a: Any) -> Any:
        if fault == "open_no_memory":
            raise MemoryError("no memory for a file")
        return real_open(*a)

    monkeypatch.setattr(writer, "pwrite_all", write)
    monkeypatch.setattr(segments, "open_unnamed", open_unnamed)

    def step() -> None:
        with e:
            loss = model(x).sum()
        if fault == "late":  # the forward ended before the writes failed: the backward tells
            gate.set()
            while e.stats().bytes_pending_write:
                threading.Event().wait(0.01)
        loss.backward()

    with pytest.raises(DiskOffloadError) as info:
        within(10, step)
    err = info.value
    message = str(err)
    assert str(tmp_path) in message and f"{MiB} bytes" in message
    if fault == "open_no_memory":
        assert err.errno is None and "could not create a file" in message and "MemoryError" in message
        assert_caused_by(err, MemoryError)
    else:
        assert err.errno == errno.ENOSPC and "could not write" in message and "(file #0, offset " in message
        assert assert_caused_by(err, OSError).errno == errno.ENOSPC
    del info, err
    gc.collect()
    assert files(e) == [] and e.stats().bytes_in_memory == 0
    monkeypatch.undo()
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, train_step(model, x, e), strict=True))
    assert_left_nothing(e, before, tmp_path)


# ---------------------------------------------------------------------------- a thread fails: the engine closes


def check_closed_by_its_thread(e: save_on_disk, err: BaseException, thread: str, kind: type[BaseException],
                               before: set, folder: Path) -> None:
    """A thread's failure closed the engine: the error names it, later uses raise it again, and the
    threads, descriptors and files are gone without a call to close()."""
    message = str(err)
    assert f"the {thread} thread failed" in message and str(folder) in message and "closed itself" in message
    assert_caused_by(err, kind)
    for t in e._engine.gate.threads:
        t.join(10)
    assert not [t for t in threading.enumerate() if t in e._engine.gate.threads]
    assert open_fds() - before == set() and os.listdir(folder) == []
    assert e.closed
    with pytest.raises(DiskOffloadError, match=f"the {thread} thread failed"):
        e.__enter__()  # told again, not a bare "closed"
    assert not e.active
    assert_left_nothing(e, before, folder)
    model, x = mlp(), batch()  # a new engine works
    fresh = save_on_disk(threshold_bytes=64 << 10, directory=folder)
    ref = train_step(model, x, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, within(20, lambda: train_step(model, x, fresh)), strict=True))
    assert_left_nothing(fresh, before, folder)


def test_reader_thread_failing_while_reading_ahead_fails_the_next_unpack(tmp_path: Path, before: set,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    with e:
        loss = mlp()(batch()).sum()
    e.flush()

    def broken() -> bool:
        raise ValueError("read-ahead bookkeeping broke")

    monkeypatch.setattr(e._engine.reader, "_prefetch_one", broken)
    with pytest.raises(DiskOffloadError) as info:
        within(10, loss.backward)  # the first unpack is served; the next one needs the reader
    err = info.value
    del loss, info
    gc.collect()
    check_closed_by_its_thread(e, err, "reader", ValueError, before, tmp_path)


def test_reader_thread_failing_to_close_a_file_fails_the_next_step(tmp_path: Path, before: set,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path)
    model, x = mlp(), batch()
    real_close = reader.close_all

    def close_all(fds: list[int]) -> None:  # as NFS can: the descriptor is closed, close() says EIO
        real_close(fds)
        if any(fd >= 0 for fd in fds):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(reader, "close_all", close_all)
    monkeypatch.setattr(writer, "close_all", close_all)
    with e:
        loss = model(x).sum()
    within(10, loss.backward)  # every tensor came back; the reader closes the freed file after
    del loss

    def step() -> None:
        with e:
            loss = model(x).sum()
        e.flush()  # on disk: the backward needs the reader
        loss.backward()

    with pytest.raises(DiskOffloadError) as info:
        within(10, step)
    err = info.value
    del info
    assert "file #0" in str(err) and err.errno == errno.EIO
    check_closed_by_its_thread(e, err, "reader", OSError, before, tmp_path)


def test_writer_thread_failing_fails_the_forward(tmp_path: Path, before: set, monkeypatch: pytest.MonkeyPatch) -> None:
    e = save_on_disk(threshold_bytes=64 << 10, directory=tmp_path, max_bytes_in_flight=2 * MiB)

    def broken(rec: Any) -> None:
        raise RuntimeError("writer bookkeeping broke")

    monkeypatch.setattr(e._engine.writer, "_write", broken)

    def step() -> None:
        with e:
            mlp(depth=8)(batch()).sum().backward()

    with pytest.raises(DiskOffloadError) as info:
        within(10, step)  # the forward waits for the writer (2 MiB in flight), which has failed
    err = info.value
    del info
    assert f"{MiB} bytes" in str(err)
    check_closed_by_its_thread(e, err, "writer", RuntimeError, before, tmp_path)


# ---------------------------------------------------------------------------- slow is not an error


def test_a_disk_slower_than_the_waits_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    before: set) -> None:
    monkeypatch.setattr(offload_gate, "_WAIT_S", 0.02)  # how often a wait checks on the threads
    real_write, real_read = writer.pwrite_all, reader.pread_all
    monkeypatch.setattr(writer, "pwrite_all", lambda *a: threading.Event().wait(0.1) or real_write(*a))
    monkeypatch.setattr(reader, "pread_all", lambda *a: threading.Event().wait(0.1) or real_read(*a))
    e = save_on_disk(threshold_bytes=MiB, directory=tmp_path, max_bytes_in_flight=MiB, prefetch_bytes=0)
    model, x = mlp(depth=2), batch()
    ref = train_step(model, x, None)
    got = within(20, lambda: train_step(model, x, e))  # every pack and unpack waits for a slow disk
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert_left_nothing(e, before, tmp_path)
