"""What the monitor hands back: :class:`GradientRecord`, :class:`GradientEntry`, :class:`Histogram`,
and the one shape a step's statistics take on their way to the writers, the report and the CLI.

A record's entries hold their statistics as a :class:`~lightning_gradhooks.summary.statistics.StatsRow`.
:func:`step_summary` turns a step into its *summary*, ``{Key: {statistic: value}}``: what every
logged step writes to TensorBoard (``gradhooks/stats``), what the health report judges and what the
``report`` command reads back. A :class:`Key` names an entry by :class:`Kind`, name and, with
several optimizers, the optimizer's index.

Also where rows of statistics become entries: several gradients of one name (a module called
several times, accumulated micro-batches, the ranks of a data-parallel job) are pooled into
one entry, as if they were one concatenated tensor.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from lightning_gradhooks.summary.noise import NoiseSample
from lightning_gradhooks.summary.statistics import SCALE_FREE, STATISTICS, StatsRow, merge_histograms, pool_stats, row_of


class Kind(enum.StrEnum):
    """What an entry of a step describes. Str-valued: a kind is written as its value in tags and
    in the summary (``"grad_output"``), and compares equal to it."""

    #: The gradient a module's output receives.
    GRAD_OUTPUT = "grad_output"
    #: The gradient a module sends to its inputs.
    GRAD_INPUT = "grad_input"
    #: A parameter's gradient.
    PARAM_GRAD = "param_grad"
    #: The forward checks (not gradients): a module's output, its inputs, and the weights when
    #: the step began; only their ``nonfinite`` count means something.
    FORWARD = "forward"
    FORWARD_INPUT = "forward_input"
    WEIGHTS = "weights"
    #: The forward statistics (``GradientMonitor(activations=True)``): a module's output as its
    #: forward made it, one entry per tensor; the summary adds ``rms`` and ``outlier``
    #: (absmax over RMS) to its statistics.
    OUTPUT = "output"
    #: The maximum attention logit of the attention calls a module made
    #: (``GradientMonitor(attention_logits=True)``): the statistics of its per-head maxima (one
    #: value for calls without heads); the summary's ``max`` is the maximum over every head,
    #: query and key, as the softmax saw it.
    ATTENTION_LOGIT = "attention_logit"
    #: In the summary only: the optimizer step of a parameter (``update_ratio``, ``param_norm``,
    #: ``in_optimizer``).
    PARAM = "param"
    #: In the summary only: a parameter whose non-finite gradient the sentinel caught.
    CAUGHT = "caught"
    #: In the summary only: the gradient noise scale's raw estimates.
    NOISE = "noise"
    #: In the summary only: under data parallelism, the ranks whose own gradients were not
    #: finite before the all-reduce (``nonfinite_ranks``, ``first_rank``, ``own``).
    RANKS = "ranks"
    #: In the summary only: the relative precision (``eps``) of the gradients the hooks see,
    #: when not float32's (autocast to bfloat16 or float16): what round-off means.
    PRECISION = "precision"
    #: In the summary only: the gradient scaler at a logged step: ``scale`` (what its loss was
    #: multiplied by) and ``new_scale`` (after ``scaler.update()``: lower when the scaler found
    #: non-finite gradients and skipped the optimizer step).
    SCALER = "scaler"
    #: In the summary only: a gradient spike at an optimizer step (``GradHooks(spikes=True)``):
    #: ``total`` (the step's norm, the median it is measured against, their ratio, the window)
    #: and the modules carrying most of it (their share of the rise, their own ratio).
    SPIKE = "spike"


#: The kinds that are gradients, in the order of the docs.
GRADIENT_KINDS = (Kind.GRAD_OUTPUT, Kind.GRAD_INPUT, Kind.PARAM_GRAD)
#: The kinds of the monitor's forward checks.
FORWARD_KINDS = (Kind.FORWARD, Kind.FORWARD_INPUT, Kind.WEIGHTS)
#: The kinds of the forward statistics.
ACTIVATION_KINDS = (Kind.OUTPUT, Kind.ATTENTION_LOGIT)

#: A row's chartable statistics, read by name.
_charted = operator.attrgetter(*STATISTICS)

#: Per field of a row, whether a loss scale multiplies it.
_SCALED = tuple(name not in SCALE_FREE for name in StatsRow._fields)

#: Where a name of an optimizer's entries is written beside the others' (tags, the summary).
_OPTIMIZER = "optimizer_{}/"


class Key(NamedTuple):
    """An entry of a step: its kind, its name, and the index of the optimizer it was logged for
    (None: the only one, or all of them)."""

    kind: str
    name: str
    optimizer: int | None = None

    @property
    def label(self) -> str:
        """The name as tags and the summary write it: ``optimizer_<i>/<name>`` with an optimizer."""
        return self.name if self.optimizer is None else _OPTIMIZER.format(self.optimizer) + self.name

    @property
    def module(self) -> str:
        """The module the entry belongs to: ``grad_output lstm/0`` -> ``lstm``, ``param_grad
        net.2.bias`` -> ``net.2``; with an optimizer, ``optimizer_<i>/`` before it."""
        if self.kind in (Kind.PARAM_GRAD, Kind.PARAM, Kind.CAUGHT):
            module = self.name.rpartition(".")[0] or "(model)"
        else:
            module = self.name.split("/")[0]
        return module if self.optimizer is None else _OPTIMIZER.format(self.optimizer) + module

    @classmethod
    def of_label(cls, kind: str, label: str) -> Key:
        """The key of a name as written (:attr:`label`): what the ``report`` command reads."""
        prefix, slash, rest = label.partition("/")
        index = prefix.removeprefix("optimizer_")
        if slash and index != prefix and index.isdigit():
            return cls(kind, rest, int(index))
        return cls(kind, label)


#: One step's statistics: ``{Key: {statistic: value}}``, in record order (see :func:`step_summary`).
Summary = dict[Key, dict[str, float]]


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
        kind: a :class:`Kind`: ``grad_output``, ``grad_input`` or ``param_grad`` (and the forward
            checks' ``forward``, ``forward_input``, ``weights``; the forward statistics' ``output``
            and ``attention_logit``).
        name: the module's qualified name, or the parameter's. A module with several output
            (or input) tensors gives one entry per tensor, named by its position or key in the
            structure: ``"lstm/0"``, ``"lstm/1/0"``, ``"gpt/logits"``.
        stats: the statistics (:class:`~lightning_gradhooks.summary.statistics.StatsRow`: ``stats.norm``,
            ``stats.count``, ...), over the finite elements.
        histogram: present for ``grad_output`` and ``param_grad`` when histograms are on.
        calls: how many gradients were pooled into this entry. A module called several times
            in one step (weight sharing, a cell in a loop), or in each micro-batch of an
            accumulated step, gives one entry whose statistics and histogram are those of
            all its gradients taken together, as if concatenated into one tensor.
        optimizer: with several optimizers, the index of the one the step was logged for
            (:meth:`GradientLog.write`'s ``optimizer``); None otherwise.
    """

    kind: Kind
    name: str
    stats: StatsRow
    histogram: Histogram | None = None
    calls: int = 1
    optimizer: int | None = None

    @property
    def count(self) -> int:
        """The number of finite elements the statistics were computed over."""
        return int(self.stats.count)

    @property
    def key(self) -> Key:
        return Key(self.kind, self.name, self.optimizer)


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
            (:class:`~lightning_gradhooks.summary.noise.NoiseSample`); None when not measured.
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

        ``norm``, ``mean``, ``std``, ``absmax`` and the range (``low``, ``high``, the histogram's)
        scale with the gradient; ``nonfinite``, ``zero_fraction``, ``count`` and the bin counts
        do not.
        """
        kinds = (*GRADIENT_KINDS,) if parameters else (Kind.GRAD_OUTPUT, Kind.GRAD_INPUT)
        entries = []
        for e in self.entries:
            if e.kind in kinds:
                stats = row_of([v / scale if scaled else v for v, scaled in zip(e.stats, _SCALED)])
                hist = e.histogram and Histogram(e.histogram.low / scale, e.histogram.high / scale, e.histogram.counts)
                e = replace(e, stats=stats, histogram=hist)
            entries.append(e)
        record = self.with_entries(entries)
        if record.noise is not None:  # its small-batch gradient is seen by hooks, scaled
            record.noise = record.noise.unscaled(scale, parameters)
        return record

    def for_optimizer(self, index: int) -> GradientRecord:
        """A copy whose entries say they were logged for optimizer ``index`` (:attr:`GradientEntry.optimizer`)."""
        return self.with_entries([replace(e, optimizer=index) for e in self.entries])

    @property
    def first_nonfinite(self) -> GradientEntry | None:
        """The first entry, in backward order, whose gradient holds NaN or Inf values."""
        return next((e for e in self.entries if e.stats.nonfinite > 0), None)


def step_summary(
    record: GradientRecord | None = None,
    *,
    optimizer: int | None = None,
    unowned: Iterable[str] = (),
    updates: Mapping[str, tuple[float, ...]] | None = None,
    caught: Sequence[str] = (),
    checked: int = 0,
    noise: Mapping[str, float] | None = None,
    ranks: Mapping[str, float] | None = None,
    scaler: tuple[float, float] | None = None,
) -> Summary:
    """The summary of (what is known of) one step: every statistic of every entry of ``record``
    (with ``calls`` where an entry pools several gradients), and what the log learns beside it.

    Args:
        record: the monitor's record of the step.
        optimizer: the optimizer index of the names below (``record``'s entries carry their own).
        unowned: parameters that get a gradient but that no optimizer holds (``in_optimizer`` 0).
        updates: the optimizer step's ``{parameter: (update_ratio, param_norm)}``, or
            :class:`~lightning_gradhooks.log.updates.Update` with its param group, the group's
            learning rate and whether it had a gradient (``no_gradient`` 1 when not).
        caught: parameters whose non-finite gradient the sentinel caught, of ``checked``.
        noise: the noise scale's raw estimates (:meth:`NoiseSample.stats`).
        ranks: which ranks' own gradients were not finite before the all-reduce.
        scaler: a gradient scaler's ``(scale, new_scale)`` at the step (:attr:`Kind.SCALER`).

    Example:
        >>> step_summary(updates={"net.0.weight": (0.01, 2.0)}, optimizer=1)
        {Key(kind=<Kind.PARAM: 'param'>, name='net.0.weight', optimizer=1): {'update_ratio': 0.01, 'param_norm': 2.0}}
    """
    summary: Summary = {}
    for e in record.entries if record is not None else ():
        values = dict(zip(STATISTICS, _charted(e.stats)))
        if e.kind in ACTIVATION_KINDS:
            values.update(forward_values(e.kind, e.stats))
        if e.calls > 1:
            values["calls"] = e.calls
        summary[e.key] = values
    for name in unowned:
        summary[Key(Kind.PARAM, name, optimizer)] = {"in_optimizer": 0.0}
    for name, (ratio, norm, *facts) in (updates or {}).items():
        values = {"update_ratio": ratio, "param_norm": norm}
        if facts:
            group, lr, gradient = facts
            values.update(group=float(group), lr=lr)
            if not gradient:
                values["no_gradient"] = 1.0
        summary[Key(Kind.PARAM, name, optimizer)] = values
    for name in caught:
        summary[Key(Kind.CAUGHT, name, optimizer)] = {"nonfinite": 1.0, "checked": float(checked)}
    if noise is not None:
        summary[Key(Kind.NOISE, "gradient")] = dict(noise)
    if ranks is not None:
        summary[Key(Kind.RANKS, "gradient")] = dict(ranks)
    if scaler is not None:
        summary[Key(Kind.SCALER, "loss_scale")] = {"scale": float(scaler[0]), "new_scale": float(scaler[1])}
    return summary


def forward_values(kind: Kind, row: StatsRow) -> dict[str, float]:
    """What the summary adds to the statistics of a forward entry: for an ``output``, its
    ``rms`` over the finite elements and ``outlier``, absmax over RMS (0 when the RMS is); for an
    ``attention_logit``, ``max``, the largest logit (NaN when none was finite).

    Example:
        >>> row = StatsRow(norm=5.0, mean=-0.5, std=4.95, absmax=4.0, nonfinite=0, zero_fraction=0, count=2, low=-4, high=3)
        >>> forward_values(Kind.OUTPUT, row)
        {'rms': 3.5355339059327378, 'outlier': 1.131370849898476}
    """
    if kind == Kind.ATTENTION_LOGIT:
        return {"max": row.high if row.count > 0 else math.nan}
    value = math.sqrt(row.norm * row.norm / row.count) if row.count > 0 else 0.0
    return {"rms": value, "outlier": row.absmax / value if value > 0 else 0.0}


def rms(stats: Mapping[str, float]) -> float | None:
    """The RMS of a gradient over its non-zero finite elements, from its statistics (a summary's
    ``{statistic: value}``, or ``StatsRow._asdict()``): what the health report judges and the
    gradient-flow picture draws. Over the non-zero elements, so that embedding rows and
    timesteps that no example touches do not read as small. None when it cannot be told (not
    logged, not finite, all zero).

    Example:
        >>> rms({"norm": 2.0, "mean": 0.5, "std": 1.0, "zero_fraction": 0.75})  # of [2, 0, 0, 0]
        2.0
    """
    mean, std, norm = stats.get("mean"), stats.get("std"), stats.get("norm")
    if mean is None or std is None:
        return None
    if not math.isfinite(std):
        std = 0.0  # a single element
    if norm is not None and math.isfinite(norm):
        # sum(x²) = norm² = n·mean² + (n-1)·std²: the element count, then norm/sqrt(n).
        denominator = norm * norm + std * std
        value = math.sqrt(norm * norm * (mean * mean + std * std) / denominator) if denominator > 0 else 0.0
    else:
        value = math.hypot(mean, std)
    if not math.isfinite(value):
        return None
    zero = stats.get("zero_fraction")
    if zero is not None:
        if zero >= 1.0 or value == 0.0:
            return None
        value /= math.sqrt(1.0 - zero)
    return value if value > 0 else None


def pool_entries(
    kind: Kind,
    name: str,
    parts: Sequence[tuple[StatsRow, list[float] | None]],
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
        histogram = Histogram(*merge_histograms([(r.low, r.high, h) for r, h in parts], bins))
    return GradientEntry(kind, name, row, histogram, calls=calls or len(parts))


def single_entry(kind: Kind, name: str, row: StatsRow, hist: list[float] | None, calls: int = 1) -> GradientEntry:
    """The entry of one statistics row (and its histogram counts, or None)."""
    return GradientEntry(kind, name, row, None if hist is None else Histogram(row.low, row.high, hist), calls)
