"""Pooling gradient statistics across the ranks of a data-parallel job, in plain PyTorch.

Each rank's hooks see the gradients of its own shard of the batch. :class:`RankReducer` pools
them into the statistics of the whole global batch, with the same rule that pools the calls of
a module (:attr:`~lightning_gradhooks.records.GradientEntry.calls`): as if the gradients of all
ranks were one concatenated tensor. It costs one ``all_gather`` per logged step, of one flat
tensor holding every entry, called after backward and never from inside a hook.

The ranks agree once on the list of names (the layout of the flat tensor); a rank whose record
holds a name outside the layout (say, an expert that got no tokens until now) flags it in the
same gather, and all ranks then agree on a new layout and gather again, so nothing is lost.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_gradhooks.records import GradientRecord, pool_entries
from lightning_gradhooks.stats import STATS_WIDTH

# One row per name: calls (0: this rank has no such entry), has-histogram flag, the stats row,
# then the histogram counts.
_HEAD = 2


class RankReducer:
    """Pools the ``grad_output``/``grad_input`` entries of every rank's record into rank 0's view.

    Parameter gradients are taken from the local record: data-parallel strategies have already
    averaged them across ranks by the time they are read.

    Args:
        bins: the monitor's histogram bin count.
        device: where the flat tensor is gathered (``cuda`` for NCCL, ``cpu`` for gloo).
        group: the process group; default: the world.

    Every rank must call :meth:`reduce` at the same steps.
    """

    def __init__(self, bins: int, device: torch.device | str = "cpu", group: Any = None) -> None:
        self.bins = bins
        self.device = torch.device(device)
        self.group = group
        self.layout: list[tuple[str, str]] | None = None
        self._width = _HEAD + STATS_WIDTH + bins  # values per name in the flat tensor
        #: How many gathers :meth:`reduce` made in total (for tests and the curious).
        self.collectives = 0

    def reduce(self, record: GradientRecord) -> GradientRecord:
        """The record with its hook entries pooled over all ranks (the same on every rank)."""
        local = {(e.kind, e.name): e for e in record.entries if e.kind != "param_grad"}
        params = [e for e in record.entries if e.kind == "param_grad"]
        if self.layout is None:
            self.layout = self._agree_on_layout(list(local))
        gathered = self._gather(local)
        if gathered[:, 0].any():  # some rank had a name outside the layout: agree again
            self.layout = self._agree_on_layout(list(local))
            gathered = self._gather(local)
        return GradientRecord(self._unpack(gathered) + params)

    def _agree_on_layout(self, keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
        everyone: list[list[tuple[str, str]] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, keys, group=self.group)
        self.collectives += 1
        layout: dict[tuple[str, str], None] = {}
        for rank_keys in everyone:
            layout.update(dict.fromkeys(map(tuple, rank_keys)))
        return list(layout)

    def _gather(self, local: dict[tuple[str, str], Any]) -> torch.Tensor:
        flat = torch.zeros(1 + len(self.layout) * self._width, dtype=torch.float64)
        flat[0] = len(set(local) - set(self.layout))
        rows = flat[1:].view(len(self.layout), self._width)
        for i, key in enumerate(self.layout):
            entry = local.get(key)
            if entry is None:
                continue
            hist = entry.histogram
            rows[i, 0] = entry.calls
            rows[i, _HEAD : _HEAD + STATS_WIDTH] = torch.tensor(entry.row(), dtype=torch.float64)
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
        ranks = gathered[:, 1:].view(gathered.shape[0], len(self.layout), self._width).tolist()
        entries = []
        for i, (kind, name) in enumerate(self.layout):
            present = [rows[i] for rows in ranks if rows[i][0] > 0]
            if not present:
                continue
            parts = [
                (row[_HEAD : _HEAD + STATS_WIDTH], row[_HEAD + STATS_WIDTH :] if row[1] else None) for row in present
            ]
            calls = int(sum(row[0] for row in present))
            entries.append(pool_entries(kind, name, parts, self.bins, calls=calls))
        return entries
