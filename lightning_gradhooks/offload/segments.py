"""The files of a disk offload engine: the offload folder's descriptor and the segments, unnamed files
that receive a step's tensors, appended sequentially. :class:`Segments` is their one owner: it opens
the folder (at construction) and every file (for the writer thread), and takes every descriptor out
before it is closed (by the thread that took it); taking them out again finds nothing."""

from __future__ import annotations

import itertools
import os

from lightning_gradhooks.offload._common import ALIGN, Failure, round_up
from lightning_gradhooks.offload._files import close_all, free_bytes, in_thread, open_folder, open_unnamed
from lightning_gradhooks.offload.gate import Gate
from lightning_gradhooks.offload.records import Record

__all__ = ["Segment", "Segments"]


class Segment:
    """One unnamed file receiving a step's tensors, appended sequentially."""

    __slots__ = ("index", "step", "fd", "size", "records", "live", "io", "failed", "cursor",
                 "last_unpacked", "previous")

    def __init__(self, index: int, step: int, fd: int) -> None:
        self.index, self.step, self.fd = index, step, fd
        self.size = 0  # next free offset
        self.records: list[Record] = []  # in order of saving, for prefetch
        self.live = 0  # records with a live handle
        self.io = 0  # reads and writes running on fd
        self.failed: Failure | None = None
        self.cursor = -1  # next record to consider for prefetch
        self.last_unpacked = -1
        self.previous: Segment | None = None  # the same step's earlier file, for prefetch

    def take_fd(self) -> int:
        """Take the descriptor out (the caller closes it): a later take gets -1."""
        fd, self.fd = self.fd, -1
        return fd


class Segments:
    """The folder descriptor and the open segments, in the folder ``folder`` (absolute), a new file past
    ``segment_bytes`` or a new step. What the reader thread needs even after the engine itself was
    garbage collected, to close every descriptor. Methods other than construction and
    :meth:`close` run with ``gate.lock`` held."""

    def __init__(self, folder: str, gate: Gate, segment_bytes: int) -> None:
        # In a helper thread, so that no interrupt can leave a probe file behind.
        self.dir_fd, self.tmpfile = in_thread("save_on_disk-setup", open_folder, folder)
        self.gate, self.segment_bytes = gate, segment_bytes
        self.by_index: dict[int, Segment] = {}  # the open segments
        self.current: Segment | None = None  # the one the writer appends to
        self.reading: Segment | None = None  # the one read ahead from (prefetch)
        self._indices = itertools.count()

    def for_record(self, rec: Record) -> Segment:
        """The file ``rec`` goes to: the current one, or a new one per step and past segment_bytes (writer
        thread: under the lock, so a fork sees it)."""
        seg = self.current
        if (seg is not None and seg.fd >= 0 and seg.failed is None and seg.step == rec.step
                and not (seg.records and seg.size + rec.nbytes > self.segment_bytes)):
            return seg
        fd, _ = open_unnamed(self.dir_fd)
        new = Segment(next(self._indices), rec.step, fd)
        self.current = self.by_index[new.index] = new
        new.previous = seg if seg is not None and seg.step == rec.step and seg.fd >= 0 else None
        return new

    @staticmethod
    def place(rec: Record, seg: Segment) -> None:
        """Append ``rec`` to ``seg``: its write starts."""
        rec.offset = round_up(seg.size, ALIGN)
        rec.segment, rec.index = seg, len(seg.records)
        seg.records.append(rec)
        seg.size = rec.offset + rec.nbytes
        seg.live += 1
        seg.io += 1

    def newest(self, step: int) -> Segment | None:
        """The newest open segment of ``step``."""
        return max((s for s in self.by_index.values() if s.step == step and s.fd >= 0),
                   key=lambda s: s.index, default=None)

    def release(self, seg: Segment | None) -> tuple[int, ...]:
        """Take out the descriptor of a segment no handle needs and no I/O uses (threads close it)."""
        if seg is None or seg.fd < 0 or seg.io or (seg.live and seg.failed is None):
            return ()
        self.by_index.pop(seg.index, None)
        if self.current is seg:
            self.current = None
        if self.reading is seg:
            self.reading = None
        return (seg.take_fd(),)

    def fds(self) -> list[int]:
        """The descriptors of the open segments."""
        return [s.fd for s in self.by_index.values() if s.fd >= 0]

    def bytes_on_disk(self) -> int:
        return sum(os.fstat(fd).st_size for fd in self.fds())

    def room(self) -> int:
        """Bytes this engine can still put in the folder: what is free there, and what its own files use
        (given back after each backward). Raises OSError."""
        return free_bytes(self.dir_fd) + self.bytes_on_disk()

    def take_all(self) -> list[int]:
        """Take every descriptor out, drop what records hold; the caller closes the result."""
        fds = [self.dir_fd]
        self.dir_fd = -1
        for seg in self.by_index.values():
            fds.append(seg.take_fd())
            for rec in seg.records:
                rec.src = rec.loaded = rec.pinned = None
        self.by_index.clear()
        return fds

    def close(self) -> None:
        """Close the folder and every file (the reader thread, once the writer has ended). Idempotent."""
        with self.gate.lock:
            fds = self.take_all()
        close_all(fds)
