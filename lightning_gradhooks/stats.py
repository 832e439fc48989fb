"""Reductions of gradient tensors to statistics and histograms; pooling on the host.

A :class:`Reducer` takes the gradients of a logged step as hooks see them and reduces them on
their own device, with no ``.item()``, ``.cpu()`` or ``.tolist()`` off the CPU:

- on the CPU, float32 gradients are reduced by the C kernels of ``_kernels.c`` where setup.py
  could build them (:data:`C_KERNELS`): gathered up to :data:`CPU_BATCH_ELEMENTS` elements (a
  bigger one on its own, at once) and reduced in one call, without a copy, in one pass a tensor
  for the statistics and one for the histogram;
- otherwise, and for float64, with torch ops: small gradients are gathered and reduced together,
  a batch at a time, with a fixed number of ops per batch (segment reductions over rows, one
  scatter for all their histograms); big ones are reduced on their own in four passes (minimum
  and maximum, sum, row norms, non-zero count), the finite check read from the minimum and
  maximum, and their histogram in three more (shift and scale, convert to int8, count pairs of
  neighbours);
- on accelerators every gradient up to :data:`DEVICE_BATCH_ELEMENTS` elements joins a batch,
  because there the launch count, not the bytes, is what costs (a batch holds at most that many
  elements of gradients and their copy).

The device holds seven *moments* per tensor (finite count, mean, sum of squares and sum of the
values centred on a point near the mean, finite minimum and maximum, zero count);
:func:`finish_rows` turns them into :data:`STATISTICS` on the host, for all tensors at once.
Every statistic is over the *finite* elements only, and ``nonfinite`` counts the others, so that
one NaN does not hide the shape of the rest of the gradient.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

try:
    from . import _kernels  # built by setup.py where a C compiler is found
except ImportError:
    _kernels = None

#: Whether the C kernels of ``_kernels.c`` were built (setup.py builds them where it finds a C
#: compiler). Without them, float32 CPU gradients are reduced with torch ops: the same values,
#: slower (on ResNet-18 the cost of an armed step about doubles: docs/benchmarks.md).
C_KERNELS = _kernels is not None

#: Names of the statistics, in the order of a statistics row.
#: ``norm`` (L2), ``mean``, ``std`` (unbiased, 0 for fewer than two finite elements),
#: ``absmax``, ``nonfinite`` (count of NaN/Inf elements), ``zero_fraction`` (share of all
#: elements that are exactly zero: dead ReLUs, unused embedding rows).
Statistic = Literal["norm", "mean", "std", "absmax", "nonfinite", "zero_fraction"]
STATISTICS: tuple[str, ...] = get_args(Statistic)

# Behind the public statistics a row holds the finite count and the finite minimum and maximum
# (the histogram range), used for pooling and histograms.
_NONFINITE = STATISTICS.index("nonfinite")
_ZERO_FRACTION = STATISTICS.index("zero_fraction")
_COUNT, _LOW, _HIGH = len(STATISTICS), len(STATISTICS) + 1, len(STATISTICS) + 2
STATS_WIDTH = len(STATISTICS) + 3

#: Moments per tensor on the device: finite count, mean, the sum of squares and the sum of the
#: values centred on (nearly) the mean, finite minimum and maximum, count of exact zeros.
MOMENTS = 7

#: On the CPU, without the C kernels, gradients of at most this many elements are batched; bigger
#: ones are reduced alone.
CPU_BATCH_TENSOR = 1 << 15
#: On accelerators, gradients of at most this many elements are batched, and a batch is reduced
#: once it holds this many (64 MiB of float32: fewer, bigger batches launch fewer kernels).
DEVICE_BATCH_ELEMENTS = 1 << 24
#: On the CPU, a batch is reduced once it holds this many elements.
CPU_BATCH_ELEMENTS = 1 << 20
#: Width of the rows a batch is laid out in: every tensor starts a row, its last row is padded.
ROW = 1024


def _width(n: int) -> int:
    """The row width of a CPU batch for a tensor of ``n`` elements: :data:`ROW`, or for a smaller
    tensor the power of two that holds it, so that a 64-element bias is not padded to 1024."""
    return ROW if n >= ROW else 1 << max(n - 1, 0).bit_length()


_branch_free = False
_use_kernels = True


@contextlib.contextmanager
def branch_free() -> Iterator[None]:
    """Reduce CPU tensors as accelerator tensors are reduced: batched, no host reads.

    For tests and benchmarks: this is how the op count of the accelerator path is measured on a
    machine without one.
    """
    global _branch_free
    previous, _branch_free = _branch_free, True
    try:
        yield
    finally:
        _branch_free = previous


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """Reduce CPU tensors with torch ops even where the C kernels of ``_kernels.c`` were built.

    For tests and benchmarks, which compare the two paths.
    """
    global _use_kernels
    previous, _use_kernels = _use_kernels, False
    try:
        yield
    finally:
        _use_kernels = previous


def _as_float(tensor: Tensor) -> Tensor:
    """Detached, dense, in float32 or float64; not flattened (the C kernels read any dense tensor,
    and a reshape costs a microsecond a tensor: :func:`_flat` flattens for the torch paths).

    A sparse gradient (``nn.Embedding(sparse=True)``) is made dense: its statistics are those of
    the whole tensor, implicit zeros included, at the cost of a dense copy while it is reduced.
    """
    x = tensor.detach() if tensor.requires_grad else tensor
    if x.layout != torch.strided:
        x = x.to_dense()
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _dense(x: Tensor) -> bool:
    """Whether ``x`` fills ``numel`` elements from its data pointer on: contiguous, or channels-last
    (statistics and histograms do not depend on the order of the elements)."""
    return (
        x.is_contiguous()
        or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
        or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))
    )


def _flat(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.reshape(-1) for t in tensors]


def _shrunk(bins: int) -> float:
    """Scale so that the maximum lands just inside the last bin: no clamp pass is needed."""
    return bins * (1 - 1e-6)


#: CPU scratch buffers of at most this many elements outlive a logged step (see :class:`Scratch`).
SCRATCH_KEPT = 1 << 22


class Scratch:
    """Buffers that the CPU reductions write their big temporaries (and batches) into.

    A fresh buffer of megabytes costs a page fault per 4 KiB on its first write, often more
    than the arithmetic; reused, it costs nothing. A buffer grows to the largest tensor that
    needs it. :meth:`trim`, at the end of each step, drops those bigger than
    :data:`SCRATCH_KEPT` elements, so what is kept between logged steps is bounded (a few tens
    of MiB at most), whatever the model.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        buffer = self._buffers.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name, dtype] = torch.empty(numel, dtype=dtype)
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
    """Tensors waiting to be reduced together, their positions in the order added, their size."""

    tensors: list[Tensor] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    elements: int = 0


