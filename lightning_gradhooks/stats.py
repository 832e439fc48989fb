"""Pure-torch reductions of a gradient tensor to its statistics and histogram.

Everything here stays on the tensor's device: no ``.item()``, ``.cpu()`` or ``.tolist()``.
The statistics of one tensor are a 1-D float32 tensor laid out as :data:`STATISTICS`; they are
computed over the *finite* elements only, and ``nonfinite`` counts the others, so that one NaN
does not hide the shape of the rest of the gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

#: Names of the statistics, in the order of :func:`tensor_stats`'s result.
#: ``norm`` (L2), ``mean``, ``std`` (unbiased, 0 for fewer than two finite elements),
#: ``absmax``, ``nonfinite`` (count of NaN/Inf elements).
Statistic = Literal["norm", "mean", "std", "absmax", "nonfinite"]
STATISTICS: tuple[str, ...] = get_args(Statistic)

# Position of the finite-element count and of the histogram range in the vector that
# :func:`tensor_stats` returns behind the public statistics (used to build histograms).
_NONFINITE = STATISTICS.index("nonfinite")
_COUNT, _LOW, _HIGH = len(STATISTICS), len(STATISTICS) + 1, len(STATISTICS) + 2
STATS_WIDTH = len(STATISTICS) + 3


def _as_float(tensor: Tensor) -> Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return flat


def tensor_stats(tensor: Tensor) -> Tensor:
    """Reduce ``tensor`` to its statistics, on its own device.

    Args:
        tensor: any floating-point tensor (half precision is reduced in float32).

    Returns:
        A float32 tensor of ``STATS_WIDTH`` values: the :data:`STATISTICS`, then the number of
        finite elements and the finite minimum and maximum (the histogram range).

    Example:
        >>> s = tensor_stats(torch.tensor([3.0, -4.0, float("nan")]))
        >>> [round(v, 4) for v in s[:5].tolist()]
        [5.0, -0.5, 4.9497, 4.0, 1.0]
    """
    x = _as_float(tensor)
    if x.device.type == "cpu" and x.numel() > 1:
        stats = _stats_if_finite(x)
        if stats is not None:
            return stats
    return _masked_stats(x)


def _stats_if_finite(x: Tensor) -> Tensor | None:
    """Four cheap passes for the common case of a CPU tensor whose values are all finite.

    On the CPU, reading a reduced scalar is not a device synchronisation, so the finite check
    can branch and the scalar arithmetic can run in double precision on the host; on
    accelerators the branch-free :func:`_masked_stats` is used instead. Sums use torch's
    cascade summation (``vector_norm`` and ``dot`` lose up to 1e-4 on millions of elements).
    """
    low, high = (v.item() for v in torch.aminmax(x))
    total, squares = x.sum().item(), (x * x).sum().item()
    if not all(map(math.isfinite, (low, high, total, squares))):
        return None
    n = x.numel()
    mean = total / n
    spread = squares - n * mean * mean
    if spread <= 0.1 * squares:  # the mean dominates: centre first to keep the std exact
        spread = torch.sub(x, mean).square().sum().item()
    std = math.sqrt(max(spread, 0.0) / (n - 1))
    absmax = max(abs(low), abs(high))
    return torch.tensor([math.sqrt(squares), mean, std, absmax, 0.0, n, low, high], dtype=torch.float32)


def _masked_stats(x: Tensor) -> Tensor:
    """Statistics over the finite elements, without reading anything back to the host."""
    finite = torch.isfinite(x)
    count = finite.sum()
    zeroed = torch.where(finite, x, 0.0)
    norm = zeroed.square().sum().sqrt()
    mean = zeroed.sum() / count.clamp(min=1)
    centred = torch.where(finite, x - mean, 0.0)
    std = (centred.square().sum() / (count - 1).clamp(min=1)).sqrt()
    low = torch.where(finite, x, torch.inf).amin()
    high = torch.where(finite, x, -torch.inf).amax()
    any_finite = count > 0
    low = torch.where(any_finite, low, 0.0)
    high = torch.where(any_finite, high, 0.0)
    absmax = torch.maximum(high.abs(), low.abs())
    nonfinite = x.numel() - count
    return torch.stack([norm, mean, std, absmax, nonfinite, count, low, high]).float()


def _shrunk(bins: int) -> float:
    """Scale so that the maximum lands just inside the last bin: no clamp pass is needed."""
    return bins * (1 - 1e-6)


def tensor_histogram(tensor: Tensor, stats: Tensor, bins: int) -> Tensor:
    """Count the finite elements of ``tensor`` in ``bins`` equal bins over their range.

    Args:
        tensor: the tensor that ``stats`` was computed from.
        stats: the result of :func:`tensor_stats` for ``tensor`` (supplies the range).
        bins: number of bins.

    Returns:
        A float32 tensor of ``bins`` counts on the tensor's device. Non-finite elements are
        not counted; the bin edges follow from :func:`histogram_edges`.
    """
    x = _as_float(tensor)
    if x.device.type == "cpu":
        return _histogram_host_range(x, stats, bins)
    return _histogram_on_device(x, stats, bins)


def _histogram_host_range(x: Tensor, stats: Tensor, bins: int) -> Tensor:
    """CPU: the statistics are in host memory, so the range is read as plain floats."""
    low, high, nonfinite = stats[_LOW].item(), stats[_HIGH].item(), stats[_NONFINITE].item()
    scale = _shrunk(bins) / (high - low if high > low else 1.0)
    # x - low is exact and >= 0 for finite x (Sterbenz), so no clamp pass is needed.
    index = torch.sub(x, low).mul_(scale)
    if nonfinite:
        index = torch.where(torch.isfinite(x), index, bins)
    # Truncation maps [0, bins) onto the bins; bincount counts bytes fastest.
    counts = torch.bincount(index.to(torch.uint8 if bins < 255 else torch.int64), minlength=bins + 1)
    return counts[:bins].float()


def _histogram_on_device(x: Tensor, stats: Tensor, bins: int) -> Tensor:
    """Accelerators: nothing is read back (``bincount`` would read its maximum to the host)."""
    low, high = stats[_LOW].to(x.dtype), stats[_HIGH].to(x.dtype)
    scale = _shrunk(bins) / torch.where(high > low, high - low, 1.0)
    index = torch.where(torch.isfinite(x), (x - low) * scale, bins).long()
    counts = torch.zeros(bins + 1, device=x.device, dtype=torch.float32)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:bins]


def histogram_edges(low: float, high: float, bins: int) -> list[float]:
    """Right edges of the ``bins`` bins that :func:`tensor_histogram` counted into."""
    width = (high - low) if high > low else 1.0
    return [low + width * (i + 1) / bins for i in range(bins)]


# -- pooling, on the host ------------------------------------------------------------------
# A module called several times in one step, the micro-batches of one accumulated step and
# the ranks of a data-parallel job each give several statistics rows for one name. They are
# pooled as if the gradients had been concatenated into one tensor.


def pool_stats(rows: Sequence[Sequence[float]]) -> list[float]:
    """Combine rows of :func:`tensor_stats` into the row of the concatenated tensors.

    ``norm`` is the root of the summed squares, ``mean`` and ``std`` are over all finite
    elements (the variances combine exactly, by Chan's formula), ``absmax`` and the range are
    the extremes and ``nonfinite`` is summed.

    Example:
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
        >>> pooled = pool_stats([tensor_stats(a).tolist(), tensor_stats(b).tolist()])
        >>> torch.allclose(torch.tensor(pooled), tensor_stats(torch.cat([a, b])))
        True
    """
    if len(rows) == 1:
        return list(rows[0])
    counts = [r[_COUNT] for r in rows]
    count = sum(counts)
    finite = [r for r in rows if r[_COUNT] > 0]
    mean = sum(r[1] * r[_COUNT] for r in finite) / count if count else 0.0
    spread = sum(r[2] ** 2 * (r[_COUNT] - 1) + r[_COUNT] * (r[1] - mean) ** 2 for r in finite)
    std = math.sqrt(max(spread, 0.0) / (count - 1)) if count > 1 else 0.0
    low = min((r[_LOW] for r in finite), default=0.0)
    high = max((r[_HIGH] for r in finite), default=0.0)
    return [
        math.sqrt(sum(r[0] ** 2 for r in rows)),
        mean,
        std,
        max(r[3] for r in rows),
        sum(r[_NONFINITE] for r in rows),
        count,
        low,
        high,
    ]


def merge_histograms(parts: Sequence[tuple[float, float, Sequence[float]]], bins: int) -> tuple[float, float, list[float]]:
    """Merge histograms of the layout :func:`tensor_histogram` makes, each ``(low, high, counts)``.

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
