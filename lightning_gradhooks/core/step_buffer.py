"""The armed step's buffer: every tensor the hooks reduce goes into the :class:`Reducer` of its
device, with its kind and label, until :meth:`StepBuffer.finish` brings the rows of every device
to the host in one transfer each and pools the rows of each name into one entry."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.core.stats import Reducer, Scratch
from lightning_gradhooks.summary.records import GradientRecord, Kind, pool_entries, single_entry
from lightning_gradhooks.summary.statistics import StatsRow
from lightning_gradhooks.summary.text import listed

__all__ = ["StepBuffer"]

#: The forward check's entry of a module whose outputs hold NaN/Inf (:func:`_born`): the row of
#: a one-element sum that is not finite, as the check's own sum gives it.
_NONFINITE_SUM = StatsRow(norm=0.0, mean=0.0, std=0.0, absmax=0.0, nonfinite=1.0, zero_fraction=0.0, count=0.0,
                          low=0.0, high=0.0)


def _born(pending: list, results: list, checked: Sequence[tuple[str, int, int]]) -> tuple[list, list]:
    """``pending`` and ``results`` with a ``"forward"`` entry before the ``"output"`` rows of each
    checked forward (``(module, start, end)`` slices of them) that hold NaN/Inf, where the
    forward check would have summed those outputs; unchanged when every output is finite."""
    bad = [(module, start) for module, start, end in checked
           if any(r is not None and r[0].nonfinite > 0 for r in results[start:end])]
    if not bad:
        return pending, results
    pending, results = list(pending), list(results)
    for module, start in reversed(bad):  # from the end: the earlier positions stay
        pending.insert(start, (Kind.FORWARD, module, pending[start][2]))
        results.insert(start, (_NONFINITE_SUM, None))
    return pending, results


class StepBuffer:
    """What the hooks of one armed step (or one parameter read) reduced, per device, in order.

    Args:
        bins: histogram bins.
        scratch: CPU buffers reused from one logged step to the next (the monitor's).
        compiled: reduce with the compiled kernels (:class:`Reducer`).
    """

    def __init__(self, bins: int, scratch: Scratch, compiled: bool) -> None:
        self.bins, self.scratch, self.compiled = bins, scratch, compiled
        # Per tensor reduced: (kind, label, device); the reductions, per device.
        self.pending: list[tuple[str, str, torch.device]] = []
        self._reducers: dict[torch.device, Reducer] = {}
        #: This step's checked forwards whose outputs are read from their rows: (module, slice of pending).
        self.checked: list[tuple[str, int, int]] = []
        #: Modules whose outputs were seen changed in place (read from a copy from then on).
        self.copied: set[str] = set()

    def clear(self) -> None:
        """Drop what was reduced and not finished."""
        self.pending.clear()
        self.checked.clear()
        self._reducers.clear()

    def reduce(self, kind: Kind, name: str, grad: Tensor | None, histogram: bool, watch: bool = False) -> None:
        """Reduce ``grad`` into the step's rows; ``watch``: see :meth:`Reducer.add`."""
        if grad is None or not grad.is_floating_point():
            return
        if type(grad) is not Tensor and _shards.is_dtensor(grad):  # tensor parallel: this rank's piece
            grad = _shards.local_piece(grad)[0]
            if grad is None or grad.numel() == 0:
                return
        device = grad.device
        self._reducer(device).add(grad, histogram, watch)
        self.pending.append((kind, name, device))

    def extend(self, kind: Kind, names: list[str], grads: list[Tensor], histograms: bool) -> None:
        """Reduce many tensors of one device at once (the parameter gradients)."""
        self._reducer(grads[0].device).extend(grads, histograms)
        self.pending.extend([(kind, name, grads[0].device) for name in names])

    def _reducer(self, device: torch.device) -> Reducer:
        reducer = self._reducers.get(device)
        if reducer is None:
            reducer = self._reducers[device] = Reducer(self.bins, self.scratch, self.compiled)
        return reducer

    def finish(self) -> GradientRecord:
        """The record of everything reduced, in order (one transfer per device; the rows of each
        name pooled: :attr:`GradientEntry.calls`); the buffer is empty after."""
        pending, reducers, checked = self.pending, self._reducers, self.checked
        self.pending, self._reducers, self.checked = [], {}, []
        if len(reducers) == 1:
            results = reducers.popitem()[1].finish()
        else:
            by_device = {device: iter(reducer.finish()) for device, reducer in reducers.items()}
            results = [next(by_device[device]) for _, _, device in pending]
        if checked:
            pending, results = _born(pending, results, checked)
        if None in results:  # outputs changed in place before their batch ran (Reducer.add's watch)
            kept = [(p, r) for p, r in zip(pending, results) if r is not None]
            self._changed([label for (_, label, _), r in zip(pending, results) if r is None])
            pending, results = [p for p, _ in kept], [r for _, r in kept]
        keys = [(kind, label) for kind, label, _ in pending]
        if len(set(keys)) == len(keys):  # no module called twice: nothing to pool
            return GradientRecord([single_entry(kind, label, *result) for (kind, label), result in zip(keys, results)])
        groups: dict[tuple[str, str], list[tuple[StatsRow, list[float] | None]]] = {}
        for key, result in zip(keys, results):
            groups.setdefault(key, []).append(result)
        return GradientRecord([pool_entries(kind, label, parts, self.bins) for (kind, label), parts in groups.items()])

    def _changed(self, labels: list[str]) -> None:
        """Outputs that an in-place op changed before their batch read them (a module that did
        not show it in the probe's step) give no row this step, said once, and their module's
        outputs are batched as copies from now on."""
        modules = sorted({label.split("/")[0] for label in labels} - self.copied)
        self.copied.update(modules)
        if modules:
            warnings.warn(
                "an in-place operation changed the outputs of these modules before their statistics were "
                f"read: no output statistics for them on this logged step, read from a copy from the next "
                f"one: {listed(modules)}",
                stacklevel=3,
            )