class Reducer:
    """Reduces the gradients of one step on one device: statistics, and histograms where asked.

    Args:
        bins: histogram bins.
        scratch: where CPU reductions write their temporaries; pass the same one every step
            to reuse its buffers (by default each reducer has its own).

    Call :meth:`add` for every tensor, then :meth:`finish` once: it reads everything to the
    host in one transfer.
    """

    def __init__(self, bins: int, scratch: Scratch | None = None) -> None:
        self.bins = bins
        # Reduced blocks: (moments (k, MOMENTS), counts (k, bins) or None, positions of the k
        # tensors in the order added); the open batches (on the CPU, by histogram or not, since
        # a histogram costs more than the statistics, and by row width, so that small tensors
        # are padded at most to twice their size; on accelerators one: launches cost more);
        # what was added.
        self._blocks: list[tuple[Tensor, Tensor | None, list[int]]] = []
        self._open: dict[tuple[bool, int], _Batch] = {}
        self._numels: list[int] = []
        self._histogram: list[bool] = []
        self._scratch = Scratch() if scratch is None else scratch
        self._cpu: bool | None = None  # the device's kind, from the first tensor added

    def add(self, tensor: Tensor, histogram: bool) -> None:
        """Reduce ``tensor`` (of this reducer's device) now if it is big, else join a batch."""
        x = _as_float(tensor)
        n = x.numel()
        position = len(self._numels)
        self._numels.append(n)
        self._histogram.append(histogram)
        if self._cpu is None:
            self._cpu = x.is_cpu
        bins = self.bins if histogram else None
        if _branch_free or not self._cpu:
            key, capacity = (True, ROW), DEVICE_BATCH_ELEMENTS
        elif _use_kernels and _kernels is not None and x.dtype == torch.float32:
            if not _dense(x):  # an expanded gradient (of a sum): the kernels read dense ones
                x = x.contiguous()
            if n > CPU_BATCH_ELEMENTS:
                self._blocks.append((*_reduce_with_kernels([x], bins), [position]))
                return
            key, capacity = (histogram, 0), CPU_BATCH_ELEMENTS  # width 0: no rows, no copy
        elif n > CPU_BATCH_TENSOR:
            self._blocks.append((*_reduce_alone_on_cpu(x.reshape(-1), bins, self._scratch), [position]))
            return
        elif n == 0:  # an empty output: the CPU batch pads with a tensor's first element
            self._blocks.append((*reduce_batch([x.reshape(-1)], bins), [position]))
            return
        else:
            key, capacity = (histogram, _width(n)), CPU_BATCH_ELEMENTS
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch()
        elif batch.elements + n > capacity:
            self._flush(key)
            batch = self._open[key] = _Batch()
        batch.tensors.append(x)
        batch.positions.append(position)
        batch.elements += n

    def _flush(self, key: tuple[bool, int]) -> None:
        batch = self._open.pop(key)
        bins = self.bins if any(self._histogram[p] for p in batch.positions) else None
        if _branch_free or not self._cpu:
            moments, counts = reduce_batch(_flat(batch.tensors), bins)
        elif key[1] == 0:
            moments, counts = _reduce_with_kernels(batch.tensors, bins)
        else:
            moments, counts = _reduce_on_cpu(_flat(batch.tensors), bins, self._scratch, key[1])
        self._blocks.append((moments, counts, batch.positions))

    def finish(self) -> list[tuple[list[float], list[float] | None]]:
        """The statistics row and histogram counts (or None) of each tensor, in the order added."""
        for key in list(self._open):
            self._flush(key)
        blocks, numels, wanted = self._blocks, self._numels, self._histogram
        self.__init__(self.bins, self._scratch)
        self._scratch.trim()
        if not blocks:
            return []
        parts = [m.reshape(-1) for m, _, _ in blocks] + [c.reshape(-1) for _, c, _ in blocks if c is not None]
        host = torch.cat(parts).to("cpu", torch.float64)  # the one transfer
        positions = [p for _, _, block in blocks for p in block]
        k = len(positions)
        rows = finish_rows(host[: k * MOMENTS].view(k, MOMENTS), torch.tensor([numels[p] for p in positions], dtype=torch.float64))
        rows = iter(rows.tolist())
        # The counts of each tensor that has them, as lists (tolist is slow on a view that starts
        # inside its storage: hence the clone).
        counts = iter(host[k * MOMENTS :].clone().view(-1, self.bins).tolist())
        results: list[tuple[list[float], list[float] | None]] = [([], None)] * len(numels)
        for _, block_counts, block in blocks:
            for p in block:
                hist = None if block_counts is None else next(counts)
                results[p] = (next(rows), hist if wanted[p] else None)
        return results


