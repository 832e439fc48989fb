"""File bookkeeping of the disk offload engine: the private folder, the segments (one file
receiving a step's tensors) and the records (storage regions written to them), whole-buffer
``pwrite``/``pread`` helpers, and the cleanup that deletes everything."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_gradhooks.offload._common import _ALIGN, DiskOffloadError


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def _pread_all(fd: int, data: memoryview, offset: int, needed: int | None = None) -> None:
    done, needed = 0, len(data) if needed is None else needed
    while done < needed:
        n = os.preadv(fd, [data[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "unexpected end of file")
        done += n


def _make_private_folder(directory: str | os.PathLike[str] | None) -> str:
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
    prefix = f"save_on_disk-{'' if rank is None else f'rank{rank}-'}pid{os.getpid()}-"
    folder = None
    try:
        if directory is None:
            folder = tempfile.mkdtemp(prefix=prefix)  # mode 0700
        else:
            os.makedirs(directory, exist_ok=True)
            folder = tempfile.mkdtemp(prefix=prefix, dir=directory)
        os.chmod(folder, 0o700)
        probe = os.path.join(folder, "probe")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if os.write(fd, bytes(_ALIGN)) != _ALIGN:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        where = "a private temporary folder" if directory is None else repr(os.fspath(directory))
        raise DiskOffloadError(
            exc.errno, f"save_on_disk: expected a writable folder, got {where}: {exc.strerror or exc}"
        ) from exc
    return folder


class _Segment:
    """One file receiving a step's tensors, appended sequentially."""

    def __init__(self, index: int, path: str, fd: int) -> None:
        self.index, self.path, self.fd = index, path, fd
        self.direct_fd = -1  # O_DIRECT, with drop_page_cache where the filesystem allows
        self.size = 0  # next free offset
        self.records: list[_Record] = []  # in order of saving, for prefetch
        self.live = 0  # records with a live handle
        self.io = 0  # reads and writes queued or running on fd
        self.sealed = False  # no more appends; unlinked once live == 0, closed once io == 0 too
        self.failed: BaseException | None = None
        self.linked = True
        self.cursor = -1  # next record to consider for prefetch
        self.last_unpacked = -1
        self.previous: _Segment | None = None  # the same step's earlier file, for prefetch

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


class _Record:
    """One storage region written to a segment, shared by the handles of its views."""

    __slots__ = ("segment", "index", "offset", "nbytes", "byte_start", "device", "storage_ref", "version", "direct",
                 "src", "pinned", "event", "write_future", "written", "error", "handles",
                 "loaded", "load_event", "loading", "read_error", "served")

    def __init__(self, segment: _Segment, offset: int, nbytes: int, byte_start: int, t: torch.Tensor,
                 storage: torch.UntypedStorage) -> None:
        self.segment, self.index, self.offset = segment, len(segment.records), offset
        self.nbytes, self.byte_start, self.device = nbytes, byte_start, t.device
        self.storage_ref, self.version = StorageWeakRef(storage), t._version
        self.src: torch.Tensor | None = t.detach() if t.device.type == "cpu" else None  # until written
        self.pinned: torch.Tensor | None = None  # CUDA: host copy until written
        self.event: Any = None  # CUDA: device-to-host copy done
        self.write_future: cf.Future[None] | None = None
        self.written = False
        self.direct = False  # written and read with O_DIRECT (but for a head and a tail)
        self.error: BaseException | None = None  # modified in place before being written
        self.handles = 0
        self.loaded: torch.Tensor | None = None  # bytes read back, held until served
        self.load_event: Any = None  # CUDA: host-to-device copy done
        self.loading: cf.Future[Any] | None = None
        self.read_error: BaseException | None = None
        self.served = 0  # unpacks served from ``loaded``


def _cleanup(folder: str, segments: dict[int, _Segment], executors: tuple[cf.Executor, ...], pid: int) -> None:
    for executor in executors:
        executor.shutdown(wait=False, cancel_futures=True)
    if os.getpid() != pid:  # a forked child must not delete its parent's files
        return
    for segment in list(segments.values()):
        segment.close()
    segments.clear()
    shutil.rmtree(folder, ignore_errors=True)
