"""One logged step as every check reads it: :class:`Step`, made once per step by the judge, with
its :class:`Layout`, made once per set of keys; and :func:`merge_summary`, the one way a step's
summaries (one per optimizer, the update ratios after the gradients) become one. Python and
numpy arrays."""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.flags import OVERFLOW_NORM
from lightning_gradhooks.health.origin import why_bad
from lightning_gradhooks.health.shape import Shape
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.core.records import ACTIVATION_KINDS, GRADIENT_KINDS, Key, Kind, Summary, rms

#: The relative precision of float32 gradients (``torch.finfo(torch.float32).eps``): round-off,
#: unless a step's summary says the gradients were of another precision (``precision`` entry).
FLOAT32_EPS = 2.0 ** -23


def merge_summary(into: Summary, summary: Iterable[tuple[Key, dict[str, float]]]) -> None:
    """Merge ``(key, statistics)`` pairs of one step into ``into`` (a later value of a statistic wins)."""
    summary = list(summary)
    if not into:  # the step's first summary
        into.update(summary)
        if len(into) == len(summary):
            return
        into.clear()  # a key given twice: merged below
    for key, stats in summary:
        if key in into:
            into[key].update(stats)
        else:
            into[key] = stats


def rounded(stats: Mapping[Any, Mapping[str, float]]) -> list[tuple[Any, dict[str, float]]]:
    """A step's statistics rounded to float32, ``(key, {statistic: value})`` in order, the whole
    step at once. The judge reads float32 values whatever it is given: a record (whose statistics
    are float32 already on most devices, and float64 under double precision) and the log (which
    holds them as float64) give the same numbers, so the report of a run and of its log agree."""
    values = [v for s in stats.values() for v in s.values()]
    as_float32 = array("f", values).tolist()
    if as_float32 == values and set(map(type, values)) <= {float}:  # float32 values already
        return [(key, dict(s)) for key, s in stats.items()]
    it = iter(as_float32)  # zip takes a name first: each entry takes its own values, no more
    return [(key, dict(zip(s, it))) for key, s in stats.items()]