def _reduce_alone_on_cpu(x: Tensor, bins: int | None, scratch: Scratch) -> tuple[Tensor, Tensor | None]:
    """Moments (and histogram) of one big flat CPU tensor with torch ops, in as few passes as they allow.

    One read of ``aminmax``, the sum, the row norms and the count of non-zeros: NaN and Inf show
    in the minimum and maximum, and only then does the tensor take the masked path of
    :func:`reduce_batch`. The sums are not centred (no copy): a tensor whose mean is far from
    zero against its spread (rare for gradients) is centred on its mean and summed again.
    """
    n = x.numel()
    whole = n - n % ROW
    head = x[:whole].view(-1, ROW)
    # Non-zeros as 1.0 summed by rows, exactly: count_nonzero branches on every element, and
    # a gradient with random zeros (ReLU) makes it ten times slower.
    ones = torch.ne(head, 0, out=scratch.get("float", whole, x.dtype).view(-1, ROW))
    per_row = torch.stack([torch.linalg.vector_norm(head, dim=1), ones.sum(1)], 1).to(torch.float64)
    per_row[:, 0].square_()
    squares, nonzero = per_row.sum(0)
    if whole < n:
        tail = x[whole:].to(torch.float64)
        squares, nonzero = squares + tail.square().sum(), nonzero + torch.count_nonzero(tail)
    low, high = torch.aminmax(x)
    lo, hi, total, squares, nonzero = torch.stack(
        [low.double(), high.double(), x.sum().double(), squares, nonzero.double()]
    ).tolist()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return reduce_batch([x], bins)
    centre = 0.0
    if 0 < squares and squares - total * total / n <= 0.1 * squares:  # the mean is far from 0
        centre = total / n
        squares, total = _centred_sums(x, centre)
    moments = torch.tensor([[n, centre + total / n, squares, total, lo, hi, n - nonzero]], dtype=torch.float64)
    if bins is None:
        return moments, None
    # The factors of _bin_scale, as Python floats: no tensor ops for one scalar.
    scale = _shrunk(bins) / (hi - lo) if hi > lo else 0.0
    step = 2.0**64 if scale > torch.finfo(x.dtype).max / 2.0**64 else 1.0
    index = torch.sub(x, lo, out=scratch.get("float", n, x.dtype))
    if step != 1:
        index.mul_(step)
    index.mul_(scale / step)
    counts = _count(scratch.get("index", n, _index_dtype(bins)).copy_(index), bins)
    return moments, counts.view(1, bins)


