"""Pooling gradient statistics across the ranks of a data-parallel job, in plain PyTorch.

Each rank's hooks see the gradients of its own shard of the batch. :class:`RankReducer` pools
them into the statistics of the whole global batch, with the same rule that pools the calls of
a module (:attr:`~lightning_gradhooks.summary.records.GradientEntry.calls`): as if the gradients of all
ranks were one concatenated tensor. It costs one ``all_gather`` per logged step, of one flat
tensor holding every entry, called after backward and never from inside a hook.

Sharded parameters (``DTensor`` parameters of FSDP2 and tensor parallelism, FSDP1
``use_orig_params`` views) are pooled in the same gather: each rank reduced its own piece of the
gradient (one rank per group of replicas, see :mod:`lightning_gradhooks.core._shards`), and the
pieces partition the whole, so the pooled entry is that of the full logical gradient.

The ranks agree on the list of names (the layout of the flat tensor) at the first step with
``all_gather_object``. With sharded parameters only (no hook entries), that list is the
names of the sharded parameters, the same on every rank of an SPMD program, so no agreement
is needed: a checksum of the layout travels in the gather. A rank whose record holds a name
outside the layout (say, an expert that got no tokens until now) flags it; when a rank flags
a name or the checksums differ, all ranks agree on a new layout and gather again, so nothing
is lost.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_gradhooks.summary.records import GradientRecord, Kind, pool_entries
from lightning_gradhooks.summary.statistics import STATS_WIDTH, StatsRow

# The flat tensor starts with how many names this rank has outside the layout and the layout's
# checksum. Then one row per name: calls (0: this rank has no such entry), has-histogram flag,
# the stats row, then the histogram counts.
_HEAD = 2


class RankReducer:
    """Pools the entries of every rank's record into the statistics of the whole, on every rank.

    The ``grad_output``/``grad_input`` entries (with ``hooks=True``) are pooled over the ranks
    as if concatenated: the global batch of a data-parallel job. The parameters named in
    ``sharded`` are pooled from their pieces: the full logical gradient. Other parameter
    gradients are taken from the local record: data-parallel strategies have already averaged
    them across ranks by the time they are read.

    Args:
        bins: the monitor's histogram bin count.
        device: where the flat tensor is gathered (``cuda`` for NCCL, ``cpu`` for gloo).
        group: the process group; default: the world. Sharded parameters need every rank that
            holds a piece of them in it.
        hooks: pool the hook entries; False: keep this rank's own (only sharded parameters
            are gathered).

    Every rank must call :meth:`reduce` at the same steps.
    """

    def __init__(self, bins: int, device: torch.device | str = "cpu", group: Any = None, hooks: bool = True) -> None:
        self.bins = bins
        self.hooks = hooks
        self.device = torch.device(device)
        self.group = group
        self.layout: list[tuple[str, str]] | None = None
        self._width = _HEAD + STATS_WIDTH + bins  # values per name in the flat tensor
        #: How many collectives :meth:`reduce` made in total (for tests and the curious).
        self.collectives = 0

    def reduce(self, record: GradientRecord, sharded: Sequence[str] = ()) -> GradientRecord:
        """The record with its hook entries and ``sharded`` parameters pooled over all ranks.

        Args:
            record: this rank's record.
            sharded: names of the parameters whose gradient each rank holds a piece of
                (:attr:`~lightning_gradhooks.core.monitor.GradientMonitor.sharded`); the same list on
                every rank, whether or not this rank reduced a piece of them.

        Returns:
            The same record on every rank: pooled entries first, then this rank's own.
        """
        pooled = set(sharded)

        def gathered_here(e: Any) -> bool:
            return e.name in pooled if e.kind == Kind.PARAM_GRAD else self.hooks

        local = {(e.kind, e.name): e for e in record.entries if gathered_here(e)}
        kept = [e for e in record.entries if not gathered_here(e)]
        keys = list(dict.fromkeys([*((Kind.PARAM_GRAD, name) for name in sharded), *local]))
        if not keys and self.layout is None and not self.hooks:
            return record  # nothing sharded, nothing pooled: no collective
        if self.layout is None:
            # Hook names may differ between ranks (a branch one rank did not take): agree. The
            # sharded parameters are the same on every rank: the flat tensors have one size.
            self.layout = self._agree_on_layout(keys) if self.hooks else keys
        gathered = self._gather(local)
        if gathered[:, 0].any() or (gathered[:, 1] != gathered[0, 1]).any():  # the ranks differ: agree
            self.layout = self._agree_on_layout(keys)
            gathered = self._gather(local)
        return record.with_entries(self._unpack(gathered) + kept)

    def _agree_on_layout(self, keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
        everyone: list[list[tuple[str, str]] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, keys, group=self.group)
        self.collectives += 1
        layout: dict[tuple[str, str], None] = {}
        for rank_keys in everyone:
            layout.update(dict.fromkeys(map(tuple, rank_keys)))
        return list(layout)

    def _gather(self, local: dict[tuple[str, str], Any]) -> torch.Tensor:
        flat = torch.zeros(2 + len(self.layout) * self._width, dtype=torch.float64)
        flat[0] = len(set(local) - set(self.layout))
        flat[1] = zlib.crc32(repr(self.layout).encode())  # 32 bits: exact in float64
        rows = flat[2:].view(len(self.layout), self._width)
        for i, key in enumerate(self.layout):
            entry = local.get(key)
            if entry is None:
                continue
            hist = entry.histogram
            rows[i, 0] = entry.calls
            rows[i, _HEAD : _HEAD + STATS_WIDTH] = torch.tensor(entry.stats, dtype=torch.float64)
            if hist is not None and len(hist.counts) == self.bins:
                rows[i, 1] = 1
                rows[i, _HEAD + STATS_WIDTH :] = torch.tensor(hist.counts, dtype=torch.float64)
        flat = flat.to(self.device)
        world = dist.get_world_size(self.group)
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10
        gather(out, flat, group=self.group)
        self.collectives += 1
        return out.cpu().view(world, -1)

    def _unpack(self, gathered: torch.Tensor) -> list:
        ranks = gathered[:, 2:].view(gathered.shape[0], len(self.layout), self._width).tolist()
        entries = []
        for i, (kind, name) in enumerate(self.layout):
            present = [rows[i] for rows in ranks if rows[i][0] > 0]
            if not present:
                continue
            parts = [
                (StatsRow._make(row[_HEAD : _HEAD + STATS_WIDTH]), row[_HEAD + STATS_WIDTH :] if row[1] else None)
                for row in present
            ]
            # A parameter is one tensor, however many pieces it came in.
            calls = 1 if kind == Kind.PARAM_GRAD else int(sum(row[0] for row in present))
            entries.append(pool_entries(kind, name, parts, self.bins, calls=calls))
        return entries


def rank() -> int:
    """This process's rank in the default group; 0 outside a distributed job."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather_device() -> torch.device:
    """Where a collective of the default group runs: the current CUDA device under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankPooling:
    """Decides which records are pooled over the ranks of the default group, and pools them
    with one :class:`RankReducer`, made at the first record that needs it.

    A record is pooled in a job of more than one rank when a monitor collected it and either
    ``sync_dist`` (the hook statistics of the global batch) or it holds sharded parameters
    (their pieces, always). Every rank must call :meth:`pool` at the same steps.

    Args:
        sync_dist: pool the hook statistics too; False: only the pieces of sharded parameters.
    """

    def __init__(self, sync_dist: bool = False) -> None:
        self.sync_dist = bool(sync_dist)
        self._reducer: RankReducer | None = None

    @property
    def collectives(self) -> int:
        """How many collectives pooling made so far (for tests and the curious)."""
        return 0 if self._reducer is None else self._reducer.collectives

    def pool(self, record: GradientRecord) -> GradientRecord:
        """``record`` pooled over the ranks where it needs to be; else ``record`` itself."""
        if not (record.bins > 0 and (self.sync_dist or record.sharded) and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() > 1):
            return record
        if self._reducer is None:
            self._reducer = RankReducer(record.bins, _gather_device(), hooks=self.sync_dist)
        return self._reducer.reduce(record, record.sharded)
