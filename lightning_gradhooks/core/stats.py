"""Reductions of gradient tensors to statistics and histograms, on their device.

A :class:`Reducer` takes the gradients of a logged step as hooks see them and reduces them on
their own device, one source of torch ops on every device, that reads no value to the host until
:meth:`Reducer.finish` brings every result over in one transfer (without a compiler, which rows
are whole and finite too: see below). Gradients are gathered into
batches (a bigger tensor is a batch of its own), because on accelerators the launch count, not
the bytes, is what costs; each batch is laid out in rows of :data:`ROW` elements and each
gradient is read at most twice: once for the moments of its rows (:func:`row_moments`), once
for its histogram (:func:`row_histograms`). The two row functions are compiled by
``torch.compile`` into one kernel each (C++ on the CPU, Triton on GPUs) where a compiler is
there, with a fixed set of shapes (:mod:`lightning_gradhooks.core._kernels`). Where nothing
compiles, :func:`eager_moments` and :func:`eager_histograms` give the same numbers from a few
vectorised passes over cache-sized chunks of the rows that are whole and finite (the compiled
source, run as it is, would pass over the rows once per op). Only the sizes depend on the device
(:data:`SIZES`).

The device holds six *moments* per tensor (finite count, mean, sum of squares about the mean,
finite minimum and maximum, zero count);
:func:`finish_rows` turns them into the statistics of
:data:`~lightning_gradhooks.summary.statistics.TABLE`, for all tensors at once.
Every statistic is over the *finite* elements only, and ``nonfinite`` counts the others, so that
one NaN does not hide the shape of the rest of the gradient.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_gradhooks.core import _kernels
from lightning_gradhooks.summary.statistics import MOMENTS, TABLE, Moments, StatsRow, row_of

class Sizes(NamedTuple):
    """How many elements a batch gathers before it is reduced (a bigger gradient is a batch of its
    own, laid out in rows), and from how many elements a tensor's rows are read in place rather
    than copied into the batch's block."""

    batch: int
    block: int


#: Sizes by device type. On the CPU a tensor of a quarter of a million elements is read in place
#: (a copy costs more than a call); elsewhere (:data:`DEVICE_SIZES`) batches are bigger and only
#: a batch-sized tensor is read in place: launches, not bytes, cost there. The ops are the same.
SIZES: dict[str, Sizes] = {"cpu": Sizes(batch=1 << 22, block=1 << 18)}
DEVICE_SIZES = Sizes(batch=1 << 24, block=1 << 24)
#: Width of the rows a batch is laid out in: every tensor starts a row, its last row is padded.
ROW = 1024


_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _flat(tensor: Tensor) -> Tensor:
    """Detached, flat, in a float dtype (others become float32): a view where the elements are dense (contiguous,
    or channels-last: statistics and histograms do not depend on the order of the elements).

    A sparse gradient (``nn.Embedding(sparse=True)``) is made dense: its statistics are those of
    the whole tensor, implicit zeros included, at the cost of a dense copy while it is reduced.
    """
    x = tensor.detach() if tensor.requires_grad else tensor
    if x.dtype in _FLOATS and x.layout is torch.strided and x.is_contiguous():  # the common case
        return x if x.dim() == 1 else x.view(-1)
    if x.layout != torch.strided:
        x = x.to_dense()
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:  # float8 too
        x = x.float()
    if x.is_contiguous():
        return x if x.dim() == 1 else x.view(-1)
    dense = (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
    )
    return x.as_strided((x.numel(),), (1,)) if dense else x.reshape(-1)


#: Scratch buffers of at most this many elements outlive a logged step (see :class:`Scratch`).
SCRATCH_KEPT = 1 << 22


