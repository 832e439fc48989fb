"""What the monitor hands back: :class:`GradientRecord`, :class:`GradientEntry`, :class:`Histogram`.

Also where rows of statistics become entries: several gradients of one name (a module called
several times, accumulated micro-batches, the ranks of a data-parallel job) are pooled into
one entry, as if they were one concatenated tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lightning_gradhooks.stats import _COUNT, STATISTICS, merge_histograms, pool_stats

if TYPE_CHECKING:
    from lightning_gradhooks.noise import NoiseSample

#: Kinds of the monitor's forward checks (not gradients): a module's output, its inputs, and
#: the weights when the step began; only their ``nonfinite`` count means something.
FORWARD_KINDS = ("forward", "forward_input", "weights")

#: Statistics that do not change when a gradient is multiplied by a loss scale.
_SCALE_FREE = ("nonfinite", "zero_fraction")


# Entries are plain dataclasses, not frozen ones: a frozen dataclass takes four times as long
# to make (0.6 us against 0.14), and a logged step of a big model makes thousands.
@dataclass
class Histogram:
    """A histogram of the finite elements of one gradient tensor."""

    low: float
    high: float
    counts: list[float]


@dataclass
class GradientEntry:
    """The statistics of one gradient tensor at one step.

    Attributes:
        kind: ``"grad_output"``, ``"grad_input"`` or ``"param_grad"``.
        name: the module's qualified name, or the parameter's. A module with several output
            (or input) tensors gives one entry per tensor, named by its position or key in the
            structure: ``"lstm/0"``, ``"lstm/1/0"``, ``"gpt/logits"``.
        stats: statistic name to value, for every name in :data:`STATISTICS`.
        histogram: present for ``grad_output`` and ``param_grad`` when histograms are on.
        count: the number of finite elements the statistics were computed over.
        calls: how many gradients were pooled into this entry. A module called several times
            in one step (weight sharing, a cell in a loop), or in each micro-batch of an
            accumulated step, gives one entry whose statistics and histogram are those of
            all its gradients taken together, as if concatenated into one tensor.
    """

    kind: str
    name: str
    stats: dict[str, float]
    histogram: Histogram | None = None
    calls: int = 1
    count: int = 0

    def row(self) -> list[float]:
        """The statistics as a row: :data:`~lightning_gradhooks.stats.STATISTICS`, count, low, high."""
        low, high = (self.histogram.low, self.histogram.high) if self.histogram else (0.0, 0.0)
        return [*(self.stats[s] for s in STATISTICS), float(self.count), low, high]


@dataclass
class GradientRecord:
    """Everything the monitor collected for one step, in backward order, parameters last.

    Beside the entries it carries what the monitor knows and a
    :class:`~lightning_gradhooks.log.GradientLog` needs, so that data flows one way, from the
    monitor through the record to the log.

    Attributes:
        entries: the statistics, one entry per gradient tensor.
        parameters: the monitor's chosen parameters, by name (for update ratios).
        sharded: names of parameters whose gradient each rank holds a piece of (pooled over
            the ranks in a distributed job).
        skipped: chosen parameters that gave no entry, with the reason.
        bins: the monitor's histogram bin count.
        noise: what the step's gradient noise scale is estimated from
            (:class:`~lightning_gradhooks.noise.NoiseSample`); None when not measured.
    """

    entries: list[GradientEntry] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    sharded: tuple[str, ...] = field(default=(), repr=False, compare=False)
    skipped: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    bins: int = field(default=0, repr=False, compare=False)
    noise: NoiseSample | None = field(default=None, repr=False, compare=False)

    def with_entries(self, entries: list[GradientEntry]) -> GradientRecord:
        """A copy holding ``entries`` instead, with the same monitor facts."""
        return replace(self, entries=entries)

    def unscaled(self, scale: float, parameters: bool = False) -> GradientRecord:
        """A copy with the gradients the hooks saw (``grad_output``, ``grad_input`` and the noise
        sample's small-batch gradient) divided by a mixed-precision loss scale.

        Args:
            scale: the scaler's scale at the step's backward (``scaler.get_scale()``).
            parameters: the parameter gradients are still scaled too: no
                ``scaler.unscale_(optimizer)`` ran before :meth:`GradientMonitor.collect`, as
                with an optimizer that unscales inside its own ``step()`` (fused Adam, AdamW).

        ``norm``, ``mean``, ``std``, ``absmax`` and the histogram range scale with the
        gradient; ``nonfinite``, ``zero_fraction`` and the bin counts do not.
        """
        kinds = ("grad_output", "grad_input", "param_grad") if parameters else ("grad_output", "grad_input")
        entries = []
        for e in self.entries:
            if e.kind in kinds:
                stats = {k: v if k in _SCALE_FREE else v / scale for k, v in e.stats.items()}
                hist = e.histogram and Histogram(e.histogram.low / scale, e.histogram.high / scale, e.histogram.counts)
                e = replace(e, stats=stats, histogram=hist)
            entries.append(e)
        record = self.with_entries(entries)
        if record.noise is not None:  # its small-batch gradient is seen by hooks, scaled
            record.noise = record.noise.unscaled(scale, parameters)
        return record

    def prefixed(self, prefix: str) -> GradientRecord:
        """A copy with every name prefixed, as ``f"{prefix}/{name}"``."""
        return self.with_entries([replace(e, name=f"{prefix}/{e.name}") for e in self.entries])

    @property
    def first_nonfinite(self) -> GradientEntry | None:
        """The first entry, in backward order, whose gradient holds NaN or Inf values."""
        return next((e for e in self.entries if e.stats["nonfinite"] > 0), None)


def pool_entries(
    kind: str,
    name: str,
    parts: Sequence[tuple[list[float], list[float] | None]],
    bins: int,
    calls: int | None = None,
) -> GradientEntry:
    """One entry from statistics rows (with their histogram counts, or None), pooled as if the
    gradients were one tensor; ``calls`` defaults to the number of parts."""
    if len(parts) == 1:  # most entries: nothing to pool
        return single_entry(kind, name, *parts[0], calls=calls or 1)
    row = pool_stats([r for r, _ in parts])
    histogram = None
    if all(h is not None for _, h in parts):
        histogram = Histogram(*merge_histograms([(r[-2], r[-1], h) for r, h in parts], bins))
    return GradientEntry(
        kind, name, dict(zip(STATISTICS, row)), histogram, calls=calls or len(parts), count=int(row[_COUNT])
    )


def single_entry(kind: str, name: str, row: list[float], hist: list[float] | None, calls: int = 1) -> GradientEntry:
    """The entry of one statistics row (and its histogram counts, or None)."""
    histogram = None if hist is None else Histogram(row[-2], row[-1], hist)
    return GradientEntry(kind, name, dict(zip(STATISTICS, row)), histogram, calls, int(row[_COUNT]))