def median(values: list[float]) -> float | None:
    """The median of the finite values among ``values``; None with fewer than three."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if len(values) > 2 else None


class Layout:
    """What every logged step with the same keys shares (a model logs the same keys at each): made
    once per set of keys by the judge, so that a step is judged in arrays, not entry by entry.

    Attributes:
        keys: the keys, in record order; ``subjects``, ``labels`` (each subject's label),
            ``names`` (each key's label) and ``modules`` beside them.
        kinds: each key's kind (an array of strings, for masks: ``layout.kinds == Kind.PARAM``).
    """

    def __init__(self, keys: Iterable[Key], subjects: Mapping[Key, Subject]) -> None:
        self.keys = list(keys)
        self.subjects = [subjects[key] for key in self.keys]
        self.labels = [subject.label for subject in self.subjects]
        self.names = [key.label for key in self.keys]
        self.modules = [subject.module for subject in self.subjects]
        self.kinds = np.array([str(key.kind) for key in self.keys], dtype=object)
        self.gradient = np.isin(self.kinds, [str(kind) for kind in GRADIENT_KINDS])
        self.param = self.kinds == Kind.PARAM
        self.judged = ~np.isin(self.kinds, [str(kind) for kind in ACTIVATION_KINDS])
        self.precision = next((i for i, key in enumerate(self.keys) if key.kind == Kind.PRECISION), None)
        self.gradient_kinds = np.array([GRADIENT_KINDS.index(key.kind) if key.kind in GRADIENT_KINDS else -1
                                        for key in self.keys], dtype=np.int64)
        self.params = np.flatnonzero(self.param)
        self.param_grads = np.flatnonzero(self.kinds == Kind.PARAM_GRAD)
        # The modules of the gradient entries, in record order, once each.
        self.gradient_modules = dict.fromkeys(self.modules[i] for i in np.flatnonzero(self.gradient).tolist()).keys()
        self._laid: tuple[list[str], list[int]] = ([], [])  # the names and lengths ``where`` was made for
        self._where: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def where(self, names: list[str], lengths: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Where each statistic is among a step's values laid end to end, entry after entry
        (``names``: their names; ``lengths``: how many each entry has): its entries' indices and
        its values' positions. Made once for the layout's usual statistics (again when a step's
        differ)."""
        if (names, lengths) != self._laid:
            entry = np.repeat(np.arange(len(self.keys)), lengths)
            positions: dict[str, list[int]] = {}
            for at, name in enumerate(names):
                positions.setdefault(name, []).append(at)
            self._laid = names, lengths
            self._where = {name: (entry[at], np.array(at)) for name, at in positions.items()}
        return self._where


class Gradients(NamedTuple):
    """The step's finite gradient entries side by side, in record order (what ``values`` holds,
    as columns): for checks that judge them all at once."""

    keys: list[Key]
    subjects: list[Subject]
    labels: list[str]  # each subject's label
    param: np.ndarray  # bool: a parameter's gradient (``param_grad``)
    rms: np.ndarray  # float64: each RMS (:func:`~lightning_gradhooks.core.records.rms`), NaN where None
    medians: np.ndarray  # float64: the median RMS of each one's kind at this step, NaN where None

    def judged(self, quiet: set[str], mask: np.ndarray | None = None) -> tuple[np.ndarray, list[Subject], list[str]]:
        """The entries a check judges: those in ``mask`` (default all), less the gradients of
        ``quiet`` parameters; their indices, subjects and labels."""
        chosen = np.ones(len(self.keys), dtype=bool) if mask is None else mask.copy()
        if quiet:
            chosen &= ~(self.param & np.array([key.label in quiet for key in self.keys], dtype=bool))
        if chosen.all():
            return np.arange(len(self.keys)), self.subjects, self.labels
        indices = np.flatnonzero(chosen)
        return indices, [self.subjects[i] for i in indices], [self.labels[i] for i in indices]


def _rms(mean: np.ndarray, std: np.ndarray, norm: np.ndarray, zero: np.ndarray,
         unnormed: list[Mapping[str, float]]) -> np.ndarray:
    """:func:`~lightning_gradhooks.core.records.rms` of many entries at once, NaN where it is None: the
    same float operations, in arrays. A missing std or zero fraction is -1 (never a value of
    theirs), a missing mean or norm NaN; the entries without a finite norm (``unnormed``, in
    order) are given to ``rms`` itself."""
    with np.errstate(all="ignore"):
        known = std != -1.0
        std = np.where(np.isfinite(std), std, 0.0)
        denominator = norm * norm + std * std
        value = np.where(denominator > 0, np.sqrt(norm * norm * (mean * mean + std * std) / denominator), 0.0)
        value[~known | ~np.isfinite(value)] = math.nan
        told = zero != -1.0
        value[told & ((zero >= 1.0) | (value == 0.0))] = math.nan
        value = np.where(told, value / np.sqrt(1.0 - zero), value)
        value[~(value > 0)] = math.nan
    for i, stats in zip(np.flatnonzero(~np.isfinite(norm)), unnormed):  # math.hypot of mean and std: rms's own
        value[i] = math.nan if (one := rms(stats)) is None else one
    return value


class Updates(NamedTuple):
    """The update ratios of a step's parameters (those not ``quiet``), and the model's scale."""

    keys: dict[str, Key]  # parameter -> its key
    ratios: dict[str, float]  # parameter -> its finite update ratio
    sizes: dict[str, float]  # parameter -> its RMS after the step
    median_size: float | None
    readable: set[str]  # parameters at least ``floor_ratio`` of the median size
    median_ratio: float | None  # over the readable parameters (all, if they are too few)
    subjects: list[Subject]  # the subject of each parameter in ``ratios``, in its order
    labels: list[str]  # their labels


class Step:
    """A logged step, made once by the judge and read by every check, in the order of
    :data:`~lightning_gradhooks.health.judge.CHECKS`.

    Read-only for the checks: ``number``, ``entries`` (the step's merged summary, in record
    order, float32 values), ``previous`` (the logged step before it, or None), ``subjects`` (each
    key's :class:`~lightning_gradhooks.health.flags.Subject`), ``bad`` (the non-finite entries
    and why), ``shape`` (the model as seen so far: backward order, parameter sizes, all-zero
    gradients), and the values computed on first use: ``values`` (each finite gradient entry's
    RMS), ``medians`` (per gradient kind), ``moving``, ``eps``, ``skipped``.

    The same step as arrays, for checks that judge its entries together: ``layout`` (its
    :class:`Layout`: keys, subjects, labels, names, modules, kinds in record order),
    :meth:`column` (a statistic of every entry), ``finite`` (bool: the entries not in ``bad``),
    ``gradients`` (:class:`Gradients`: ``values`` and ``medians`` as columns).

    Written by the checks, for the checks after them (the only fields a check writes):

    - ``scaler_skipped`` (:class:`~lightning_gradhooks.health.scaler.ScalerSkips`): a gradient
      scaler found this step's non-finite gradients and skipped it, while that is its business
      (no ``nonfinite`` judgement of the step);
    - ``first_nonfinite`` (:class:`~lightning_gradhooks.health.nonfinite.NonFinite`): this step
      is the run's first non-finite one;
    - ``unowned`` (:class:`~lightning_gradhooks.health.unowned.Unowned`): parameters in no optimizer;
    - ``round_off`` (:class:`~lightning_gradhooks.health.round_off.RoundOff`): parameters whose
      gradient is round-off (zero by construction);
    - ``no_gradient`` (:class:`~lightning_gradhooks.health.no_gradient.NoGradient`): parameters
      whose ``.grad`` is None;
    - ``lr_cut`` (:class:`~lightning_gradhooks.health.lr_cut.LrCut`): parameters of a param
      group whose learning rate is cut.
    """

    def __init__(self, number: int, entries: Summary, previous: int | None, subjects: Mapping[Key, Subject],
                 shape: Shape, thresholds: Thresholds, layout: Layout | None = None) -> None:
        self.number, self.entries, self.previous = number, entries, previous
        self.subjects, self.shape, self.thresholds = subjects, shape, thresholds
        self.layout = layout or Layout(entries, subjects)
        self._columns: dict[tuple[str, float], np.ndarray] = {}
        self.bad = self._bad()
        self.scaler_skipped = False
        self.first_nonfinite = False
        self.unowned: set[str] = set()
        self.round_off: set[str] = set()
        self.no_gradient: set[str] = set()
        self.lr_cut: set[str] = set()

    def column(self, statistic: str, missing: float = math.nan) -> np.ndarray:
        """One statistic of every entry, in record order (float64; ``missing`` where an entry
        lacks it), made once per step."""
        column = self._columns.get((statistic, missing))
        if column is None:
            values, where = self._laid
            column = self._columns[(statistic, missing)] = np.full(len(self.entries), missing)
            if statistic in where:
                entries, at = where[statistic]
                column[entries] = values[at]
        return column

    @cached_property
    def _laid(self) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """The step's values laid end to end, and where each statistic is among them."""
        stats = self.entries.values()
        names = [name for s in stats for name in s]
        values = np.array([value for s in stats for value in s.values()], dtype=np.float64)
        return values, self.layout.where(names, list(map(len, stats)))

    def _bad(self) -> dict[Key, str]:
        """The non-finite entries and why (:func:`~lightning_gradhooks.health.origin.why_bad`, on
        the entries that the step's columns cannot clear), in record order."""
        with np.errstate(invalid="ignore"):
            maybe = ((self.column("nonfinite", 0.0) > 0) | ~(self.column("norm", 0.0) < OVERFLOW_NORM)
                     | ~np.isfinite(self.column("param_norm", 0.0)) | np.isnan(self.column("update_ratio", 0.0)))
        keys, entries = self.layout.keys, self.entries
        found = ((i, why_bad(keys[i].kind, entries[keys[i]])) for i in np.flatnonzero(maybe & self.layout.judged))
        bad = {i: why for i, why in found if why is not None}
        self.finite = np.ones(len(keys), dtype=bool)
        self.finite[list(bad)] = False
        return {keys[i]: why for i, why in bad.items()}

    @property
    def quiet(self) -> set[str]:
        """Parameters not judged by their gradient or their update: round-off, or in no optimizer."""
        return self.round_off | self.unowned

    @property
    def explained(self) -> set[str]:
        """Parameters whose stall has a cause of its own (no gradient, a cut learning rate):
        counted in the model's medians, not judged ``stalled`` by their update."""
        return self.no_gradient | self.lr_cut

    @cached_property
    def skipped(self) -> bool:
        """Whether the optimizer step was skipped (non-finite gradients: a gradient scaler, the
        sentinel): its update says nothing about the parameters."""
        return any(key.kind in (*GRADIENT_KINDS, Kind.CAUGHT) for key in self.bad)

    @cached_property
    def eps(self) -> float:
        """The relative precision of this step's gradients."""
        at = self.layout.precision
        return FLOAT32_EPS if at is None else self.entries[self.layout.keys[at]].get("eps", FLOAT32_EPS)

    @cached_property
    def _finite(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The finite gradient entries' indices, their RMS (NaN: None) and their kinds (indices
        in ``GRADIENT_KINDS``)."""
        layout = self.layout
        indices = np.flatnonzero(layout.gradient & self.finite)
        mean, std = self.column("mean")[indices], self.column("std", -1.0)[indices]
        norm, zero = self.column("norm")[indices], self.column("zero_fraction", -1.0)[indices]
        stats = [self.entries[layout.keys[i]] for i in indices[~np.isfinite(norm)]]
        return indices, _rms(mean, std, norm, zero, stats), layout.gradient_kinds[indices]

    @cached_property
    def values(self) -> dict[Key, float | None]:
        """The RMS of each gradient entry that is finite (None where it cannot be told)."""
        indices, values, _ = self._finite
        keys = self.layout.keys
        return {keys[i]: None if math.isnan(v) else v for i, v in zip(indices.tolist(), values.tolist())}

    @cached_property
    def medians(self) -> dict[str, float | None]:
        """The median RMS of each gradient kind (None: fewer than three values)."""
        _, values, kinds = self._finite
        return {kind: median(values[kinds == i].tolist()) for i, kind in enumerate(GRADIENT_KINDS)}

    @cached_property
    def gradients(self) -> Gradients:
        """The finite gradient entries as columns: ``values`` and ``medians`` side by side."""
        indices, values, kinds = self._finite
        layout = self.layout
        by_kind = np.array([math.nan if m is None else m for m in self.medians.values()], dtype=np.float64)
        return Gradients(*([every[i] for i in indices.tolist()] for every in (layout.keys, layout.subjects, layout.labels)),
                         kinds == GRADIENT_KINDS.index(Kind.PARAM_GRAD), values, by_kind[kinds])

    @cached_property
    def updates(self) -> Updates:
        """The update ratios of the parameters not ``quiet`` (read once the checks that write
        ``unowned`` and ``round_off`` have run), and the model's typical update: the median over
        parameters at their own scale (near-zero ones move by more than their size in healthy
        training, and would inflate it)."""
        quiet, sizes_of, layout = self.quiet, self.shape.sizes, self.layout
        params = [i for i in layout.params.tolist() if layout.names[i] not in quiet] if quiet else layout.params.tolist()
        names = [layout.names[i] for i in params]
        ratios = {name: ratio for name, ratio in zip(names, self.column("update_ratio")[params].tolist())
                  if math.isfinite(ratio)}
        sizes = {name: norm / math.sqrt(sizes_of[name]) for name, norm in zip(names, self.column("param_norm")[params].tolist())
                 if name in sizes_of and math.isfinite(norm)}
        median_size = median(list(sizes.values()))
        floor = self.thresholds.floor_ratio
        readable = {n for n, size in sizes.items() if median_size is not None and size >= floor * median_size}
        median_ratio = median([r for n, r in ratios.items() if n in readable]) or median(list(ratios.values()))
        keys = {name: layout.keys[i] for name, i in zip(names, params)}
        subjects = [self.subjects[keys[name]] for name in ratios]
        return Updates(keys, ratios, sizes, median_size, readable, median_ratio, subjects, [s.label for s in subjects])

    @cached_property
    def moving(self) -> Callable[[Key], bool]:
        """Whether a gradient entry's parameters still move at a normal rate: an update ratio at
        least ``vanishing_update_ratio`` of the model's median (Adam-family steps do not scale
        with the gradient). False where no update ratio was measured."""
        params, keys = self.layout.params, self.layout.keys
        chosen = params[np.isfinite(self.column("update_ratio")[params]) & (self.column("in_optimizer", 1.0)[params] != 0.0)]
        ratios = dict(zip((keys[i] for i in chosen.tolist()), self.column("update_ratio")[chosen].tolist()))
        middle = median(list(ratios.values()))
        if not middle:
            return lambda key: False
        fast = {key.label for key, r in ratios.items() if r >= self.thresholds.vanishing_update_ratio * middle}
        by_module: dict[str, list[bool]] = {}
        for key in ratios:
            by_module.setdefault(self.subjects[key].module, []).append(key.label in fast)

        def moving(key: Key) -> bool:
            if key.kind == Kind.PARAM_GRAD:
                return key.label in fast
            module = by_module.get(self.subjects[key].module)
            return bool(module) and all(module)

        return moving