class Scratch:
    """Buffers that batches are copied into (:func:`reduce_batch`).

    A fresh buffer of megabytes costs a page fault per 4 KiB on its first write on the CPU,
    often more than the arithmetic; reused, it costs nothing. A buffer grows to the largest
    batch that needs it. :meth:`trim`, at the end of each step, drops those bigger than
    :data:`SCRATCH_KEPT` elements, so what is kept between logged steps is bounded (a few tens
    of MiB at most per device), whatever the model.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        buffer = self._buffers.get((name, dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name, dtype, device] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def trim(self) -> None:
        """Drop the buffers bigger than :data:`SCRATCH_KEPT` elements."""
        for key in [k for k, b in self._buffers.items() if b.numel() > SCRATCH_KEPT]:
            del self._buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass(slots=True)
class _Batch:
    """Tensors waiting to be reduced together (flat), their element counts, their positions in
    the order added, their size in rows' elements, the dtype they are reduced in, and those
    added with ``watch`` (:meth:`Reducer.add`): ``(position, tensor, version)``."""

    tensors: list[Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    elements: int = 0
    dtype: torch.dtype | None = None
    watched: list[tuple[int, Tensor, int]] = field(default_factory=list)


class Reducer:
    """Reduces the gradients of one step on one device: statistics, and histograms where asked.

    Args:
        bins: histogram bins.
        scratch: where batches are copied into; pass the same one every step to reuse its
            buffers (by default each reducer has its own).
        compiled: reduce with kernels compiled by ``torch.compile`` where a compiler is there
            (:mod:`lightning_gradhooks.core._kernels`); False: the eager sequence that gives the
            same numbers (:func:`eager_moments`, :func:`eager_histograms`).

    Call :meth:`add` for every tensor, then :meth:`finish` once: it reads everything to the
    host in one transfer. A tensor that may still change after it is added (a module's output,
    which a later in-place op may overwrite) is added with ``watch=True``: it is read with its
    batch, and if its version counter moved before the batch ran, :meth:`finish` gives None in
    its place instead of statistics of what it became.

    Example:
        >>> reducer = Reducer(bins=4)
        >>> reducer.add(torch.tensor([3.0, -4.0]), histogram=True)
        >>> (row, counts), = reducer.finish()
        >>> round(row[0], 4), counts
        (5.0, [1.0, 0.0, 0.0, 1.0])
    """

    def __init__(self, bins: int, scratch: Scratch | None = None, compiled: bool = True) -> None:
        self.bins = bins
        self.compiled = compiled
        # Reduced blocks: (moments (k, MOMENTS), counts (k, bins) or None, positions of the k
        # tensors in the order added); the open batches, with and without histograms (they
        # cost more than the statistics); what was added.
        self._blocks: list[tuple[Tensor, Tensor | None, list[int]]] = []
        self._open: dict[bool, _Batch] = {}
        self._numels: list[int] = []
        self._changed: set[int] = set()  # watched tensors changed before their batch ran
        self._limit = 0  # elements per batch on this reducer's device, known from the first tensors
        self._scratch = Scratch() if scratch is None else scratch

    def add(self, tensor: Tensor, histogram: bool, watch: bool = False) -> None:
        """Let ``tensor`` (of this reducer's device) join a batch, reduced when the batch is full
        or at :meth:`finish`. ``watch``: the tensor may change in place before then (see the
        class); a watched tensor that fills its batch is reduced at once (not held longer)."""
        self.extend((tensor,), histogram)
        if watch:
            batch = self._open[histogram]
            x = batch.tensors[-1]
            batch.watched.append((batch.positions[-1], x, x._version))  # x shares the counter, not the graph
            if batch.elements >= self._limit:
                self._flush(histogram)

    def extend(self, tensors: Sequence[Tensor], histogram: bool) -> None:
        """:meth:`add` of each of ``tensors`` (none watched), in one call (a step's parameter
        gradients: no Python frame per tensor)."""
        numels, limit = self._numels, self._limit or SIZES.get(tensors[0].device.type, DEVICE_SIZES).batch
        self._limit = limit  # elements per batch on this device
        batch = self._open.get(histogram)
        strided, floats, row, position = torch.strided, _FLOATS, ROW, len(numels)  # locals: a loop per tensor
        for tensor in tensors:
            # _flat's common case inline (a gradient: dense, contiguous, float, not requiring grad).
            dtype = tensor.dtype
            if dtype in floats and tensor.layout is strided and tensor.is_contiguous() and not tensor.requires_grad:
                x = tensor if tensor.dim() == 1 else tensor.view(-1)
            else:
                x = _flat(tensor)
                dtype = x.dtype
            numel = x.numel()
            n = row * (-(-numel // row) or 1)  # counted as laid out in rows (_rows)
            if batch is None or batch.elements + n > limit:
                if batch is not None:
                    self._flush(histogram)
                batch = self._open[histogram] = _Batch(dtype=dtype)
            elif dtype is not batch.dtype:
                batch.dtype = torch.promote_types(batch.dtype, dtype)
            batch.tensors.append(x)
            batch.lengths.append(numel)
            batch.positions.append(position)
            batch.elements += n
            numels.append(numel)
            position += 1

    def _flush(self, histogram: bool) -> None:
        batch = self._open.pop(histogram)
        self._changed.update(p for p, t, version in batch.watched if t._version != version)
        moments, counts = reduce_batch(batch.tensors, self.bins if histogram else None, self._scratch, self.compiled,
                                       (tuple(batch.lengths), batch.dtype))
        self._blocks.append((moments, counts, batch.positions))

    def finish(self) -> list[tuple[StatsRow, list[float] | None] | None]:
        """The statistics row and histogram counts (or None) of each tensor, in the order added;
        None instead for a watched tensor changed in place before its batch ran."""
        for key in list(self._open):
            self._flush(key)
        blocks, numels, changed = self._blocks, self._numels, self._changed
        self._blocks, self._open, self._numels, self._changed = [], {}, [], set()
        self._scratch.trim()
        if not blocks:
            return []
        parts = [m.reshape(-1) for m, _, _ in blocks] + [c.reshape(-1) for _, c, _ in blocks if c is not None]
        host = torch.cat(parts).to("cpu", torch.float64)  # the one transfer
        positions = [p for _, _, block in blocks for p in block]
        k, in_order = len(positions), positions == list(range(len(numels)))  # in order: one batch at a time
        lengths = torch.tensor(numels if in_order else [numels[p] for p in positions], dtype=torch.float64)
        rows = map(row_of, finish_rows(host[: k * MOMENTS].view(k, MOMENTS), lengths).tolist())
        if all(c is None for _, c, _ in blocks):  # no histograms: the rows alone
            pairs = zip(rows, itertools.repeat(None))
        else:
            # The counts of each tensor that has them, as lists (tolist is slow on a view that starts
            # inside its storage: hence the clone).
            counts = iter(host[k * MOMENTS :].clone().view(-1, self.bins).tolist())
            has_counts = (c is not None for _, c, block in blocks for _ in block)
            pairs = ((row, next(counts) if has else None) for row, has in zip(rows, has_counts))
        if in_order:
            results: list[tuple[StatsRow, list[float] | None] | None] = list(pairs)
        else:
            results = [None] * len(numels)
            for p, pair in zip(positions, pairs):
                results[p] = pair
        for p in changed:
            results[p] = None
        return results


def _bin_scale(span: Tensor, bins: int, dtype: torch.dtype) -> Tensor:
    """The two factors, in ``dtype``, that take values minus their tensor's minimum (in
    ``[0, span]``) to bin positions in ``[0, bins)``: ``bins / span``, computed in float64 and
    shrunk so that the maximum lands just inside the last bin (no clamp pass).

    The first factor is 1, or an exact 2**64 where a denormal span makes the scale too big for
    ``dtype``. A span of 0 (a constant tensor, or denormals flushed to zero under
    ``torch.set_flush_denormal``) gives a scale of 0: every element in bin 0, never NaN.

    Returns:
        shape ``(2, *span.shape)``.
    """
    scale = (bins * (1 - 1e-6) / span).nan_to_num_(0.0, 0.0, 0.0)  # a span of 0 (or -inf: nothing finite)
    step = torch.where(scale > torch.finfo(dtype).max / 2.0**64, 2.0**64, 1.0)
    return torch.stack([step.to(torch.float64), scale / step]).to(dtype)


@dataclass(frozen=True)
class _RowLayout:
    """Where the rows of a batch come from (:func:`_layout`).

    Attributes:
        row_of: the tensor of each row, the rows in the order the blocks hold them.
        in_place: the blocks read in place, each ``(tensor, end element, first row)``: the whole
            rows of a big tensor, or of a lone tensor that fills its rows.
        copied: what is copied, in rows after those read in place: ``(tensor, first element,
            padding)``, each to the tensor's end, then its padding (elements, 0 for none).
        copied_elements: the elements of the copied block, paddings included.
    """

    row_of: Tensor
    in_place: list[tuple[int, int, int]]
    copied: list[tuple[int, int, int]]
    copied_elements: int


@functools.lru_cache(maxsize=256)
def _layout(lengths: tuple[int, ...], device: torch.device, in_place_elements: int) -> _RowLayout:
    """The rows of a batch, built once per layout (a model gives the same layouts every logged
    step) and copied to the device once.

    Tensor ``k`` fills ``ceil(n_k / ROW)`` rows (one if it is empty), the last one padded to
    :data:`ROW` elements. Its whole rows are read in place if it is alone and fills them, or if
    it holds ``in_place_elements`` or more; everything else is copied into one buffer.
    """
    rows, pads = [_rows(n) for n in lengths], [-n % ROW if n else ROW for n in lengths]
    row_of: list[int] = []
    in_place, copied = [], []
    for k, n in enumerate(lengths):
        if (len(lengths) == 1 and n and not pads[k]) or (n >= in_place_elements and n >= ROW):
            in_place.append((k, n // ROW * ROW, len(row_of)))
            row_of += [k] * (n // ROW)
    read = {k: end for k, end, _ in in_place}
    for k, n in enumerate(lengths):
        if read.get(k, 0) < n or not n:
            copied.append((k, read.get(k, 0), pads[k]))
            row_of += [k] * (rows[k] - read.get(k, 0) // ROW)
    elements = sum(lengths[k] - start + pad for k, start, pad in copied)
    return _RowLayout(torch.tensor(row_of, device=device), in_place, copied, elements)


def _rows(n: int) -> int:
    """Rows of :data:`ROW` elements that a tensor of ``n`` elements fills in a batch."""
    return max(1, -(-n // ROW))


@functools.lru_cache(maxsize=4096)
def _padding(device: torch.device, dtype: torch.dtype, length: int) -> Tensor:
    """``length`` NaN, made once (a slice made at every step would be an op of its own)."""
    return torch.full((length,), math.nan, dtype=dtype, device=device)


def _blocks(tensors: Sequence[Tensor], layout: _RowLayout, dtype: torch.dtype, scratch: Scratch | None) -> list[Tensor]:
    """The batch as blocks of rows of :data:`ROW` elements (:func:`_layout`): those read in
    place, then one block copied into one buffer, each tensor on rows of its own, padded with
    NaN. A tensor read in place is first converted to the batch's dtype if it has another."""
    blocks = [tensors[k][:end].to(dtype).view(-1, ROW) for k, end, _ in layout.in_place]
    if not layout.copied:
        return blocks
    device = tensors[0].device
    pieces: list[Tensor] = []
    append = pieces.append
    for k, start, pad in layout.copied:
        append(tensors[k][start:] if start else tensors[k])
        if pad:
            append(_padding(device, dtype, pad))
    out = scratch.get("batch", layout.copied_elements, dtype, device) if scratch is not None else None
    x = torch.cat(pieces, out=out) if len(pieces) > 1 else pieces[0].to(dtype)
    return [*blocks, x.view(-1, ROW)]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a block of ``dtype`` is reduced in: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def row_moments(x: Tensor) -> Tensor:
    """Per row of ``x`` (rows, width): finite count, a pivot (the row's first element, 0 where it
    is not finite), the sum and the sum of squares of the finite elements minus the pivot, zero
    count, finite minimum and maximum, as one ``(rows, 7)`` tensor in float32 (float64 for
    float64), in one pass over the row.

    The pivot is one of the row's elements, so the sum of squares about it is at most ``width + 1``
    times the sum of squares about the mean, and the variance that :func:`reduce_batch` takes from
    the two sums keeps all but ``log2(width + 1)`` bits in the worst case (one element far from all
    the others), and nearly all in the common one; a row whose first element is NaN or Inf (rare:
    the gradient holds one there) is taken about 0. The first of the two reads of a gradient
    (:func:`reduce_batch`). Plain torch ops, fused into one kernel by ``torch.compile``
    (:mod:`lightning_gradhooks.core._kernels`).
    """
    x = x.to(_compute_dtype(x.dtype))
    finite = x.isfinite()
    pivot = x[:, :1]
    pivot = torch.where(pivot.isfinite(), pivot, 0.0)
    shifted = torch.where(finite, x - pivot, 0.0)
    count = finite.sum(1, dtype=x.dtype)
    low = torch.where(finite, x, math.inf).amin(1)
    high = torch.where(finite, x, -math.inf).amax(1)
    zeros = (x == 0).sum(1, dtype=x.dtype)
    return torch.stack([count, pivot[:, 0], shifted.sum(1), shifted.square().sum(1), zeros, low, high], 1)