def _reduce_with_kernels(tensors: Sequence[Tensor], bins: int | None) -> tuple[Tensor, Tensor | None]:
    """:func:`reduce_batch` for dense float32 CPU tensors, in one call of the C kernels of
    ``_kernels.c``: no copy, one pass a tensor for its moments (sums centred on its first
    element, as in :func:`_reduce_on_cpu`; a second pass, centred on the mean, where that lies
    far out) and one for its histogram, the bins computed in float32 as torch computes them. A
    call that meets NaN or Inf (or a square beyond float32) is done again by the masked path of
    :func:`reduce_batch`, which tells which elements were not finite."""
    m = len(tensors)
    moments = torch.empty(m, MOMENTS, dtype=torch.float64)
    counts = None if bins is None else torch.empty(m, bins, dtype=torch.float64)
    flagged = _kernels.reduce_many(
        [t.data_ptr() for t in tensors],
        [t.numel() for t in tensors],
        bins or 0,
        moments.data_ptr(),
        0 if counts is None else counts.data_ptr(),
    )
    if flagged:
        return reduce_batch(_flat(tensors), bins)
    return moments, counts


def _reduce_on_cpu(
    tensors: Sequence[Tensor], bins: int | None, scratch: Scratch, width: int = ROW
) -> tuple[Tensor, Tensor | None]:
    """:func:`reduce_batch` for CPU tensors, in a few plain passes when every value is finite.

    The tensors are laid out in rows of ``width`` elements (each tensor on rows of its own).

    On the CPU, reading a reduced value is not a device synchronisation, so the code can
    branch: rows are padded with copies of their tensor's first element instead of NaN, which
    leaves minima and maxima alone, adds nothing to sums centred on that element and is taken
    out of the histogram exactly, so no pass has to mask. A batch holding NaN or Inf goes
    through :func:`reduce_batch`; a tensor whose first element lies far from its mean is
    centred again on the mean.
    """
    row_of, pads, firsts = _layout(tuple(t.numel() for t in tensors), torch.device("cpu"), width)
    if len(tensors) == 1 and not pads[0]:
        x = tensors[0].view(-1, width)
    else:
        pieces = [p for t, pad in zip(tensors, pads) for p in ((t, t[:1].expand(pad)) if pad else (t,))]
        dtype = functools.reduce(torch.promote_types, {t.dtype for t in tensors})
        x = torch.cat(pieces, out=scratch.get("batch", len(row_of) * width, dtype)).view(-1, width)
    m = len(tensors)
    work = scratch.get("float", x.numel(), x.dtype).view(-1, width)
    low = torch.full((m,), math.inf, dtype=x.dtype).scatter_reduce_(0, row_of, x.amin(1), "amin")
    high = torch.full((m,), -math.inf, dtype=x.dtype).scatter_reduce_(0, row_of, x.amax(1), "amax")
    if not torch.stack([low, high]).isfinite().all():
        return reduce_batch(tensors, bins)
    first = x.view(-1)[firsts]  # centred on each tensor's first element, the padding adds nothing
    shifted = torch.sub(x, first[row_of, None], out=work)
    per_row = [torch.linalg.vector_norm(shifted, dim=1), shifted.sum(1)]
    per_row.append(torch.ne(x, 0, out=work).sum(1))  # exact: at most `width` non-zeros per row
    per_row = torch.stack(per_row, 1).to(torch.float64)
    per_row[:, 0].square_()
    squares, offset, nonzero = torch.zeros(m, 3, dtype=torch.float64).index_add_(0, row_of, per_row).unbind(1)
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.float64)
    centre = first.to(torch.float64)
    zeros = numel - nonzero + torch.tensor(pads, dtype=torch.float64) * (centre != 0)
    far = (squares > 0) & (squares - offset * offset / numel <= 0.1 * squares)
    for k in far.nonzero().view(-1).tolist():  # the first element is far out: centre on the mean
        centre[k] += offset[k] / numel[k]
        squares[k], offset[k] = _centred_sums(tensors[k], centre[k].item())
    moments = torch.stack([numel, centre + offset / numel, squares, offset, low.double(), high.double(), zeros], 1)
    if bins is None:
        return moments, None
    span = (high.double() - low.double())[row_of, None]
    index = _to_bins(torch.sub(x, low[row_of, None], out=work), span, bins)
    if m == 1:
        index = scratch.get("index", x.numel(), _index_dtype(bins + 1)).copy_(index.view(-1))
        counts = _count(index, bins + 1)
    else:  # int16 where it holds every tensor's bins: fewer bytes for bincount to read
        kind = torch.int16 if m * (bins + 1) <= torch.iinfo(torch.int16).max else torch.int32
        index = scratch.get("index", x.numel(), kind).view(-1, width).copy_(index)
        index = index.add_((row_of[:, None] * (bins + 1)).to(kind)).view(-1)
        counts = torch.bincount(index, minlength=m * (bins + 1)).to(torch.float64)
    # The padding copies the first element of its tensor: take it out of that element's bin.
    if any(pads):
        counts.index_add_(0, index[firsts].int(), -torch.tensor(pads, dtype=torch.float64))
    return moments, counts.view(m, bins + 1)[:, :bins]


