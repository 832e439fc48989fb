"""The per-tensor statistics, each declared once, and how rows of them pool. No torch.

A gradient (or an output) is reduced on its device to seven *moments* (:class:`Moments`: the
finite count, their mean, the sum of squares about the mean, the finite minimum and maximum, the
count of exact zeros, the element count). Every statistic is a function of the moments, written
once in :data:`TABLE` with the array operations that torch and numpy share (``xp.sqrt``,
``xp.where``, ``xp.maximum``, ``xp.clip``): the device finishes a whole step's moments with
``xp=torch`` (:func:`lightning_gradhooks.core.stats.finish_rows`), and pooling on the host turns
rows back into moments, combines them exactly (Chan's formula for the spread) and finishes them
with the same operations on Python floats (:func:`pool_stats`). A statistic's entry also says whether it scales with the
gradient (a loss scale divides it out: :meth:`~lightning_gradhooks.summary.records.GradientRecord.unscaled`)
and whether a user can chart it (:data:`STATISTICS`, ``GradHooks(statistics=)``).

Adding a statistic is one entry here; it needs a kernel column only when no moment gives it.
Every statistic is over the *finite* elements, and ``nonfinite`` counts the others, so that one
NaN does not hide the shape of the rest of the gradient.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args


__all__ = [
    "MOMENTS", "SCALE_FREE", "ChartedStatistic", "STATISTICS", "STATS_WIDTH", "TABLE", "Moments", "Statistic", "StatsRow", "histogram_edges",
    "merge_histograms", "moments_of", "pool_stats", "row_of",
]


class Moments(NamedTuple):
    """What the device reduces a tensor to, from which every statistic follows. Works with floats
    and with columns (torch or numpy arrays) alike."""

    count: Any  # finite elements
    mean: Any  # of the finite elements
    spread: Any  # sum of squares about the mean
    low: Any  # finite minimum
    high: Any  # finite maximum
    zeros: Any  # exact zeros
    numel: Any  # every element


#: The moments the device keeps per tensor (:class:`Moments` but ``numel``, which the host knows).
MOMENTS = len(Moments._fields) - 1


@dataclass(frozen=True)
class Statistic:
    """One statistic of a tensor: its name (the row's field, the summary's key, the tag's suffix),
    what it is, how it follows from the :class:`Moments` (``finish(m, xp)``, ``xp`` torch, numpy or
    the same operations on floats),
    whether it is unchanged when the gradient is multiplied by a loss scale, and whether a user can
    chart it."""

    name: str
    description: str
    finish: Callable[[Moments, Any], Any]
    scale_free: bool = False
    charted: bool = True


def _std(m: Moments, xp: Any) -> Any:
    return xp.where(m.count > 1, xp.sqrt(xp.clip(m.spread, 0, None) / xp.clip(m.count - 1, 1, None)), 0.0)


#: Every statistic of a row, in row order.
TABLE: tuple[Statistic, ...] = (
    Statistic("norm", "L2 norm", lambda m, xp: xp.sqrt(xp.clip(m.spread, 0, None) + m.count * m.mean * m.mean)),
    Statistic("mean", "mean", lambda m, xp: m.mean),
    Statistic("std", "standard deviation (unbiased; 0 for fewer than two finite elements)", _std),
    Statistic("absmax", "largest absolute value", lambda m, xp: xp.maximum(abs(m.low), abs(m.high))),
    Statistic("nonfinite", "count of NaN/Inf elements", lambda m, xp: m.numel - m.count, scale_free=True),
    Statistic("zero_fraction", "share of all elements that are exactly zero (dead ReLUs, unused embedding rows)",
              lambda m, xp: xp.where(m.numel > 0, m.zeros / xp.clip(m.numel, 1, None), 0.0), scale_free=True),
    Statistic("count", "finite elements", lambda m, xp: m.count, scale_free=True, charted=False),
    Statistic("low", "finite minimum (the histogram's range)", lambda m, xp: m.low, charted=False),
    Statistic("high", "finite maximum (the histogram's range)", lambda m, xp: m.high, charted=False),
)

#: The chartable statistics, by name (``GradHooks(statistics=)``; checked against :data:`TABLE` below).
ChartedStatistic = Literal["norm", "mean", "std", "absmax", "nonfinite", "zero_fraction"]
#: The names of the chartable statistics, in row order.
STATISTICS: tuple[str, ...] = tuple(s.name for s in TABLE if s.charted)
#: The statistics a loss scale leaves unchanged.
SCALE_FREE: frozenset[str] = frozenset(s.name for s in TABLE if s.scale_free)


class StatsRow(NamedTuple):
    """The statistics of one tensor, one field per entry of :data:`TABLE`, read by name
    (``row.norm``, ``row.count``)."""

    norm: float
    mean: float
    std: float
    absmax: float
    nonfinite: float
    zero_fraction: float
    count: float
    low: float
    high: float


if StatsRow._fields != tuple(s.name for s in TABLE) or get_args(ChartedStatistic) != STATISTICS:  # pragma: no cover
    raise ImportError("StatsRow's fields and ChartedStatistic must follow TABLE, in order")
#: Values in a :class:`StatsRow`.
STATS_WIDTH = len(TABLE)

#: A :class:`StatsRow` from a sequence of its values, without ``StatsRow._make``'s Python frame
#: (a step makes one per tensor).
row_of: Callable[[Sequence[float]], StatsRow] = functools.partial(tuple.__new__, StatsRow)


def moments_of(row: StatsRow) -> Moments:
    """The moments of a row (the inverse of finishing them)."""
    numel = row.count + row.nonfinite
    return Moments(row.count, row.mean, row.std * row.std * max(row.count - 1, 0.0), row.low, row.high,
                   row.zero_fraction * numel, numel)


class _Floats:
    """The array operations of :data:`TABLE`'s ``finish``, on Python floats: pooling finishes one
    row at a time, where numpy's per-call overhead would cost more than the arithmetic."""

    sqrt = staticmethod(math.sqrt)
    maximum = staticmethod(max)

    @staticmethod
    def where(condition: bool, a: float, b: float) -> float:
        return a if condition else b

    @staticmethod
    def clip(x: float, low: float, high: None) -> float:
        return max(x, low)


def _finished(m: Moments) -> StatsRow:
    return row_of([float(s.finish(m, _Floats)) for s in TABLE])


def pool_stats(rows: Sequence[StatsRow]) -> StatsRow:
    """Combine statistics rows into the row of the concatenated tensors: their moments combined
    exactly (counts summed, the means weighted, the spreads by Chan's formula, the extremes of the
    finite parts), then finished as :data:`TABLE` says.

    Example:
        >>> a, b = StatsRow(5.0, 1.5, 0.7071, 2, 0, 0, 2, 1, 2), StatsRow(7.0711, 4.0, 1.0, 5, 0, 0, 3, 3, 5)
        >>> round(pool_stats([a, b]).mean, 6), pool_stats([a, b]).count
        (3.0, 5.0)
    """
    if len(rows) == 1:
        return rows[0]
    parts = [moments_of(r) for r in rows]
    finite = [m for m in parts if m.count > 0]
    count = sum(m.count for m in parts)
    mean = sum(m.mean * m.count for m in finite) / count if count else 0.0
    spread = sum(m.spread + m.count * (m.mean - mean) ** 2 for m in finite)
    return _finished(Moments(
        count, mean, spread, min((m.low for m in finite), default=0.0), max((m.high for m in finite), default=0.0),
        sum(m.zeros for m in parts), sum(m.numel for m in parts)))


def histogram_edges(low: float, high: float, bins: int) -> list[float]:
    """Right edges of the ``bins`` equal bins that the histograms count into."""
    width = (high - low) if high > low else 1.0
    return [low + width * (i + 1) / bins for i in range(bins)]


def merge_histograms(parts: Sequence[tuple[float, float, Sequence[float]]], bins: int) -> tuple[float, float, list[float]]:
    """Merge histograms of equal bins, each ``(low, high, counts)``.

    The result has ``bins`` equal bins over the combined range. Where the ranges differ, a
    part's counts are spread over the new bins in proportion to overlap (elements assumed
    uniform within a bin); the total count is kept exactly, and identical ranges merge exactly.
    """
    parts = [p for p in parts if sum(p[2]) > 0]
    if not parts:
        return 0.0, 0.0, [0.0] * bins
    if len(parts) == 1 and len(parts[0][2]) == bins:
        return parts[0][0], parts[0][1], list(parts[0][2])
    low, high = min(p[0] for p in parts), max(p[1] for p in parts)
    total = sum(sum(p[2]) for p in parts)
    if high <= low:
        return low, high, [total] + [0.0] * (bins - 1)
    edges = [low + (high - low) * k / bins for k in range(1, bins)]
    below = [0.0] * len(edges)
    for part in parts:
        for k, mass in enumerate(_masses_below(part, edges)):
            below[k] += mass
    cumulative = [0.0, *below, total]
    return low, high, [max(b - a, 0.0) for a, b in zip(cumulative, cumulative[1:])]


def _masses_below(part: tuple[float, float, Sequence[float]], edges: Sequence[float]) -> Iterator[float]:
    """For each edge, the count of ``part``'s elements below it (uniform within a bin)."""
    low, high, counts = part
    if high <= low:  # every element equals `low`
        total = sum(counts)
        yield from (total if low < x else 0.0 for x in edges)
        return
    prefix = [0.0, *itertools.accumulate(counts)]
    for x in edges:
        position = min(max((x - low) / (high - low) * len(counts), 0.0), len(counts))
        whole = int(position)
        yield prefix[whole] + ((position - whole) * counts[whole] if whole < len(counts) else 0.0)