@_kernels.scatter  # in parallel CPU code: called on cache-sized pieces of a block
def row_histograms(x: Tensor, ranges: Tensor, bins: int) -> Tensor:
    """Per row of ``x`` (rows, width): the counts of its finite elements in ``bins`` equal bins,
    each row over the range of its tensor (``ranges``: per row the tensor's minimum and the two
    factors of :func:`_bin_scale`, then the row's finite count, which :func:`eager_histograms`
    reads), and in an extra last bin the rest, as int32 ``(rows, bins + 1)``.

    The second read of a gradient. Each row counts into its own counters (a scatter along the
    row): no counter is shared by rows, so compiled code needs no atomics across rows.
    """
    x = x.to(ranges.dtype)
    position = (x - ranges[:, 0:1]) * ranges[:, 1:2] * ranges[:, 2:3]
    index = torch.where(position.isfinite(), position, bins).clamp(0, bins).to(torch.int64)
    counts = torch.zeros(x.shape[0], bins + 1, dtype=torch.int32, device=x.device)
    return counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))


# -- the same numbers without a compiler -----------------------------------------------------
# Run as eager ops, the row functions above cost a pass (and a temporary) per op: 40-80 reads of
# each gradient. Where nothing compiles, these give the same rows from a few vectorised passes over
# cache-sized chunks of rows, on the rows that are whole and finite; the others (the padded last
# row of a tensor, a row holding NaN or Inf) are few, and the row functions run on them as they
# are. Telling them apart reads one value list to the host per block (free on the CPU, one wait
# for the device elsewhere).