def _index_dtype(bins: int) -> torch.dtype:
    """The dtype of a histogram index: int8 up to 128 bins, else int16 (at most 4096 bins).

    Converting float32 to int8 or int16 is vectorised; to uint8 it is not (four times slower).
    """
    return torch.int8 if bins <= 128 else torch.int16


def _count(index: Tensor, bins: int) -> Tensor:
    """``bincount`` of a flat index in ``[0, bins)`` (of :func:`_index_dtype`), as float64.

    An int8 index is counted by pairs: viewed as int16, each pair of neighbours is one number
    ``first + 256 * second`` (little-endian), below 32768, so one ``bincount`` over half as many
    elements fills a ``bins x 256`` table whose row and column sums are the histogram.
    ``bincount`` costs a counter update per element, and it is the slowest step of a histogram:
    by pairs it runs ~1.7x faster, also when neighbours share a bin (ReLU zeros, a vanishing
    layer), where updates of one counter wait on each other.
    """
    n = index.numel()
    if index.dtype != torch.int8 or n < 2 or sys.byteorder != "little":
        return torch.bincount(index, minlength=bins)[:bins].to(torch.float64)
    whole = n - n % 2
    table = torch.bincount(index[:whole].view(torch.int16), minlength=256 * bins).view(bins, 256)[:, :bins]
    counts = table.sum(0).add_(table.sum(1))
    if whole < n:
        counts[index[-1].item()] += 1
    return counts.to(torch.float64)


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
    scale = (_shrunk(bins) / span).nan_to_num_(0.0, 0.0, 0.0)  # a span of 0 (or -inf: nothing finite)
    step = torch.where(scale > torch.finfo(dtype).max / 2.0**64, 2.0**64, 1.0)
    return torch.stack([step.to(torch.float64), scale / step]).to(dtype)


def _to_bins(shifted: Tensor, span: Tensor, bins: int) -> Tensor:
    """:func:`_bin_scale` applied in place; the exact first step only where it is needed."""
    step, scale = _bin_scale(span, bins, shifted.dtype)
    if (step != 1).any():
        shifted.mul_(step)
    return shifted.mul_(scale)


