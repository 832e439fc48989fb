"""One logged step as every check reads it: :class:`Step`, made once per step by the judge from
its :class:`Packed` numbers, with its :class:`Layout`, made once per set of keys; and
:func:`merge_summary`, the one way a step's summaries (one per optimizer, the update ratios after
the gradients) become one (:func:`merged`: the same, for packed summaries). Python and numpy
arrays."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from functools import cached_property
from itertools import chain, islice, repeat
from operator import methodcaller
from typing import Any, NamedTuple

import numpy as np

from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.flags import OVERFLOW_NORM
from lightning_gradhooks.health.origin import why_bad
from lightning_gradhooks.health.shape import Shape
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.summary.records import ACTIVATION_KINDS, GRADIENT_KINDS, Key, Kind, Summary, rms

#: The relative precision of float32 gradients (``torch.finfo(torch.float32).eps``): round-off,
#: unless a step's summary says the gradients were of another precision (``precision`` entry).
FLOAT32_EPS = 2.0 ** -23

_values = methodcaller("values")


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


class Packed(NamedTuple):
    """A step's statistics laid end to end: its keys in record order, how many statistics each
    has (``lengths``), their names and their values (float64), entry after entry. What the judge
    reads a summary into, once (:meth:`of`), and the step's columns are made from."""

    keys: list[Key]
    lengths: list[int]
    names: list[str]
    values: np.ndarray

    @classmethod
    def of(cls, stats: Mapping[Any, Mapping[str, float]], round_to_float32: bool = True) -> Packed:
        """``stats`` (``{key: {statistic: value}}``; a key a :class:`Key` or a tuple) laid end to
        end, its values rounded to float32 unless told otherwise: the judge reads float32 values
        whatever it is given, so that a record (float32 statistics on most devices, float64 under
        double precision) and the log (float64) give the same numbers, and the report of a run and
        of its log agree."""
        keys = list(stats)
        if set(map(type, keys)) - {Key}:
            keys = [key if isinstance(key, Key) else Key(*key) for key in keys]
        dicts = stats.values()
        lengths = list(map(len, dicts))
        values = np.fromiter(chain.from_iterable(map(_values, dicts)), dtype=np.float64, count=sum(lengths))
        if round_to_float32:
            with np.errstate(over="ignore"):
                values = values.astype(np.float32).astype(np.float64)
        return cls(keys, lengths, list(chain.from_iterable(dicts)), values)

    def rounded(self) -> Packed:
        """The same statistics, their values rounded to float32 (see :meth:`of`)."""
        with np.errstate(over="ignore"):
            return self._replace(values=self.values.astype(np.float32).astype(np.float64))

    def summary(self) -> Summary:
        """The statistics as ``{key: {statistic: value}}`` again, in order."""
        names, values = iter(self.names), iter(self.values.tolist())  # zip takes a name first: no value too many
        return {key: dict(zip(islice(names, length), values)) for key, length in zip(self.keys, self.lengths)}


def merged(parts: list[Packed], memo: dict[tuple[int, ...], Any]) -> Packed:
    """The step of several summaries given for it (one per optimizer, the update ratios after
    the gradients): one, as :func:`merge_summary` merges them. Summaries of keys of their own
    are laid one after the other (what a pair of summaries' layouts make is remembered in
    ``memo``, so that the next step's pair, read with the same lists, costs nothing)."""
    while len(parts) > 1:
        first, second = parts[0], parts[1]
        ids = (id(first.keys), id(first.names), id(second.keys), id(second.names))
        known = memo.get(ids)
        if known is None or known[0] is not first.keys or known[1] is not first.names or known[2] is not second.keys or (
                known[3] is not second.names):
            if len(memo) >= 16:
                memo.clear()
            apart = set(first.keys).isdisjoint(second.keys)
            together = (first.keys + second.keys, first.lengths + second.lengths, first.names + second.names) if apart else None
            known = memo[ids] = (first.keys, first.names, second.keys, second.names, together)
        together = known[4]
        if together is None:  # a key in both: merged entry by entry
            into: Summary = {}
            for part in parts:
                merge_summary(into, part.summary().items())
            return Packed.of(into, round_to_float32=False)
        parts = [Packed(*together, np.concatenate([first.values, second.values])), *parts[2:]]
    return parts[0]


