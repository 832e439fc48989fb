"""File bookkeeping of the disk offload engine: unnamed files in the offload folder (``O_TMPFILE``,
else created and unlinked at once), the segments (one file receiving a step's tensors) and the
records (storage regions written to them), and whole-buffer ``pwrite``/``pread`` helpers.

Files are opened and closed only by the engine's own threads (and by a forked child, for its
copies), never by code that a ``KeyboardInterrupt`` can split. A descriptor is always taken out
of its owner before it is closed.
"""

from __future__ import annotations

import enum
import errno
import os
import secrets
import threading
import weakref
from typing import Any

import torch

from lightning_gradhooks.offload._common import _ALIGN, DiskOffloadError

# An error for the training thread, kept without traceback or frames: its class, its arguments and
# the exception that caused it (its traceback dropped), which it is raised from.
Failure = tuple[type[BaseException], tuple[Any, ...], BaseException]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def _pread_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read: {done} of {len(data)} bytes, then end of file")
        done += n


def _free_bytes(fd: int) -> int:
    """Bytes an unprivileged process can still write in the file system of ``fd``."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def _open_unnamed(dir_fd: int) -> tuple[int, bool]:
    """Open a file that has no name in the folder ``dir_fd``: (fd, O_TMPFILE used).

    ``O_TMPFILE`` (Linux 3.11+; ext4, xfs, btrfs, tmpfs) never gives the file a name. Where it is
    refused, a file with a random name is created exclusively and unlinked at once.
    """
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(".", os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError:
            pass  # kernel or file system without O_TMPFILE
        else:
            return fd, True
    name = f".save_on_disk-{os.getpid()}-{secrets.token_hex(8)}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def _open_folder(directory: str) -> tuple[int, bool]:
    """Open the offload folder and check that it takes an unnamed file: (folder fd, O_TMPFILE used).

    Runs in a helper thread (see :func:`_in_thread`), so no interrupt can leave a probe file behind.
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DiskOffloadError(exc.errno, f"save_on_disk: expected an existing folder, got {directory!r}: "
                                          f"{exc.strerror or exc}") from None
    try:
        fd, tmpfile = _open_unnamed(dir_fd)
        try:
            _pwrite_all(fd, memoryview(bytes(_ALIGN)), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        os.close(dir_fd)
        raise DiskOffloadError(exc.errno, f"save_on_disk: expected a folder that can hold an unnamed file, got "
                                          f"{directory!r}: creating and writing one failed: "
                                          f"{exc.strerror or exc}") from None
    return dir_fd, tmpfile


def _in_thread(name: str, fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` in a new thread and return its result (or raise its exception)."""
    import queue

    box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def run() -> None:
        try:
            box.put((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.put((False, exc))

    threading.Thread(target=run, name=name, daemon=True).start()
    ok, value = box.get()
    if not ok:
        raise value
    return value


def _close_all(fds: list[int] | tuple[int, ...]) -> None:
    """Close every descriptor, also after one fails (Linux releases it anyway); then raise the first error."""
    error = None
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError as exc:
                error = error or exc
    if error is not None:
        raise error


class _Segment:
    """One unnamed file receiving a step's tensors, appended sequentially."""

    __slots__ = ("index", "step", "fd", "size", "records", "live", "io", "failed", "cursor",
                 "last_unpacked", "previous")

    def __init__(self, index: int, step: int, fd: int) -> None:
        self.index, self.step, self.fd = index, step, fd
        self.size = 0  # next free offset
        self.records: list[_Record] = []  # in order of saving, for prefetch
        self.live = 0  # records with a live handle
        self.io = 0  # reads and writes running on fd
        self.failed: Failure | None = None
        self.cursor = -1  # next record to consider for prefetch
        self.last_unpacked = -1
        self.previous: _Segment | None = None  # the same step's earlier file, for prefetch

    def take_fd(self) -> int:
        """Take the descriptor out (the caller closes it): a later take gets -1."""
        fd, self.fd = self.fd, -1
        return fd


class _Files:
    """The folder descriptor, the open segments and the lock: what the engine's threads need even
    after the engine itself was garbage collected (to close every descriptor). The engine takes
    :attr:`lock` for all its state; this object is its one owner."""

    def __init__(self, folder: str, dir_fd: int, tmpfile: bool) -> None:
        self.folder, self.dir_fd, self.tmpfile = folder, dir_fd, tmpfile
        #: The engine's lock (its records, segments and counters), taken only through ``with``.
        self.lock = threading.Lock()
        self.segments: dict[int, _Segment] = {}

    def take_all(self) -> list[int]:
        """Take every descriptor out, drop what records hold; the caller closes the result."""
        fds = [self.dir_fd]
        self.dir_fd = -1
        for seg in self.segments.values():
            fds.append(seg.take_fd())
            for rec in seg.records:
                rec.src = rec.loaded = rec.pinned = None
        self.segments.clear()
        return fds

    def take_all_after_fork(self) -> list[int]:
        """:meth:`take_all` in a forked child, whose one thread cannot wait for a lock that a
        thread of the parent held at the fork: the lock is replaced first."""
        self.lock = threading.Lock()
        return self.take_all()

    def close_all(self) -> None:
        with self.lock:
            fds = self.take_all()
        _close_all(fds)


class _State(enum.Enum):
    """Where an offloaded record's bytes are: one state per record, changed only by :meth:`_Record.to`."""

    PARKED = "kept in memory by the engine (under a budget, or until handed to the writer)"
    QUEUED = "handed to the writer thread, or being written: served from memory while its source is"
    WRITTEN = "on disk only"
    LOADING = "being read back by the reader thread"
    LOADED = "read back, held until every live handle was served (then WRITTEN again)"
    FAILED = "its step's write failed: the bytes are lost and unpack raises ``failure``"
    DEAD = "no handle needs it any more (every handle died, or the engine closed)"


_TRANSITIONS: dict[_State, frozenset[_State]] = {
    # PARKED -> WRITTEN: a hand-over interrupted right after the writer's queue took the record.
    _State.PARKED: frozenset({_State.QUEUED, _State.WRITTEN, _State.FAILED, _State.DEAD}),
    _State.QUEUED: frozenset({_State.WRITTEN, _State.FAILED, _State.DEAD}),
    _State.WRITTEN: frozenset({_State.LOADING, _State.FAILED, _State.DEAD}),
    # LOADING -> WRITTEN: the read failed (``read_error``); a later unpack asks again.
    _State.LOADING: frozenset({_State.LOADED, _State.WRITTEN, _State.FAILED, _State.DEAD}),
    _State.LOADED: frozenset({_State.WRITTEN, _State.FAILED, _State.DEAD}),
    _State.FAILED: frozenset({_State.DEAD}),
    _State.DEAD: frozenset(),
}


class _Record:
    """One storage region written to a segment, shared by the handles of its views. Its lifecycle is
    ``state`` (see :class:`_State`); the other fields are what that state holds."""

    __slots__ = ("segment", "index", "offset", "nbytes", "byte_start", "device", "storage_ref", "version",
                 "step", "input", "src", "pinned", "event", "refs", "state", "failure", "loaded",
                 "load_event", "read_error", "asked")

    def __init__(self, t: torch.Tensor, storage: torch.UntypedStorage, byte_start: int, nbytes: int) -> None:
        self.segment: _Segment | None = None  # assigned by the writer thread
        self.index = self.offset = -1
        self.nbytes, self.byte_start, self.device = nbytes, byte_start, t.device
        # A plain weak reference: torch's StorageWeakRef frees itself in a Python ``__del__``, where
        # a Ctrl-C landing as a record dies would be printed and lost.
        self.storage_ref, self.version = weakref.ref(storage), t._version
        self.step = -1
        self.input = t.grad_fn is None  # not computed by the graph (the batch): the caller may hold it
        self.src: torch.Tensor | None = t.detach()  # until written (CUDA: until copied to host)
        self.pinned: torch.Tensor | None = None  # CUDA: host copy until written
        self.event: Any = None  # CUDA: device-to-host copy done
        self.refs: list[_HandleRef] = []  # weak references to the handles autograd keeps
        self.state = _State.PARKED
        self.failure: Failure | None = None  # FAILED: the error unpack raises
        self.loaded: torch.Tensor | None = None  # LOADED: the bytes read back
        self.load_event: Any = None  # LOADED, CUDA: host-to-device copy done
        self.read_error: Failure | None = None  # the last read failed: the next unpack raises it once
        self.asked = False  # an unpack waits for it (a request, not a state)

    def to(self, state: _State) -> None:
        """Move to ``state`` (the engine's lock held): the one place a record's lifecycle changes."""
        assert state in _TRANSITIONS[self.state], f"save_on_disk: internal error: record {self.state.name} -> {state.name}"
        self.state = state

    def alive(self) -> bool:
        for ref in self.refs:
            if ref() is not None:
                return True
        return False

    def handles(self) -> list[Any]:
        """The handles (autograd's saved variables) still alive."""
        return [h for ref in self.refs if (h := ref()) is not None]

    def awaited(self) -> bool:
        """Whether a live handle was never unpacked: the backward pass running now still needs it.
        (A second backward of a retained graph reads on demand, without read-ahead.)"""
        for ref in self.refs:
            h = ref()
            if h is not None and h.uses == 0:
                return True
        return False


class _HandleRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a handle that knows its record. Its callback is a queue's C ``put``,
    so a dying handle runs no Python code: the engine's reader thread does the rest."""

    __slots__ = ("record",)