def _centred_sums(x: Tensor, centre: float) -> tuple[float, float]:
    """The sum of squares and the sum of ``x - centre``: the moments of a tensor whose mean lies
    far from the point its sums were first centred on."""
    centred = torch.sub(x, centre)
    return _squares(centred), centred.sum().item()


def _squares(x: Tensor) -> float:
    """The sum of squares of a flat tensor, accurate to float64 rounding of float32 row norms."""
    whole = x.numel() - x.numel() % ROW
    head = torch.linalg.vector_norm(x[:whole].view(-1, ROW), dim=1).to(torch.float64).square().sum().item()
    return head + x[whole:].to(torch.float64).square().sum().item()


@functools.lru_cache(maxsize=256)
def _layout(lengths: tuple[int, ...], device: torch.device, width: int = ROW) -> tuple[Tensor, list[int], Tensor]:
    """Rows of a batch: the tensor each row belongs to, each tensor's padding, its first element.

    Tensor ``k`` fills ``ceil(n_k / width)`` rows, the last one padded to ``width`` elements.
    Built once per layout (a model gives the same layouts every logged step) and copied to the
    device once.
    """
    rows = torch.tensor([max(1, -(-n // width)) for n in lengths])
    row_of = torch.repeat_interleave(torch.arange(len(lengths)), rows)
    firsts = (rows.cumsum(0) - rows) * width
    if device.type == "cuda":
        row_of, firsts = row_of.pin_memory(), firsts.pin_memory()
    pads = [r * width - n for r, n in zip(rows.tolist(), lengths)]
    return row_of.to(device, non_blocking=True), pads, firsts.to(device, non_blocking=True)


@functools.lru_cache(maxsize=8)
def _padding(device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.full((ROW,), math.nan, dtype=dtype, device=device)


def reduce_batch(tensors: Sequence[Tensor], bins: int | None) -> tuple[Tensor, Tensor | None]:
    """Moments (and histograms) of many flat float tensors on one device, in a fixed number of ops.

    One ``cat`` lays the tensors out in rows of :data:`ROW` elements, each tensor on rows of its
    own, padded with NaN. Every statistic is a row reduction (summed in float64) followed by one
    ``index_add`` of the few rows of each tensor; the spread is a second pass, centred on the
    mean. All histograms are one count over ``tensor * (bins + 1) + bin``.

    Returns:
        ``(moments, counts)``: float64 tensors of shape ``(len(tensors), MOMENTS)`` and
        ``(len(tensors), bins)`` (None without ``bins``).
    """
    device, dtype = tensors[0].device, functools.reduce(torch.promote_types, {t.dtype for t in tensors})
    row_of, pads, _ = _layout(tuple(t.numel() for t in tensors), device)
    nan = _padding(device, dtype)
    x = torch.cat([piece for t, pad in zip(tensors, pads) for piece in ((t, nan[:pad]) if pad else (t,))]).view(-1, ROW)
    m = len(tensors)
    finite = x.abs() < math.inf  # False for NaN, padding included
    zeroed = x.nan_to_num(0.0, 0.0, 0.0)
    # exact over a row; the NaN padding is never zero
    per_row = torch.stack([finite.sum(1), zeroed.sum(1), (x == 0).sum(1)], 1).to(torch.float64)
    count, total, zeros = torch.zeros(m, 3, dtype=torch.float64, device=device).index_add_(0, row_of, per_row).unbind(1)
    mean = total / count.clamp(min=1)
    # Centred on the mean rounded to the data's precision; the offset this rounding leaves is
    # summed too and taken out on the host (the corrected two-pass formula).
    centred = (zeroed - mean.to(dtype)[row_of, None]).mul_(finite)
    per_row = torch.stack([torch.linalg.vector_norm(centred, dim=1), centred.sum(1)], 1).to(torch.float64)
    per_row[:, 0].square_()
    squares = torch.zeros(m, 2, dtype=torch.float64, device=device).index_add_(0, row_of, per_row)
    low = torch.full((m,), math.inf, dtype=dtype, device=device)
    low.scatter_reduce_(0, row_of, x.nan_to_num(math.inf, math.inf, math.inf).amin(1), "amin")
    high = torch.full((m,), -math.inf, dtype=dtype, device=device)
    high.scatter_reduce_(0, row_of, x.nan_to_num(-math.inf, -math.inf, -math.inf).amax(1), "amax")
    moments = torch.stack([count, mean, *squares.unbind(1), low, high, zeros], 1)
    if bins is None:
        return moments, None
    # (x - low) / span lies in [0, 1] however tiny the span (denormal gradients of a deep
    # stack), so the shrunk scale keeps every finite element below `bins`; non-finite ones and
    # the padding land in the extra bin `bins` of their tensor.
    scale = _bin_scale(high.double() - low.double(), bins, dtype)
    index = (x - low[row_of, None]).mul_(scale[0, row_of, None]).mul_(scale[1, row_of, None]).nan_to_num_(bins, bins, bins)
    index = index.to(torch.int32).add_((row_of[:, None] * (bins + 1)).to(torch.int32)).view(-1)
    if device.type == "cpu":
        counts = torch.bincount(index, minlength=m * (bins + 1)).to(torch.float64)
    else:  # bincount would read its maximum to the host
        ones = torch.ones(1, dtype=torch.float64, device=device).expand(index.numel())
        counts = torch.zeros(m * (bins + 1), dtype=torch.float64, device=device).index_add_(0, index, ones)
    return moments, counts.view(m, bins + 1)[:, :bins]


def finish_rows(moments: Tensor, numels: Tensor) -> Tensor:
    """Statistics rows (:data:`STATISTICS`, count, low, high) from moments, for many tensors at once.

    Args:
        moments: float64, shape ``(k, MOMENTS)``, as :class:`Reducer` lays them out.
        numels: float64, the element count of each tensor.

    Returns:
        float64, shape ``(k, STATS_WIDTH)``.
    """
    count, mean, squares, offset, low, high, zeros = moments.unbind(1)
    empty = count == 0  # no finite element: every moment is 0
    mean, squares, offset, low, high = (v.masked_fill(empty, 0.0) for v in (mean, squares, offset, low, high))
    spread = (squares - offset * offset / count.clamp(min=1)).clamp_(min=0.0)  # >= 0 despite rounding
    std = (spread / (count - 1)).sqrt_().masked_fill_(count <= 1, 0.0)
    norm = (spread + count * mean * mean).sqrt_()
    zero_fraction = (zeros / numels).masked_fill_(numels == 0, 0.0)
    absmax = torch.maximum(low.abs(), high.abs())
    return torch.stack([norm, mean, std, absmax, numels - count, zero_fraction, count, low, high], 1)


def reduce(tensors: Sequence[Tensor], bins: int | None = None) -> list[tuple[list[float], list[float] | None]]:
    """Statistics rows (and histogram counts) of each tensor, read to the host at once.

    Example:
        >>> (row, counts), = reduce([torch.tensor([3.0, -4.0, float("nan")])], bins=2)
        >>> [round(v, 4) for v in row[:5]], counts
        ([5.0, -0.5, 4.9497, 4.0, 1.0], [1.0, 1.0])
    """
    reducer = Reducer(bins or 1)
    for t in tensors:
        reducer.add(t, bins is not None)
    return reducer.finish()


def histogram_edges(low: float, high: float, bins: int) -> list[float]:
    """Right edges of the ``bins`` equal bins that the histograms count into."""
    width = (high - low) if high > low else 1.0
    return [low + width * (i + 1) / bins for i in range(bins)]


# -- pooling, on the host ------------------------------------------------------------------
# A module called several times in one step, the micro-batches of one accumulated step and
# the ranks of a data-parallel job each give several statistics rows for one name. They are
# pooled as if the gradients had been concatenated into one tensor.


def pool_stats(rows: Sequence[Sequence[float]]) -> list[float]:
    """Combine statistics rows into the row of the concatenated tensors.

    ``norm`` is the root of the summed squares, ``mean`` and ``std`` are over all finite
    elements (the variances combine exactly, by Chan's formula), ``absmax`` and the range are
    the extremes, ``nonfinite`` is summed and ``zero_fraction`` is weighted by element counts.

    Example:
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
        >>> pooled = pool_stats([row for row, _ in reduce([a, b])])
        >>> torch.allclose(torch.tensor(pooled), torch.tensor(reduce([torch.cat([a, b])])[0][0]))
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
        sum(r[_ZERO_FRACTION] * (r[_COUNT] + r[_NONFINITE]) for r in rows) / max(count + sum(r[_NONFINITE] for r in rows), 1),
        count,
        low,
        high,
    ]


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
