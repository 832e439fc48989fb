"""The forward's side of a disk offload engine: pack, which decides what each saved tensor becomes
(kept in memory, a handle to a record written before in the same step, or a new record), and the
spill, which hands the oldest records kept in memory to the writer: all of them, or under a budget
those that do not fit, waiting while too much is being written (backpressure)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_gradhooks.offload._memory import Streams, fix_mmap_threshold, to_pinned
from lightning_gradhooks.offload.gate import Gate
from lightning_gradhooks.offload.ledger import Ledger
from lightning_gradhooks.offload.records import Handle, Record, State
from lightning_gradhooks.offload.writer import Writer

__all__ = ["Spill"]

_Region = tuple[torch.UntypedStorage, int, int, int, int]
_set_versions = torch._C._autograd._unsafe_set_version_counter


def _storages(modules: Any) -> set[int]:
    """The storages (addresses) of the parameters and buffers of ``modules`` (a DTensor, of FSDP2 or
    tensor parallelism: its shard)."""
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
            for m in modules for t in itertools.chain(m.parameters(), m.buffers())}


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


class Spill:
    """Pack (the forward) and the hand-over to the writer. ``threshold``: the bytes from which a saved
    tensor is offloaded; ``max_in_flight``: the bytes being written before the forward waits;
    ``budget``: the bytes of offloadable tensors held at once (None: write all); ``on_death``: what
    receives a dying handle's weak reference (a C ``put`` to the reader thread)."""

    def __init__(self, gate: Gate, ledger: Ledger, writer: Writer, streams: Streams, on_death: Callable[[Any], None],
                 threshold: int, max_in_flight: int, budget: int | None, fix_malloc: bool) -> None:
        self.gate, self.ledger, self.writer, self.streams, self.on_death = gate, ledger, writer, streams, on_death
        self.threshold, self.max_in_flight, self.budget = threshold, max_in_flight, budget
        # Fix glibc's mmap threshold at the first CPU tensor written (never for CUDA tensors), so that
        # freed offloaded tensors leave the process: False once done or not asked for.
        self._fix_malloc = fix_malloc
        self.step = 0
        self._step_offloaded = 0  # bytes handed to the writer before this step began
        self._dedupe: dict[tuple[torch.device, int], list[Record]] = {}
        self._resident_modules: list[weakref.ref[nn.Module]] = []
        self._resident_ptrs: set[int] = set()

    # -- steps
    def begin_step(self) -> None:
        resident = _storages(module for ref in self._resident_modules if (module := ref()) is not None)
        with self.gate.lock:
            self.gate.check_usable()
            self.gate.raise_pending()
            self.step += 1  # the writer starts a new file for each step
            self._dedupe = {}
            self._step_offloaded = self.ledger.bytes_offloaded
            self._resident_ptrs = resident

    def end_step(self, raise_error: bool) -> int:
        """End the step (raising a pending error if ``raise_error``): the bytes it handed to the writer."""
        with self.gate.lock:
            self._dedupe = {}
            if raise_error:
                self.gate.raise_pending()
            step_bytes = self.ledger.bytes_offloaded - self._step_offloaded
            self._step_offloaded = self.ledger.bytes_offloaded
        return step_bytes

    def keep_in_memory(self, modules: tuple[nn.Module, ...]) -> None:
        ptrs = _storages(modules)
        refs = [weakref.ref(m) for m in modules]
        with self.gate.lock:
            self._resident_modules = self._resident_modules + refs
            self._resident_ptrs = self._resident_ptrs | ptrs

    # -- pack
    def pack(self, t: torch.Tensor) -> Any:
        """What autograd keeps instead of ``t``: ``(t.detach(), version)`` if kept in memory, else a
        :class:`~lightning_gradhooks.offload.records.Handle`."""
        gate, ledger = self.gate, self.ledger
        region = self._region(t)
        keeper = None if region is None else _version_keeper(t)
        if keeper is None:
            with gate.lock:
                gate.check_usable()
                gate.raise_pending()
                ledger.kept += 1
            return t.detach(), t._version  # kept in memory; its version is checked at unpack
        storage, start, nbytes, region_start, region_bytes = region
        with gate.lock:
            gate.check_usable()
            gate.raise_pending()
            rec = self._find_duplicate(t, storage, start, nbytes)
            if rec is not None:
                ledger.deduplicated += 1
                return Handle.of(rec, t, keeper, self.on_death)
        # An interrupt before the record is parked leaves a record that nobody knows; after, its
        # handle dies with the interrupted pack, and the reader thread unparks it.
        if self._fix_malloc and t.device.type == "cpu":
            self._fix_malloc = False
            fix_mmap_threshold(self.threshold)
        rec = Record(t, storage, region_start, region_bytes)
        handle = Handle.of(rec, t, keeper, self.on_death)
        with gate.lock:
            gate.check_usable()
            ledger.park(rec, self.step)
            self._dedupe.setdefault((t.device, storage.data_ptr()), []).append(rec)
        self._spill(region_bytes)
        return handle

    def _region(self, t: torch.Tensor) -> _Region | None:
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

    def _find_duplicate(self, t: torch.Tensor, storage: torch.UntypedStorage, start: int,
                        nbytes: int) -> Record | None:
        elsize = t.element_size()
        for rec in self._dedupe.get((t.device, storage.data_ptr()), ()):
            if (rec.state is not State.DEAD and rec.state is not State.FAILED and rec.step == self.step
                    and rec.version == t._version and rec.storage_ref() is not None and rec.byte_start <= start
                    and start + nbytes <= rec.byte_start + rec.nbytes and rec.byte_start % elsize == 0
                    and rec.alive()):
                return rec
        return None

    # -- the hand-over
    def _spill(self, newest: int) -> None:
        """Hand the oldest kept records to the writer: all of them without a budget, else until what the
        engine holds, once written, leaves room in it for one more tensor (``newest`` bytes). Wait
        (backpressure) while more than ``max_in_flight`` bytes are being written, or, under a budget,
        while what is held exceeds it: the next save then finds at most the budget held."""
        gate, ledger, budget = self.gate, self.ledger, self.budget
        while True:
            with gate.lock:
                gate.check_usable()
                gate.raise_pending()
                # Spill until what stays once the writes are done leaves room for one more tensor, which
                # can then be written while the forward goes on. Without a budget every parked record is
                # written; under one, those it counts (not the inputs the caller holds), oldest first.
                keep = None if budget is None else budget - newest
                copy, blocked = self._hand_over(keep)
                if copy is None:
                    if not (blocked or (budget is not None and ledger.in_flight and ledger.held() > budget)):
                        return
                    waiter = gate.waiter()
            if copy is not None:
                rec, src = copy
                if src is not None:
                    self._copy_to_host(rec, src.untyped_storage())
                continue
            gate.wait(waiter)

    def _hand_over(self, keep: int | None) -> tuple[tuple[Record, torch.Tensor | None] | None, bool]:
        """Queue parked records, oldest first, until ``keep`` bytes (None: none) stay held (with the lock
        held): (a CUDA record whose copy to the host must start first, or None; whether records that
        should go must wait)."""
        ledger = self.ledger
        candidates = list(ledger.parked) if keep is None else ledger.own()
        own = 0 if keep is None else sum(r.nbytes for r in candidates)
        left = len(candidates)
        for rec in candidates:
            if keep is not None and own + ledger.prefetched <= keep:
                break
            if rec.src is None:  # failed or dead meanwhile: nothing to write
                ledger.unpark(rec)
                left -= 1
                continue
            if ledger.in_flight and ledger.in_flight + rec.nbytes > self.max_in_flight:
                break
            if rec.device.type == "cuda" and rec.pinned is None:
                return (rec, rec.src), False  # the device-to-host copy runs outside the lock
            self.writer.hand_over(rec)
            own -= rec.nbytes
            left -= 1
        return None, left > 0 and (keep is None or own + ledger.prefetched > keep)

    def _copy_to_host(self, rec: Record, storage: torch.UntypedStorage) -> None:
        """CUDA: start copying the record's bytes to a pinned host buffer, which the writer writes."""
        src = torch.empty(0, dtype=torch.uint8, device=rec.device).set_(storage, rec.byte_start, (rec.nbytes,), (1,))
        rec.pinned, rec.event = to_pinned(src, self.streams.of(rec.device))
