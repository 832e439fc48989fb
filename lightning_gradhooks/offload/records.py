"""What the disk offload engine keeps per saved tensor: the record (one storage region, its
lifecycle as one :class:`State` with every allowed transition in one table) and the handle that
autograd keeps instead of the tensor.

A handle has no ``__del__``: autograd dropping it fires a :class:`HandleRef`, whose callback is a
queue's C ``put`` to the reader thread, so a dying handle runs no Python code.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch

from lightning_gradhooks.offload._common import Failure

__all__ = ["TRANSITIONS", "Handle", "HandleRef", "Record", "State"]


class State(enum.Enum):
    """Where an offloaded record's bytes are: one state per record, changed only by :meth:`Record.to`."""

    PARKED = "kept in memory by the engine (under a budget, or until handed to the writer)"
    QUEUED = "handed to the writer thread, or being written: served from memory while its source is"
    WRITTEN = "on disk only"
    LOADING = "being read back by the reader thread"
    LOADED = "read back, held until every live handle was served (then WRITTEN again)"
    FAILED = "its step's write failed: the bytes are lost and unpack raises ``failure``"
    DEAD = "no handle needs it any more (every handle died, or the engine closed)"


TRANSITIONS: dict[State, frozenset[State]] = {
    # PARKED -> WRITTEN: a hand-over interrupted right after the writer's queue took the record.
    State.PARKED: frozenset({State.QUEUED, State.WRITTEN, State.FAILED, State.DEAD}),
    State.QUEUED: frozenset({State.WRITTEN, State.FAILED, State.DEAD}),
    State.WRITTEN: frozenset({State.LOADING, State.FAILED, State.DEAD}),
    # LOADING -> WRITTEN: the read failed (``read_error``); a later unpack asks again.
    State.LOADING: frozenset({State.LOADED, State.WRITTEN, State.FAILED, State.DEAD}),
    State.LOADED: frozenset({State.WRITTEN, State.FAILED, State.DEAD}),
    State.FAILED: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}


class Record:
    """One storage region written to a segment, shared by the handles of its views. Its lifecycle is
    ``state`` (see :class:`State`); the other fields are what that state holds. The transitions and
    the bytes each state holds are :class:`~lightning_gradhooks.offload.ledger.Ledger`'s."""

    __slots__ = ("segment", "index", "offset", "nbytes", "byte_start", "device", "storage_ref", "version",
                 "step", "input", "src", "pinned", "event", "refs", "state", "failure", "loaded",
                 "load_event", "read_error", "asked")

    def __init__(self, t: torch.Tensor, storage: torch.UntypedStorage, byte_start: int, nbytes: int) -> None:
        self.segment: Any = None  # its segments.Segment, assigned by the writer thread (None: not written)
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
        self.refs: list[HandleRef] = []  # weak references to the handles autograd keeps
        self.state = State.PARKED
        self.failure: Failure | None = None  # FAILED: the error unpack raises
        self.loaded: torch.Tensor | None = None  # LOADED: the bytes read back
        self.load_event: Any = None  # LOADED, CUDA: host-to-device copy done
        self.read_error: Failure | None = None  # the last read failed: the next unpack raises it once
        self.asked = False  # an unpack waits for it (a request, not a state)

    def to(self, state: State) -> None:
        """Move to ``state`` (the engine's lock held): the one place a record's lifecycle changes."""
        assert state in TRANSITIONS[self.state], f"save_on_disk: internal error: record {self.state.name} -> {state.name}"
        self.state = state

    def where(self) -> str:
        """Which record: its file (they have no name: numbered from 0 per engine), offset and step."""
        seg = self.segment
        return f"file #{seg.index}, offset {self.offset}, step {self.step}" if seg is not None else f"step {self.step}"

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


class HandleRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a handle that knows its record. Its callback is a queue's C ``put``,
    so a dying handle runs no Python code: the engine's reader thread does the rest."""

    __slots__ = ("record",)


class Handle:
    """What autograd keeps instead of an offloaded tensor: metadata, its record and what checks its
    version at unpack. No ``__del__``."""

    __slots__ = ("record", "dtype", "size", "stride", "storage_offset", "rel_offset", "keeper", "version", "uses",
                 "__weakref__")

    def __init__(self, record: Record, t: torch.Tensor, keeper: torch.Tensor, version: int) -> None:
        self.record, self.dtype = record, t.dtype
        self.size, self.stride, self.storage_offset = t.size(), t.stride(), t.storage_offset()
        self.rel_offset = (t.storage_offset() * t.element_size() - record.byte_start) // t.element_size()
        self.keeper, self.version = keeper, version
        self.uses = 0  # unpacks served to this handle

    @classmethod
    def of(cls, rec: Record, t: torch.Tensor, keeper: tuple[torch.Tensor, int], on_death: Any) -> Handle:
        """A new handle of ``rec`` for ``t``, whose death ``on_death`` (a C ``put``) receives."""
        handle = cls(rec, t, *keeper)
        ref = HandleRef(handle, on_death)
        ref.record = rec
        rec.refs.append(ref)
        return handle
