"""The bytes a disk offload engine holds, state by state, and the transitions of its records that
change them: every move of a :class:`~lightning_gradhooks.offload.records.Record` from one
:class:`~lightning_gradhooks.offload.records.State` to another is made here, with its bytes, under
the engine's lock.

A record's life: PARKED at pack (kept in memory), QUEUED when handed to the writer, WRITTEN once on
disk, LOADING and LOADED while read back (WRITTEN again once every handle was served), FAILED when
its step's write failed, DEAD when no handle needs it. What each state holds is counted once:
``parked_bytes``, ``in_flight``, ``prefetched``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_gradhooks.offload._common import Failure
from lightning_gradhooks.offload.records import Record, State

__all__ = ["Ledger"]


def _held_elsewhere(src: torch.Tensor) -> bool:
    """Whether a tensor other than the engine's own alias ``src`` uses its storage (the batch, a tensor
    the caller keeps, a view): writing it would free nothing."""
    try:  # src, and the storage object made for the call
        return torch._C._storage_Use_Count(src.untyped_storage()._cdata) > 2
    except (AttributeError, RuntimeError):
        return False


class Ledger:
    """The records' lifecycle with the bytes each state holds, and the engine's traffic counters."""

    def __init__(self) -> None:
        # Offloadable tensors kept in memory, oldest first (an insertion-ordered set): under a budget
        # the newest stay, and the oldest are handed to the writer when the total would exceed it.
        self.parked: dict[Record, None] = {}
        self.queued: dict[Record, None] = {}  # handed to the writer and counted in in_flight
        self.parked_bytes = self.in_flight = self.prefetched = self.held_peak = 0
        self.bytes_offloaded = self.bytes_written = self.bytes_read = 0
        self.offloaded = self.deduplicated = self.kept = 0

    # -- what is held
    def own(self) -> list[Record]:
        """The parked records that the budget counts, oldest first: all but the inputs that the caller
        still holds (a tensor not computed by the graph, such as the batch, that a tensor other than
        the engine's uses), which cost their memory whether written or not: writing them frees nothing."""
        return [r for r in self.parked if r.src is not None and not (r.input and _held_elsewhere(r.src))]

    def held(self) -> int:
        """Bytes of offloadable tensors the engine alone keeps in memory: kept under the budget, being
        written, read back."""
        return sum(r.nbytes for r in self.own()) + self.in_flight + self.prefetched

    def note_held(self) -> None:
        held = self.held()
        if held > self.held_peak:
            self.held_peak = held

    # -- the forward
    def park(self, rec: Record, step: int) -> None:
        """A new record of ``step`` is PARKED: kept in memory until handed to the writer."""
        rec.step = step
        self.parked[rec] = None
        self.parked_bytes += rec.nbytes
        self.note_held()

    def unpark(self, rec: Record) -> None:
        del self.parked[rec]
        self.parked_bytes -= rec.nbytes

    def handed_over(self, rec: Record) -> None:
        """PARKED -> QUEUED, right after the writer's queue took ``rec``. What follows the transition
        makes no call: an interrupt at it leaves the record PARKED, in ``parked`` and not counted."""
        rec.to(State.QUEUED)
        self.queued[rec] = None
        del self.parked[rec]
        self.parked_bytes -= rec.nbytes
        self.in_flight += rec.nbytes
        self.bytes_offloaded += rec.nbytes
        self.offloaded += 1
        if rec.device.type == "cuda":
            rec.src = None  # its pinned host copy is written; the device memory goes back

    def drop_parked(self) -> None:
        """The engine closes: what is kept in memory is DEAD."""
        for rec in self.parked:
            rec.to(State.DEAD)
            rec.src = None
        self.parked.clear()
        self.parked_bytes = 0

    # -- the writer
    def to_write(self, rec: Record, step_failure: Failure | None, closed: bool) -> bool:
        """Whether the writer writes ``rec`` now; else it is DEAD or FAILED (``step_failure``: its step's
        write failed), or was already handled (handed over twice)."""
        if rec in self.parked:  # its hand-over was interrupted right after the put
            self.unpark(rec)
        if rec.state is not State.PARKED and rec.state is not State.QUEUED:
            return False  # dead, failed, or handed over twice: nothing to write
        if not rec.alive():
            rec.to(State.DEAD)
        elif step_failure is not None:
            rec.to(State.FAILED)
            rec.failure = step_failure
        elif closed:
            rec.to(State.DEAD)
        else:
            return True
        return False

    def write_done(self, rec: Record, pinned: torch.Tensor | None, written: bool) -> None:
        """The writer is done with ``rec``: it holds no source any more; WRITTEN if ``written`` (and not
        dead or failed meanwhile)."""
        rec.src = None
        if pinned is not None:  # torch's host allocator keeps it until a skipped write's copy is done
            rec.pinned = rec.event = None
        if rec in self.queued:
            del self.queued[rec]
            self.in_flight -= rec.nbytes
        if written:
            if rec.state is State.PARKED or rec.state is State.QUEUED:  # not dead or failed meanwhile
                rec.to(State.WRITTEN)
            self.bytes_written += rec.nbytes

    def fail(self, rec: Record, failure: Failure) -> None:
        """``rec`` can no longer come back: FAILED, holding nothing (a dead record stays dead)."""
        if rec.state is State.DEAD:
            return
        if rec.state is not State.FAILED:
            rec.to(State.FAILED)
        rec.failure, rec.src = failure, None
        self._drop_loaded(rec)

    # -- the reader
    def die(self, rec: Record) -> bool:
        """Every handle of ``rec`` died: DEAD, holding nothing. False if it was dead already or lives."""
        if rec.state is State.DEAD or rec.alive():
            return False
        rec.to(State.DEAD)
        rec.src = None  # a running write keeps its own reference until done
        if rec in self.parked:
            self.unpark(rec)
        self._drop_loaded(rec)
        return True

    def start_load(self, rec: Record) -> None:
        """WRITTEN -> LOADING: the reader reads it back, and its bytes count as prefetched."""
        rec.to(State.LOADING)
        self.prefetched += rec.nbytes
        self.note_held()

    def load_done(self, rec: Record, buf: torch.Tensor | None, event: Any, failure: Failure | None) -> None:
        """A read of ``rec`` ended: LOADED, or WRITTEN again with ``read_error`` (a later unpack asks again);
        if it died or failed meanwhile, the bytes are not needed."""
        if failure is None:
            self.bytes_read += rec.nbytes
        if rec.state is not State.LOADING:
            self.prefetched -= rec.nbytes
        elif failure is None:
            rec.to(State.LOADED)
            rec.loaded, rec.load_event = buf, event
        else:
            rec.to(State.WRITTEN)
            self.prefetched -= rec.nbytes
            rec.read_error = failure

    def serve_loaded(self, rec: Record, uses: int) -> tuple[torch.Tensor, Any]:
        """Serve a handle's ``uses``-th unpack from ``rec``'s bytes read back: WRITTEN again once every
        live handle was served as often."""
        buf, event = rec.loaded, rec.load_event
        if all(other.uses >= uses for other in rec.handles()):  # every live handle served
            rec.to(State.WRITTEN)  # first: what follows makes no call (the training thread runs this)
            rec.loaded = rec.load_event = None
            self.prefetched -= rec.nbytes
        rec.asked = False
        return buf, event

    def _drop_loaded(self, rec: Record) -> None:
        if rec.loaded is not None:
            rec.loaded = rec.load_event = None
            self.prefetched -= rec.nbytes