def _chunk_rows(device: torch.device) -> int:
    """Rows per chunk of the eager sequence: a cache-sized block on the CPU, a batch elsewhere."""
    return max(1, SIZES.get(device.type, DEVICE_SIZES).block // ROW)


def eager_moments(x: Tensor) -> Tensor:
    """:func:`row_moments` of ``x`` without a compiler: per chunk of rows, the minimum and maximum
    (NaN or Inf in a row shows in them), the elements minus the pivot (the row's first) written
    once into a chunk-sized buffer, their sum and norm, and the zero count; then the rows that are
    not whole and finite again, by :func:`row_moments` itself."""
    compute = _compute_dtype(x.dtype)
    step = _chunk_rows(x.device)
    work = torch.empty(min(step, len(x)), x.shape[1], dtype=compute, device=x.device)
    chunks = []
    for r in range(0, len(x), step):
        chunk = x[r : r + step]
        w = work[: len(chunk)]
        pivot = chunk[:, 0].to(compute)
        shifted = torch.sub(chunk, pivot[:, None].expand_as(chunk), out=w)  # expanded: faster than broadcast
        chunks.append((pivot, shifted.sum(1), torch.linalg.vector_norm(shifted, dim=1).square_(),
                       torch.eq(chunk, 0, out=w).sum(1), chunk.amin(1).to(compute), chunk.amax(1).to(compute)))
    pivot, shifted, squares, zeros, low, high = (_joined(list(c)) for c in zip(*chunks))
    out = torch.stack([torch.full_like(pivot, x.shape[1]), pivot, shifted, squares, zeros, low, high], 1)
    bad = (low.isfinite() & high.isfinite()).logical_not_().nonzero().view(-1)  # one read to the host
    if len(bad):
        out.index_copy_(0, bad, _kernels.rows_at_a_time(row_moments, x.index_select(0, bad)))
    return out


def eager_histograms(x: Tensor, ranges: Tensor, bins: int) -> Tensor:
    """:func:`row_histograms` of ``x`` without a compiler: the bin positions by the same
    arithmetic, truncated to integers and counted with one ``index_add`` per chunk of rows, for
    the rows that are whole and finite (``ranges[:, 3]``, the row's finite count, is the row's
    width) and whose first factor is 1; the others (a padded or non-finite row, a denormal span)
    by :func:`row_histograms` itself."""
    bad = ((ranges[:, 3] < x.shape[1]) | (ranges[:, 1] != 1.0)).nonzero().view(-1)  # one read to the host
    if len(bad) == len(x):
        return _kernels.rows_at_a_time(row_histograms, x, ranges, bins=bins)
    step, device = _chunk_rows(x.device), x.device
    work = torch.empty(min(step, len(x)), x.shape[1], dtype=ranges.dtype, device=device)
    index = torch.empty(work.shape, dtype=torch.int32, device=device)
    table = torch.zeros(len(x) * (bins + 1), dtype=torch.int32, device=device)
    offsets = torch.arange(0, len(x) * (bins + 1), bins + 1, dtype=torch.int32, device=device)[:, None]
    ones = _ones(device).expand(index.numel())
    marked = bad.tolist()
    for r in range(0, len(x), step):
        chunk, rows = x[r : r + step], ranges[r : r + step]
        low, scale = rows[:, 0:1].expand_as(chunk), rows[:, 2:3].expand_as(chunk)  # expanded: faster than broadcast
        position = torch.sub(chunk, low, out=work[: len(chunk)]).mul_(scale)  # the first factor is 1
        inside = [b - r for b in marked if r <= b < r + len(chunk)]
        if inside:  # NaN or Inf positions, or another first factor: counted below, out of the way here
            position.index_fill_(0, torch.tensor(inside, device=device), bins)
        at = index[: len(chunk)].copy_(position).add_(offsets[r : r + len(chunk)])
        table.index_add_(0, at.view(-1), ones[: at.numel()])
    counts = table.view(len(x), bins + 1)
    if len(bad):
        others = _kernels.rows_at_a_time(row_histograms, x.index_select(0, bad), ranges.index_select(0, bad), bins=bins)
        counts.index_copy_(0, bad, others)
    return counts


@functools.lru_cache(maxsize=16)
def _ones(device: torch.device) -> Tensor:
    return torch.ones(1, dtype=torch.int32, device=device)


def reduce_batch(
    tensors: Sequence[Tensor], bins: int | None, scratch: Scratch | None = None, compiled: bool = True,
    known: tuple[tuple[int, ...], torch.dtype] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Moments (and histograms) of many flat float tensors on one device, in a fixed number of
    ops per block (per cache-sized chunk, eager on the CPU), without reading a value to the host
    where compiled.

    The tensors are laid out in rows (:func:`_layout`), each tensor on rows of its own, padded
    with NaN: the rows of big tensors read in place, the rest copied into one block. Each block is
    read at most twice: once for the moments of each row (:func:`row_moments`), combined into
    those of each tensor with ``index_add`` (in float64; the variances of the rows by Chan's
    formula), and, for histograms, once more (:func:`row_histograms`). Both row functions are
    compiled where ``compiled`` and a compiler allow (:mod:`lightning_gradhooks.core._kernels`);
    otherwise :func:`eager_moments` and :func:`eager_histograms` run, which read to the host which
    rows are whole and finite, once per block and pass.

    ``known``: the tensors' element counts and their promoted dtype, where the caller has them
    (:class:`Reducer`: not read again, tensor by tensor).

    Returns:
        ``(moments, counts)``: float64 tensors of shape ``(len(tensors), MOMENTS)`` and
        ``(len(tensors), bins)`` (None without ``bins``).
    """
    if known is None:
        known = tuple(t.numel() for t in tensors), functools.reduce(torch.promote_types, {t.dtype for t in tensors})
    (lengths, dtype), device = known, tensors[0].device
    layout = _layout(lengths, device, SIZES.get(device.type, DEVICE_SIZES).block)
    row_of, m, f64 = layout.row_of, len(tensors), torch.float64
    blocks = _blocks(tensors, layout, dtype, scratch)
    per_row = _joined([_kernels.run(row_moments, eager_moments, compiled, block) for block in blocks])
    finite, pivot, shifted, squares, zeros = per_row[:, :5].to(f64).unbind(1)
    row_mean = pivot + shifted / finite.clamp(min=1)
    row_spread = squares - shifted * shifted / finite.clamp(min=1)  # sum of squares about the row's mean
    per_tensor = torch.zeros(m, 3, dtype=f64, device=device)
    per_tensor.index_add_(0, row_of, torch.stack([finite, finite * row_mean, zeros], 1))
    count, total, zeros = per_tensor.unbind(1)
    mean = total / count.clamp(min=1)
    # Chan's formula: the spread of a tensor is its rows' spreads plus that of their means.
    spread = torch.zeros(m, dtype=f64, device=device).index_add_(
        0, row_of, row_spread.clamp_(min=0.0) + finite * (row_mean - mean[row_of]).square_()
    )
    reduced = per_row.dtype
    low = torch.full((m,), math.inf, dtype=reduced, device=device).scatter_reduce_(0, row_of, per_row[:, 5], "amin")
    high = torch.full((m,), -math.inf, dtype=reduced, device=device).scatter_reduce_(0, row_of, per_row[:, 6], "amax")
    moments = torch.stack([count, mean, spread, low.to(f64), high.to(f64), zeros], 1)
    if bins is None:
        return moments, None
    # (x - low) / span lies in [0, 1] however tiny the span (denormal gradients of a deep
    # stack), so the shrunk scale keeps every finite element below `bins`. Per row: the tensor's
    # minimum, the two factors, and the row's finite count (which the eager sequence reads).
    ranges = torch.cat([torch.cat([low[None], _bin_scale(high.double() - low.double(), bins, reduced)]).T[row_of],
                        per_row[:, :1]], 1)
    first, counts = 0, []
    for block in blocks:  # the second read
        rows = ranges[first : first + len(block)]
        counts.append(_kernels.run(row_histograms, eager_histograms, compiled, block, rows, bins=bins))
        first += len(block)
    table = torch.zeros(m, bins + 1, dtype=f64, device=device).index_add_(0, row_of, _joined(counts).to(f64))
    return moments, table[:, :bins]


def _joined(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def finish_rows(moments: Tensor, numels: Tensor) -> Tensor:
    """Statistics rows (:class:`~lightning_gradhooks.summary.statistics.StatsRow`) from moments, for many
    tensors at once, each statistic as :data:`~lightning_gradhooks.summary.statistics.TABLE` declares it.

    Args:
        moments: float64, shape ``(k, MOMENTS)``, as :class:`Reducer` lays them out.
        numels: float64, the element count of each tensor.

    Returns:
        float64, shape ``(k, STATS_WIDTH)``.
    """
    count, mean, spread, low, high, zeros = moments.unbind(1)
    empty = count == 0  # no finite element: every moment is 0
    mean, spread, low, high = (v.masked_fill(empty, 0.0) for v in (mean, spread, low, high))
    m = Moments(count, mean, spread, low, high, zeros, numels)
    return torch.stack([s.finish(m, torch) for s in TABLE], 1)




def reduce(
    tensors: Sequence[Tensor], bins: int | None = None, compiled: bool = True
) -> list[tuple[StatsRow, list[float] | None]]:
    """Statistics rows (and histogram counts) of each tensor, read to the host at once
    (``compiled``: as :class:`Reducer`).

    Example:
        >>> (row, counts), = reduce([torch.tensor([3.0, -4.0, float("nan")])], bins=2)
        >>> [round(v, 4) for v in row[:5]], counts
        ([5.0, -0.5, 4.9497, 4.0, 1.0], [1.0, 1.0])
    """
    reducer = Reducer(bins or 1, compiled=compiled)
    for t in tensors:
        reducer.add(t, bins is not None)
    return reducer.finish()
