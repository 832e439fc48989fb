"""The operating system's side of the disk offload engine: unnamed files in the offload folder
(``O_TMPFILE``, else created and unlinked at once), whole-buffer ``pwrite``/``pread``, free space,
closing descriptors, and running a call in a helper thread.

Files are opened and closed only by the engine's own threads (and by a forked child, for its
copies), never by code that a ``KeyboardInterrupt`` can split. A descriptor is always taken out
of its owner (:class:`~lightning_gradhooks.offload.segments.Segments`) before it is closed.
"""

from __future__ import annotations

import errno
import os
import queue
import secrets
import threading
from typing import Any

from lightning_gradhooks.offload._common import ALIGN, DiskOffloadError

__all__ = ["close_all", "free_bytes", "in_thread", "open_folder", "open_unnamed", "pread_all", "pwrite_all"]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def pread_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read: {done} of {len(data)} bytes, then end of file")
        done += n


def free_bytes(fd: int) -> int:
    """Bytes an unprivileged process can still write in the file system of ``fd``."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def open_unnamed(dir_fd: int) -> tuple[int, bool]:
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


def open_folder(directory: str) -> tuple[int, bool]:
    """Open the offload folder and check that it takes an unnamed file: (folder fd, O_TMPFILE used).

    Runs in a helper thread (see :func:`in_thread`), so no interrupt can leave a probe file behind.
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DiskOffloadError(exc.errno, f"save_on_disk: expected an existing folder, got {directory!r}: "
                                          f"{exc.strerror or exc}") from None
    try:
        fd, tmpfile = open_unnamed(dir_fd)
        try:
            pwrite_all(fd, memoryview(bytes(ALIGN)), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        os.close(dir_fd)
        raise DiskOffloadError(exc.errno, f"save_on_disk: expected a folder that can hold an unnamed file, got "
                                          f"{directory!r}: creating and writing one failed: "
                                          f"{exc.strerror or exc}") from None
    return dir_fd, tmpfile


def in_thread(name: str, fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` in a new thread and return its result (or raise its exception)."""
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


def close_all(fds: list[int] | tuple[int, ...]) -> None:
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