def median(values: list[float]) -> float | None:
    """The median of the finite values among ``values``; None with fewer than three."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if len(values) > 2 else None


def middle(values: np.ndarray) -> float | None:
    """:func:`median` of an array (the same number: the middle value, or the mean of the two)."""
    values = np.sort(values[np.isfinite(values)])
    half = len(values) // 2
    if len(values) <= 2:
        return None
    return float(values[half]) if len(values) % 2 else (float(values[half - 1]) + float(values[half])) / 2


class Layout:
    """What every logged step with the same keys shares (a model logs the same keys at each): made
    once per set of keys by the judge, so that a step is judged in arrays, not entry by entry.

    Attributes:
        keys: the keys, in record order; ``subjects``, ``labels`` (each subject's label),
            ``names`` (each key's label) and ``modules`` beside them.
        kinds: each key's kind (an array of strings, for masks: ``layout.kinds == Kind.PARAM``).
        module_ids: each key's module as a number (``module_names[i]``), for sums per module.
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
        self.param_names = [self.names[i] for i in self.params.tolist()]
        self.grad_names = [self.names[i] for i in self.param_grads.tolist()]
        self.dead_kinds = np.isin(self.kinds, [str(Kind.GRAD_OUTPUT), str(Kind.PARAM_GRAD)])  # what ``dead`` reads
        # The modules of the gradient entries, in record order, once each.
        self.gradient_modules = dict.fromkeys(self.modules[i] for i in np.flatnonzero(self.gradient).tolist()).keys()
        ids: dict[str, int] = {}
        self.module_ids = np.array([ids.setdefault(module, len(ids)) for module in self.modules], dtype=np.int64)
        self.module_names = list(ids)
        self._by_name: dict[str, list[int]] | None = None
        self._kinds: dict[str, np.ndarray] = {}
        self._is_kind: dict[str, np.ndarray] = {}
        # Each parameter gradient's parameter entry (the same label), -1 where none.
        of_label = {self.names[i]: i for i in self.params.tolist()}
        self.param_of = np.array([of_label.get(self.names[i], -1) for i in self.param_grads.tolist()], dtype=np.int64)
        self._laid: tuple[list[str], list[int]] = ([], [])  # the names and lengths ``where`` was made for
        self._where: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        self.offsets = np.zeros(1, dtype=np.int64)
        #: What checks work out once per layout and set of chosen keys (:meth:`chosen`; a check's own, under its
        #: name), kept for the next steps: a few at a time.
        self.memo: dict[tuple[str, ...], Any] = {}

    def where(self, names: list[str], lengths: list[int]) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
        """Where each statistic is among a step's values laid end to end, entry after entry
        (``names``: their names; ``lengths``: how many each entry has): its entries' indices
        (None: every entry, in order) and its values' positions. Made once for the layout's usual
        statistics (again when a step's differ; ``offsets`` with it: where each entry's values
        begin)."""
        if (names, lengths) != self._laid:
            entry = np.repeat(np.arange(len(self.keys)), lengths)
            positions: dict[str, list[int]] = {}
            for at, name in enumerate(names):
                positions.setdefault(name, []).append(at)
            self._laid = names, lengths
            # (None for the entries of a statistic every entry has, in order: its column is its values)
            self._where = {name: (None if len(at) == len(self.keys) and bool((entry[at] == np.arange(len(at))).all())
                                  else entry[at], np.array(at)) for name, at in positions.items()}
            self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return self._where

    @cached_property
    def position(self) -> dict[Key, int]:
        """Each key's position."""
        return {key: i for i, key in enumerate(self.keys)}

    def of_kind(self, kind: str) -> np.ndarray:
        """The positions of the keys of ``kind``."""
        found = self._kinds.get(kind)
        if found is None:
            found = self._kinds[kind] = np.flatnonzero(self.is_kind(kind))
        return found

    def is_kind(self, kind: str) -> np.ndarray:
        """Bool: the keys of ``kind`` (made once; read-only)."""
        found = self._is_kind.get(kind)
        if found is None:
            found = self._is_kind[kind] = self.kinds == kind
            found.flags.writeable = False
        return found

    def named(self, names: Iterable[str]) -> np.ndarray:
        """Bool: the keys whose label (``names``) is one of ``names``."""
        if self._by_name is None:
            self._by_name = {}
            for i, name in enumerate(self.names):
                self._by_name.setdefault(name, []).append(i)
        mask = np.zeros(len(self.keys), dtype=bool)
        for name in names:
            mask[self._by_name.get(name, [])] = True
        return mask

    def chosen(self, at: np.ndarray, what: str = "subjects") -> tuple[np.ndarray, list[str]]:
        """The subjects (an array of objects) and their labels of the keys at ``at``, or with
        ``what="modules"`` the modules of ``at`` (module ids) as subjects of their own: the same
        objects for the same keys at every step (the tracker knows them again at no cost)."""
        found = self.memo.get((what, at.tobytes()))
        if found is None:
            if len(self.memo) > 64:
                self.memo.clear()
            if what == "modules":
                labels = [self.module_names[i] for i in at.tolist()]
                subjects = [Subject("", module, module) for module in labels]
            else:
                subjects, labels = [self.subjects[i] for i in at.tolist()], [self.labels[i] for i in at.tolist()]
            found = self.memo[(what, at.tobytes())] = (np.fromiter(subjects, dtype=object, count=len(subjects)), labels)
        return found


class Gradients(NamedTuple):
    """The step's finite gradient entries side by side, in record order (what ``values`` holds,
    as columns): for checks that judge them all at once."""

    at: np.ndarray  # their positions in the layout
    param: np.ndarray  # bool: a parameter's gradient (``param_grad``)
    rms: np.ndarray  # float64: each RMS (:func:`~lightning_gradhooks.summary.records.rms`), NaN where None
    medians: np.ndarray  # float64: the median RMS of each one's kind at this step, NaN where None
    layout: Layout

    def judged(self, quiet: set[str], mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The entries a check judges: those in ``mask`` (default all), less the gradients of
        ``quiet`` parameters; their indices (in these columns), subjects and labels."""
        chosen = np.ones(len(self.at), dtype=bool) if mask is None else mask.copy()
        if quiet:
            chosen &= ~(self.param & self.layout.named(quiet)[self.at])
        indices = np.flatnonzero(chosen)
        return (indices, *self.layout.chosen(self.at[indices]))


def _rms(mean: np.ndarray, std: np.ndarray, norm: np.ndarray, zero: np.ndarray,
         unnormed: list[Mapping[str, float]]) -> np.ndarray:
    """:func:`~lightning_gradhooks.summary.records.rms` of many entries at once, NaN where it is None: the
    same float operations, in arrays. A missing std or zero fraction is -1 (never a value of
    theirs), a missing mean or norm NaN; the entries without a finite norm (``unnormed``, in
    order) are given to ``rms`` itself."""
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
    """The update ratios of a step's parameters (those not ``quiet``) side by side, and the
    model's scale."""

    at: np.ndarray  # the positions in the layout of the parameters with a finite update ratio
    ratios: np.ndarray  # their update ratios
    sizes: np.ndarray  # their RMS after the step (NaN: not known)
    readable: np.ndarray  # bool: at least ``floor_ratio`` of the median size
    median_size: float | None
    median_ratio: float | None  # over the readable parameters (all, if they are too few)


class Step:
    """A logged step, made once by the judge and read by every check, in the order of
    :data:`~lightning_gradhooks.health.judge.CHECKS`.

    Made and read inside the judge's ``np.errstate(all="ignore")`` (its arrays hold NaN where a
    statistic is not told, and inf: the checks compare and divide them without warnings).

    Read-only for the checks: ``number``, ``entries`` (the step's merged summary, in record
    order, float32 values; made on first use: :meth:`entry` gives one), ``previous`` (the logged
    step before it, or None), ``subjects`` (each key's
    :class:`~lightning_gradhooks.health.flags.Subject`), ``bad`` (the non-finite entries and
    why), ``shape`` (the model as seen so far: backward order, parameter sizes, all-zero
    gradients), and the values computed on first use: ``values`` (each finite gradient entry's
    RMS), ``medians`` (per gradient kind), ``moving``, ``eps``, ``skipped``.

    The same step as arrays, for checks that judge its entries together: ``layout`` (its
    :class:`Layout`: keys, subjects, labels, names, modules, kinds in record order),
    :meth:`column` (a statistic of every entry), ``finite`` (bool: the entries not in ``bad``),
    ``gradients`` (:class:`Gradients`: ``values`` and ``medians`` as columns), ``updates``
    (:class:`Updates`), ``moving`` (bool per entry).

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

    Args:
        entries: the step's summary (its values taken as they are), or the judge's
            :class:`Packed` of it.
    """

    def __init__(self, number: int, entries: Summary | Packed, previous: int | None, subjects: Mapping[Key, Subject],
                 shape: Shape, thresholds: Thresholds, layout: Layout | None = None) -> None:
        if isinstance(entries, Packed):
            self.packed = entries
        else:
            self.packed, self.entries = Packed.of(entries, round_to_float32=False), entries
        self.number, self.previous = number, previous
        self.subjects, self.shape, self.thresholds = subjects, shape, thresholds
        self.layout = layout or Layout(self.packed.keys, subjects)
        self._where = self.layout.where(self.packed.names, self.packed.lengths)
        self._columns: dict[tuple[str, float], np.ndarray] = {}
        self.bad = self._bad()
        self.scaler_skipped = False
        self.first_nonfinite = False
        self.unowned: set[str] = set()
        self.round_off: set[str] = set()
        self.no_gradient: set[str] = set()
        self.lr_cut: set[str] = set()

    @cached_property
    def entries(self) -> Summary:
        """The step's summary, ``{key: {statistic: value}}`` in record order."""
        return self.packed.summary()

    def entry(self, i: int) -> dict[str, float]:
        """The statistics of the entry at position ``i`` (of the layout)."""
        if "entries" in self.__dict__:
            return self.entries[self.layout.keys[i]]
        begin, end = self.layout.offsets[i : i + 2].tolist()
        return dict(zip(self.packed.names[begin:end], self.packed.values[begin:end].tolist()))

    def column(self, statistic: str, missing: float = math.nan) -> np.ndarray:
        """One statistic of every entry, in record order (float64; ``missing`` where an entry
        lacks it), made once per step."""
        column = self._columns.get((statistic, missing))
        if column is None:
            entries, at = self._where.get(statistic, (False, None))
            if entries is None:
                column = self.packed.values[at]
            else:
                column = np.full(len(self.layout.keys), missing)
                if at is not None:
                    column[entries] = self.packed.values[at]
            self._columns[(statistic, missing)] = column
        return column

    def _bad(self) -> dict[Key, str]:
        """The non-finite entries and why (:func:`~lightning_gradhooks.health.origin.why_bad`, on
        the entries that the step's columns cannot clear), in record order."""
        maybe = ((self.column("nonfinite", 0.0) > 0) | ~(self.column("norm", 0.0) < OVERFLOW_NORM)
                 | ~np.isfinite(self.column("param_norm", 0.0)) | np.isnan(self.column("update_ratio", 0.0)))
        keys = self.layout.keys
        found = ((i, why_bad(keys[i].kind, self.entry(i))) for i in np.flatnonzero(maybe & self.layout.judged).tolist())
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
        return FLOAT32_EPS if at is None else self.entry(at).get("eps", FLOAT32_EPS)

    @cached_property
    def _finite(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The finite gradient entries' indices, their RMS (NaN: None) and their kinds (indices
        in ``GRADIENT_KINDS``)."""
        indices, kinds, _ = self._gradient_positions
        mean, std = self.column("mean")[indices], self.column("std", -1.0)[indices]
        norm, zero = self.column("norm")[indices], self.column("zero_fraction", -1.0)[indices]
        stats = [self.entry(i) for i in indices[~np.isfinite(norm)].tolist()]
        return indices, _rms(mean, std, norm, zero, stats), kinds

    @cached_property
    def _gradient_positions(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """The finite gradient entries' indices, their kinds (indices in ``GRADIENT_KINDS``) and
        a mask of each kind over them: made once per layout and set of finite entries."""
        layout = self.layout
        memo_key = ("gradients", self.finite.tobytes())
        found = layout.memo.get(memo_key)
        if found is None:
            if len(layout.memo) > 64:
                layout.memo.clear()
            indices = np.flatnonzero(layout.gradient & self.finite)
            kinds = layout.gradient_kinds[indices]
            masks = [kinds == i for i in range(len(GRADIENT_KINDS))]
            for kept in (indices, kinds, *masks):  # (shared by the steps of the layout)
                kept.flags.writeable = False
            found = layout.memo[memo_key] = (indices, kinds, masks)
        return found

    @cached_property
    def values(self) -> dict[Key, float | None]:
        """The RMS of each gradient entry that is finite (None where it cannot be told)."""
        indices, values, _ = self._finite
        keys = self.layout.keys
        return {keys[i]: None if math.isnan(v) else v for i, v in zip(indices.tolist(), values.tolist())}

    @cached_property
    def medians(self) -> dict[str, float | None]:
        """The median RMS of each gradient kind (None: fewer than three values)."""
        _, values, _ = self._finite
        masks = self._gradient_positions[2]
        return {kind: middle(values[masks[i]]) for i, kind in enumerate(GRADIENT_KINDS)}

    @cached_property
    def gradients(self) -> Gradients:
        """The finite gradient entries as columns: ``values`` and ``medians`` side by side."""
        indices, values, kinds = self._finite
        by_kind = np.array([math.nan if m is None else m for m in self.medians.values()], dtype=np.float64)
        param = self._gradient_positions[2][GRADIENT_KINDS.index(Kind.PARAM_GRAD)]
        return Gradients(indices, param, values, by_kind[kinds], self.layout)

    @cached_property
    def updates(self) -> Updates:
        """The update ratios of the parameters not ``quiet`` (read once the checks that write
        ``unowned`` and ``round_off`` have run), and the model's typical update: the median over
        parameters at their own scale (near-zero ones move by more than their size in healthy
        training, and would inflate it)."""
        quiet, layout, sizes_of = self.quiet, self.layout, self.shape.sizes
        params = layout.params[~layout.named(quiet)[layout.params]] if quiet else layout.params
        ratios, norms = self.column("update_ratio")[params], self.column("param_norm")[params]
        names = layout.param_names if params is layout.params else [layout.names[i] for i in params.tolist()]
        elements = np.fromiter(map(sizes_of.get, names, repeat(math.nan)), dtype=np.float64, count=len(params))
        sizes = np.where(np.isfinite(norms) & ~np.isnan(elements), norms / np.sqrt(elements), math.nan)
        known = ~np.isnan(sizes)
        median_size = middle(sizes[known])
        readable = known & (sizes >= self.thresholds.floor_ratio * median_size) if median_size is not None else (
            np.zeros(len(params), dtype=bool))
        finite = np.isfinite(ratios)
        median_ratio = middle(ratios[finite & readable]) or middle(ratios[finite])
        return Updates(params[finite], ratios[finite], sizes[finite], readable[finite], median_size, median_ratio)

    @cached_property
    def moving(self) -> np.ndarray:
        """Whether each entry's parameters still move at a normal rate (bool, in record order): an
        update ratio at least ``vanishing_update_ratio`` of the model's median (Adam-family steps
        do not scale with the gradient); a parameter's gradient by its own parameter, another
        gradient by all the measured parameters of its module. False where no update ratio was
        measured."""
        layout = self.layout
        params = layout.params
        ratios = self.column("update_ratio")[params]
        chosen = np.isfinite(ratios) & (self.column("in_optimizer", 1.0)[params] != 0.0)
        middle_ratio = middle(ratios[chosen])
        moving = np.zeros(len(layout.keys), dtype=bool)
        if not middle_ratio:
            return moving
        fast = np.zeros(len(layout.keys), dtype=bool)
        fast[params[chosen]] = ratios[chosen] >= self.thresholds.vanishing_update_ratio * middle_ratio
        modules = layout.module_ids[params[chosen]]
        count = np.bincount(modules, minlength=len(layout.module_names))
        fast_count = np.bincount(modules, weights=fast[params[chosen]], minlength=len(layout.module_names))
        moving[:] = ((count > 0) & (fast_count == count))[layout.module_ids]
        grads, of = layout.param_grads, layout.param_of
        moving[grads] = (of >= 0) & fast[of]
        return moving
