"""The judge of the gradient-health report: what looks wrong, where, since when, and why. Pure Python.

:class:`Judge` consumes the summary of each logged step
(:func:`~lightning_gradhooks.records.step_summary`: from the callback, a plain loop or Fabric,
or read back from a TensorBoard log by the ``report`` command: the same numbers, so the same
flags) and decides, per module; :mod:`lightning_gradhooks.report` renders what it decided:

- ``nonfinite``: NaN/Inf, or a gradient whose L2 norm overflows float32 (what
  ``clip_grad_norm_`` then sees as an infinite total norm), or a non-finite update. One flag: the
  first logged step where it appears and where it was born (:func:`nonfinite_origin`): the
  weights already non-finite when the step began, the inputs of a module (made outside any
  module), the forward of a module (any module, parameterless ones included), the loss, the
  backward of a module, or the optimizer step.
- ``exploding``: a gradient whose RMS is ``exploding_factor`` times the median of its own last
  ``exploding_window`` logged values, or an update ten times the size of the weights it moves
  (``update_ratio`` above ``exploding_update_ratio``), for ``exploding_steps`` logged steps in a
  row; values below ``floor_ratio`` of the model's median (same kind, same step) are not read.
  One such update is enough when it lands the weights beyond ``1 / floor_ratio`` times the
  model's median parameter RMS.
- ``vanishing``: a gradient whose RMS is below ``vanishing_ratio`` times the median RMS of the
  same kind of gradient at the same step, for ``vanishing_steps`` logged steps in a row.
- ``dead``: a module whose output gradient and parameter gradients are all (at least
  ``dead_zero_fraction``) exactly zero, for ``dead_steps`` logged steps in a row.
- ``stalled``: a parameter that does not move: ``update_ratio`` 0, or below
  ``stalled_update_ratio`` times the model's median, for ``stalled_steps`` logged steps in a row.

Why each definition is what it is (docs/usage.md has the validation): gradients are compared
with the model's own scale at the same step, or with their own recent median, never with zero
or with one past value; an RMS is taken over the non-zero elements only, so that embedding
rows and timesteps that no example touches do not read as small; a flag needs several logged
steps in a row, so a single-step spike is not one; zero- and tiny-initialised parameters
(biases, tokens) move by more than their own size in healthy training, so update ratios are
read only on parameters at least ``floor_ratio`` of the model's median size.

The RMS of a gradient (:func:`~lightning_gradhooks.records.rms`, the gradient-flow picture's
too) is computed from the logged ``norm``, ``mean``, ``std`` and ``zero_fraction`` (rounded to
float32 as the log holds them), so the report of a record and the report of its log agree. A check whose statistic was not logged is skipped.

Example:
    >>> judge = Judge()
    >>> for step in (0, 10, 20):  # a ReLU that lets no gradient through
    ...     judge.add_stats(step, {("grad_output", "relu"): {"zero_fraction": 1.0}})
    >>> [(f.flag, f.kind, f.entry, f.since) for f in judge.flags()]
    [('dead', '', 'relu', 0)]
"""
from __future__ import annotations

import functools
import math
import statistics as _statistics
from array import array
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

from lightning_gradhooks._text import counted, listed
from lightning_gradhooks.records import ACTIVATION_KINDS, GRADIENT_KINDS, Key, Kind, Summary, rms

#: The flags, worst first: the order the report lists them in.
FLAGS = ("nonfinite", "exploding", "vanishing", "dead", "stalled")
#: A norm whose square is beyond float32: what float32 norms (``clip_grad_norm_``) see as Inf.
OVERFLOW_NORM = math.sqrt(3.4028234663852886e38)
_STATE_VERSION = 2
#: Why a parameter that gets gradients is ``stalled`` at once: no optimizer holds it.
UNOWNED = "in no optimizer: it gets gradients, but nothing steps it"
#: The relative precision of float32 gradients (``torch.finfo(torch.float32).eps``): round-off,
#: unless a step's summary says the gradients were of another precision (``precision`` entry).
FLOAT32_EPS = 2.0 ** -23
#: A noted parameter keeps its note while its gradient is below this share of its module's.
NOTE_HOLD_RATIO = 1e-3
#: A learning rate at most this share of its group's highest so far is cut (0, or tiny).
LR_CUT = 1e-6
#: The kind of a flag on a param group (its learning rate).
PARAM_GROUP = "param_group"
#: The most keys whose subject a judge keeps (a model's entries; beyond it, the cache starts over).
_SUBJECTS_MAX = 1 << 16


@dataclass(frozen=True)
class Thresholds:
    """When the report raises a flag; every field can be overridden, and each is range-checked.

    Attributes:
        vanishing_ratio: RMS below this share of the median RMS (same kind, same step) ...
        vanishing_steps: ... for this many logged steps in a row, while the parameters it
            reaches move by less than ...
        vanishing_update_ratio: ... this share of the model's median update ratio (a small
            gradient that an Adam-family optimizer still turns into normal steps is not a
            problem); where no update was measured, the gradient alone decides.
        round_off_factor: a parameter gradient whose norm is below this many float round-offs
            of the gradient its module receives (``grad_output``: ``eps`` of the gradients'
            precision times the square root of its element count over the parameter's),
            ``vanishing_steps`` logged steps in a row, is zero by construction (a bias followed
            by a normalisation layer): a note, never a flag; unless a smaller parameter of the
            same module gets a gradient above round-off (then the bigger one's is small because
            its input is: a weight behind a vanishing signal, not a redundant parameter).
        exploding_factor: RMS this many times the median of its own last values ...
        exploding_window: ... over this many logged steps (the baseline) ...
        exploding_steps: ... for this many logged steps in a row (also for update ratios).
        exploding_update_ratio: ``update_ratio`` (‖Δw‖/‖w_before‖) above this: a step ten
            times the size of the weights it moves (a random walk of a bias near zero reaches 1-4).
        floor_ratio: gradients (for ``exploding``) and parameters (for update ratios) whose RMS
            is below this share of the model's median at the step are at the floor: zero- and
            tiny-initialised parameters, noise far below the model's own scale; not read.
        dead_zero_fraction: ``zero_fraction`` at least this, of a module's output gradient and
            of its parameter gradients ...
        dead_steps: ... for this many logged steps in a row.
        stalled_update_ratio: ``update_ratio`` 0 or below this share of the model's median
            update ratio at the step (over parameters at their own scale, see ``floor_ratio``) ...
        stalled_steps: ... for this many logged steps in a row.
    """

    vanishing_ratio: float = 1e-3
    vanishing_steps: int = 3
    vanishing_update_ratio: float = 1e-2
    round_off_factor: float = 64.0
    exploding_factor: float = 100.0
    exploding_window: int = 5
    exploding_steps: int = 2
    exploding_update_ratio: float = 10.0
    floor_ratio: float = 0.1
    dead_zero_fraction: float = 0.99
    dead_steps: int = 3
    stalled_update_ratio: float = 1e-4
    stalled_steps: int = 3

    def __post_init__(self) -> None:
        for f in fields(self):
            value, (low, high, closed) = getattr(self, f.name), _RANGES[f.name]
            if f.type in (int, "int"):
                accepted = f"an int from {low} to {high}" if high is not None else f"an int >= {low}"
                integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
                if isinstance(value, bool) or not integral or value < low or (high is not None and value > high):
                    raise ValueError(f"Thresholds.{f.name} expected {accepted}, got {value!r}")
                object.__setattr__(self, f.name, int(value))
                continue
            accepted = _describe(low, high, closed)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Thresholds.{f.name} expected a finite number {accepted}, got {value!r}")
            below = value < low if closed[0] else value <= low
            above = high is not None and (value > high if closed[1] else value >= high)
            if below or above:
                raise ValueError(f"Thresholds.{f.name} expected a number {accepted}, got {value!r}")
            object.__setattr__(self, f.name, float(value))


# Accepted ranges: (low, high or None, (low included, high included)).
_RANGES = {
    "vanishing_ratio": (0.0, 1.0, (False, False)),
    "vanishing_steps": (1, None, (True, True)),
    "vanishing_update_ratio": (0.0, 1.0, (True, True)),
    "round_off_factor": (0.0, None, (False, True)),
    "exploding_factor": (1.0, None, (False, True)),
    "exploding_window": (1, None, (True, True)),
    "exploding_steps": (1, None, (True, True)),
    "exploding_update_ratio": (0.0, None, (False, True)),
    "floor_ratio": (0.0, 1.0, (True, False)),
    "dead_zero_fraction": (0.0, 1.0, (False, True)),
    "dead_steps": (1, None, (True, True)),
    "stalled_update_ratio": (0.0, 1.0, (True, False)),
    "stalled_steps": (1, None, (True, True)),
}


def _describe(low: float, high: float | None, closed: tuple[bool, bool]) -> str:
    if high is None:
        return f"{'>=' if closed[0] else '>'} {low:g}"
    return f"in {'[' if closed[0] else '('}{low:g}, {high:g}{']' if closed[1] else ')'}"


@dataclass(frozen=True)
class Flag:
    """One flagged entry: ``flag`` (one of :data:`FLAGS`) on the entry ``entry`` of kind ``kind``
    (a module's own flag, ``dead``: kind ``""`` and the module as ``entry``) since logged step
    ``since``; ``last`` is the statistic's latest value (RMS, zero fraction, update ratio or NaN
    count); ``module`` the module the entry belongs to."""

    flag: str
    kind: str
    entry: str
    since: int
    last: float
    module: str = ""
    score: float = 0.0  # how bad, within the flag: higher is worse
    reason: str = ""  # a reason other than the flag's own definition (``UNOWNED``)

    @property
    def name(self) -> str:
        """The entry as the full table names it: ``"<kind> <entry>"``, or the module alone."""
        return f"{self.kind} {self.entry}" if self.kind else self.entry


@dataclass
class Row:
    """One line of the grouped report: a flag on a module, its entries folded in, and the
    flags that follow from it (upstream modules, stalled parameters) under it."""

    flag: str
    module: str
    since: int
    value: float
    detail: str
    entries: list[str] = field(default_factory=list)
    consequences: list[Flag] = field(default_factory=list)
    score: float = 0.0


class _Subject(NamedTuple):
    """What a check judges: an entry (its kind, its name as written, its module), or a module
    (kind ``""``)."""

    kind: str
    entry: str
    module: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.entry}" if self.kind else self.entry


def _subject(key: Key) -> _Subject:
    return _Subject(str(key.kind), key.label, key.module)


@dataclass
class _Track:
    """Per subject and check: the step a run of bad steps began at (None: not in one), its length."""

    start: int | None = None
    length: int = 0
    values: list[float] = field(default_factory=list)
    last: float = 0.0  # the value and score at the latest bad step
    score: float = 0.0
    subject: _Subject = _Subject("", "", "")


def _f32(stats: Mapping[str, float]) -> dict[str, float]:
    """The statistics as the log holds them (float32)."""
    return _f32_step({None: stats})[0][1]


def _f32_step(stats: Mapping[Any, Mapping[str, float]]) -> list[tuple[Any, dict[str, float]]]:
    """A step's statistics as the log holds them (:func:`_f32`): ``(key, {statistic: value})`` in
    order, the whole step rounded at once."""
    values = [v for s in stats.values() for v in s.values()]
    rounded = array("f", values).tolist()
    if rounded == values and set(map(type, values)) <= {float}:  # already float32 (read from a log)
        return [(key, dict(s)) for key, s in stats.items()]
    out, start = [], 0
    for key, s in stats.items():
        end = start + len(s)
        out.append((key, dict(zip(s, rounded[start:end]))))
        start = end
    return out


def _size(stats: Mapping[str, float]) -> float | None:
    """The element count of a gradient, from its norm, mean and std (None if not told)."""
    mean, std, norm = stats.get("mean"), stats.get("std"), stats.get("norm")
    if None in (mean, std, norm) or not all(map(math.isfinite, (mean, norm))):
        return None
    std = std if math.isfinite(std) else 0.0
    if mean * mean + std * std == 0:
        return None
    return (norm * norm + std * std) / (mean * mean + std * std)


def _bad(kind: str, stats: Mapping[str, float]) -> str | None:
    """Why an entry is non-finite (None: it is not)."""
    if kind in ACTIVATION_KINDS:  # the forward statistics: not judged yet
        return None
    count = stats.get("nonfinite", 0)
    if count and count > 0:
        return f"{int(count)} NaN/Inf"
    norm = stats.get("norm")
    if kind in GRADIENT_KINDS and norm is not None and not (norm < OVERFLOW_NORM):
        return f"norm {norm:.3g} overflows float32"
    if kind == Kind.PARAM:
        ratio, size = stats.get("update_ratio"), stats.get("param_norm")
        if size is not None and not math.isfinite(size):
            return "weights non-finite after the step"
        if ratio is not None and math.isnan(ratio):
            return "update ratio NaN"
    return None


def nonfinite_origin(stats: Mapping[Key, Mapping[str, float]]) -> tuple[str, str, float] | None:
    """Where the NaN/Inf of one logged step were born, from its summary (entries in record order):
    ``(module, description, value)``, or None when the step is finite.

    In this order: the weights were already non-finite when the step began; a module's inputs
    were non-finite before its forward (made outside any module: the batch or functional code);
    a module's forward made them (the first, in forward order, whose inputs were finite); the
    loss (the first gradient of backward is already bad); the backward of a module (the first
    bad gradient in backward order); the optimizer step (a non-finite update).
    """
    return _origin(stats, _bad_entries(stats))


def _bad_entries(stats: Mapping[Key, Mapping[str, float]]) -> dict[Key, str]:
    """The non-finite entries of a step, in record order, with why (:func:`_bad`)."""
    return {key: why for key, s in stats.items() if (why := _bad(key.kind, s)) is not None}


def _origin(stats: Mapping[Key, Mapping[str, float]], found: Mapping[Key, str]) -> tuple[str, str, float] | None:
    """:func:`nonfinite_origin`, given the step's non-finite entries (:func:`_bad_entries`)."""
    if not found:
        return None
    bad = list(found.items())
    count = {key: s.get("nonfinite", 0) for key, s in stats.items()}
    caught = [key for key, _ in bad if key.kind == Kind.CAUGHT]
    if caught:  # by the sentinel, on a step that may not be logged: the parameters alone tell
        checked = int(stats[caught[0]].get("checked", 0))
        where = ("in every parameter: the loss or the forward pass made them" if len(caught) == checked else
                 f"nearest the loss `{caught[-1].label}`: born in its module's backward or after it")
        return (caught[-1].module,
                f"caught before the optimizer step, which was skipped (the weights are still finite): non-finite "
                f"gradients in {counted(len(caught), 'parameter')}, {where}", float(len(caught)))
    for key, why in bad:
        if key.kind == Kind.WEIGHTS:
            return key.label, f"weights already non-finite when the step began ({counted(int(count[key]), 'parameter')})", count[key]
    for key, why in bad:
        if key.kind == Kind.FORWARD_INPUT:
            module = key.module
            return module, f"inputs of `{module}` already non-finite: made outside any module (the batch, or functional code before it)", count[key]
        if key.kind == Kind.FORWARD:
            return key.label, f"born in the forward of `{key.label}`", count[key]
    gradients = [key for key in stats if key.kind in GRADIENT_KINDS]
    ranks = next((s for key, s in stats.items() if key.kind == Kind.RANKS), None)  # bad before the all-reduce
    elsewhere = ""
    if ranks is not None:
        more = int(ranks.get("nonfinite_ranks", 1)) - 1
        elsewhere = f"rank {int(ranks.get('first_rank', 0))}" + (f" and {counted(more, 'other')}" if more else "")
    for key, why in bad:
        if key.kind in GRADIENT_KINDS:
            value = count[key] or stats[key].get("norm", 0.0)  # NaN/Inf count, or the overflowing norm
            if ranks is not None and not ranks.get("own", 1) and key.kind == Kind.PARAM_GRAD:
                # This rank's own backward was finite (its hooks, its local gradients): the
                # collective that averages the ranks' gradients brought the NaN.
                return key.module, (f"another rank: the gradients of {elsewhere} were already non-finite before the "
                                    f"all-reduce, which brought them here (this rank's forward, loss and own gradients "
                                    f"were finite); first seen in {key.kind} of `{key.label}` ({why})"), value
            on = f" (on {elsewhere}, before the all-reduce)" if ranks is not None else ""
            if gradients and gradients[0] == key:
                return key.module, f"the loss: the first gradient of backward ({key.kind} of `{key.label}`) is already bad: {why}{on}", value
            return key.module, f"born in backward: first seen in {key.kind} of `{key.label}` ({why}){on}", value
    key, why = bad[0]
    return key.module, f"the optimizer step: {why} of `{key.label}`", 0.0


class Judge:
    """Accumulates logged steps and flags gradient problems (see the module docstring): the
    state, the per-step decisions and the resume state of a
    :class:`~lightning_gradhooks.report.HealthReport`, which adds the renderers.

    A step is judged once all its statistics are in: the statistics given for one step (one
    call, or several: the update ratios after the gradients, one record per optimizer) are
    merged, and the step is judged when a later step arrives or the report is read (statistics
    of a step given after it was judged are ignored). Its state survives a resume through
    :meth:`state_dict` / :meth:`load_state_dict`.

    Args:
        thresholds: when to flag; default :class:`Thresholds`.
    """

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self._seen: list[int] = []
        self._flags: dict[tuple[str, str], Flag] = {}
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._nonfinite: Row | None = None
        self._order: dict[str, int] = {}  # module -> first position in backward order
        self._sizes: dict[str, float] = {}  # parameter -> element count, from its gradient
        self._zero_grads: set[str] = set()  # parameters whose latest gradient is all zero
        self._notes: dict[str, Flag] = {}  # parameter -> its no-gradient note (while it holds)
        self._pending: dict[int, Summary] = {}  # steps not judged yet
        self._lr_peaks: dict[str, float] = {}  # param group -> its highest learning rate so far
        self._no_grad: dict[str, list[float]] = {}  # parameter without .grad -> [first step of it, norm then]
        self._subjects: dict[Key, _Subject] = {}  # a cache: the subject of each key seen

    @property
    def steps(self) -> int:
        """The number of logged steps taken in."""
        return len(self._seen)

    def add_stats(self, step: int, stats: Mapping[tuple[str, ...], Mapping[str, float]]) -> None:
        """Take in statistics of logged step ``step``: its :data:`~lightning_gradhooks.records.Summary`
        (:func:`~lightning_gradhooks.records.step_summary`), or ``{(kind, name): {statistic: value}}``,
        in record order. Several calls for one step are merged (one step, counted once); a call
        for a later step judges the earlier ones. Statistics of a step already judged are
        ignored (a resume replays no step the report has seen)."""
        if step not in self._pending:
            if self._seen and step <= self._seen[-1]:
                return
            self._judge_pending()
            self._pending[step] = {}
            self._seen.append(step)
        merged = self._pending[step]
        for key, s in _f32_step(stats):
            if key[0] in ACTIVATION_KINDS:  # the forward statistics: not judged yet
                continue
            key = key if isinstance(key, Key) else Key(*key)
            if key in merged:
                merged[key].update(s)
            else:
                merged[key] = s

    def _judge_pending(self) -> None:
        for step in sorted(self._pending):
            self._judge(step, self._pending.pop(step))

    def _judge(self, step: int, entries: Summary) -> None:
        t = self.thresholds
        first_bad = self._nonfinite is None
        subjects = self._subjects  # each entry's subject, made once per key (the checks read it)
        if len(subjects) > _SUBJECTS_MAX:  # names that keep changing: start over
            subjects.clear()
        for key in entries:
            if key not in subjects:
                subjects[key] = _subject(key)
        bad = _bad_entries(entries)
        self._check_nonfinite(step, entries, bad)
        order = self._order
        for key, s in entries.items():
            if key.kind not in GRADIENT_KINDS:
                continue
            module = subjects[key].module
            if module not in order:
                order[module] = len(order)
            if key.kind == Kind.PARAM_GRAD:
                if (size := _size(s)) is not None:
                    self._sizes[key.label] = size
                if s.get("zero_fraction") is not None:
                    zero = s["zero_fraction"] >= t.dead_zero_fraction
                    (self._zero_grads.add if zero else self._zero_grads.discard)(key.label)
        unowned = self._check_unowned(step, entries)
        quiet = self._check_no_gradient(step, entries, bad) | unowned
        # Explained by a cause of their own, not judged by their update: parameters without a
        # gradient, and those of a param group whose learning rate is cut.
        explained = self._check_gradient_none(step, entries) | self._check_groups(step, entries)
        moving = self._moving(entries)
        values = {key: rms(s) for key, s in entries.items() if key.kind in GRADIENT_KINDS and key not in bad}
        medians = {kind: _median([v for key, v in values.items() if key.kind == kind]) for kind in GRADIENT_KINDS}
        for key, value in values.items():
            if key.kind == Kind.PARAM_GRAD and key.label in quiet:
                continue
            subject, median = self._subjects[key], medians[key.kind]
            # Small, and learning stops with it: the update is small too (or not measured).
            low = value is not None and median is not None and value < t.vanishing_ratio * median and not moving(key)
            self._run("vanishing", subject, step, low, t.vanishing_steps, value or 0.0, score=median / value if low else 0)
            if value is None:
                continue
            history = self._track("history", subject.label).values
            baseline = _middle(history) if history else None
            floor = median is not None and value < t.floor_ratio * median
            grown = baseline is not None and not floor and value > t.exploding_factor * baseline
            self._run("exploding", subject, step, grown, t.exploding_steps, value, score=value / baseline if grown else 0)
            # The baseline is the gradient at the model's own scale: growth from a near-zero
            # start (attention's query and key at uniform attention, a LoRA adapter) to it is
            # no explosion.
            if not floor:
                history.append(value)
                del history[: -t.exploding_window]
        self._check_dead(step, entries, bad)
        # A step with non-finite gradients is skipped (a gradient scaler, the sentinel): its
        # update says nothing about the parameters.
        if not any(key.kind in (*GRADIENT_KINDS, Kind.CAUGHT) for key in bad):
            self._check_updates(step, [(key, s) for key, s in entries.items()
                                       if key.kind == Kind.PARAM and key.label not in quiet], explained)
        if first_bad and self._nonfinite is not None:
            self._promote_explosions()

    def _check_unowned(self, step: int, entries: Summary) -> set[str]:
        """Parameters that get a gradient but that no optimizer steps (``in_optimizer`` 0):
        ``stalled`` at once, with that reason. Returns their names."""
        grads = {key.label: s for key, s in entries.items() if key.kind == Kind.PARAM_GRAD}
        unowned = set()
        for key, s in entries.items():
            if key.kind != Kind.PARAM or s.get("in_optimizer", 1.0) != 0.0:
                continue
            unowned.add(key.label)
            gradient = grads.get(key.label, {})
            gets = gradient.get("norm", 0.0) > 0 or gradient.get("nonfinite", 0.0) > 0
            self._run("stalled", self._subjects[key], step, gets, 1, gradient.get("norm", 0.0), reason=UNOWNED)
        return unowned

    def _check_no_gradient(self, step: int, entries: Summary, bad: Mapping[Key, str]) -> set[str]:
        """Parameters whose gradient is float round-off next to the gradient their module
        receives: zero by construction (a bias followed by a normalisation layer). A note while
        it holds, never a flag; returns the parameters that are that way at this step.

        Round-off of a sum of ``n`` terms of the module's output gradient spread over a
        parameter's ``p`` elements is about ``eps * sqrt(n / p)`` of its norm. A parameter whose
        smaller sibling (same module, fewer elements) gets more than round-off is no such
        parameter: the module's gradient reaches its parameters, and this one's is small because
        its input is."""
        t = self.thresholds
        eps = next((s.get("eps", FLOAT32_EPS) for key, s in entries.items() if key.kind == Kind.PRECISION), FLOAT32_EPS)
        outputs: dict[str, list[float]] = {}  # module -> [norm, elements] of its output gradients
        for key, s in entries.items():
            if key.kind == Kind.GRAD_OUTPUT and key not in bad and s.get("norm") is not None:
                norm, size = outputs.setdefault(self._subjects[key].module, [0.0, 0.0])
                outputs[self._subjects[key].module] = [math.hypot(norm, s["norm"]), size + (_size(s) or 0.0)]
        found: dict[str, tuple[Key, float, float, bool]] = {}  # parameter -> key, ratio, elements, at round-off
        for key, s in entries.items():
            if key.kind != Kind.PARAM_GRAD or key in bad or s.get("norm") is None:
                continue
            arriving, size = outputs.get(self._subjects[key].module, [0.0, 0.0])
            elements = self._sizes.get(key.label, 0.0)
            ratio = s["norm"] / arriving if arriving > 0 else math.nan
            limit = t.round_off_factor * eps * math.sqrt(size / elements) if size and elements else 0.0
            found[key.label] = (key, ratio, elements, ratio == 0 or ratio < limit)
        quiet = set()
        for name, (key, ratio, elements, none) in found.items():
            if none and any(not other[3] and 0 < other[2] < elements for other in found.values()
                            if self._subjects[other[0]].module == self._subjects[key].module):
                none = False  # a weight whose input is small, beside a bias that gets its gradient
            track = self._track("no_gradient", name)
            # Once noted, a parameter stays noted while its gradient stays far below its module's
            # (a scale before a LayerNorm, whose eps lets a little through as training goes).
            none = none or (name in self._notes and ratio < NOTE_HOLD_RATIO)
            if not none:
                track.start, track.length = None, 0
                self._notes.pop(name, None)
                continue
            track.start = step if track.start is None else track.start
            track.length += 1
            if track.length >= t.vanishing_steps:
                self._notes[name] = Flag("note", str(key.kind), name, track.start, ratio, self._subjects[key].module)
            quiet.add(name)
        return quiet

    def _check_gradient_none(self, step: int, entries: Summary) -> set[str]:
        """Parameters that require grad and sit in an optimizer, whose ``.grad`` is None when it
        steps (``no_gradient``), and that nothing else moves either (their norm unchanged since
        the logged step before): ``stalled``, one row per outermost module whose measured
        parameters all have no gradient, naming the module nearest the loss among them.
        Returns every parameter without a gradient at this step (one an EMA or another rule
        moves is no problem, and is not judged by its update)."""
        t = self.thresholds
        measured = [(key, s) for key, s in entries.items() if key.kind == Kind.PARAM and "group" in s]
        none = {key.label for key, s in measured if s.get("no_gradient") == 1.0}
        for name in list(self._no_grad):
            if name not in none:
                del self._no_grad[name]
        # Every module: are all the measured parameters under it without a gradient?
        whole: dict[str, bool] = {}
        for key, _ in measured:
            for module in _ancestors(self._subjects[key].module):
                whole[module] = whole.get(module, True) and key.label in none
        roots = {key.label: next(m for m in _ancestors(self._subjects[key].module) if whole[m]) for key, _ in measured if key.label in none}
        nearest = {root: module for root, module in ((roots[k.label], k.module) for k, _ in measured if k.label in roots)}
        for key, s in measured:
            if key.label not in none:
                continue
            norm = s.get("param_norm", math.nan)
            start, before = self._no_grad.setdefault(key.label, [float(step), norm])
            still = before == norm and start < step  # unmoved since the first logged step without it
            if not still:
                self._no_grad[key.label] = [float(step), norm]
            root = roots[key.label]
            reason = (f"gets no gradient (`.grad` is None when its optimizer steps, and nothing else moves it): its "
                      f"output (nearest the loss: `{nearest[root]}`) does not reach the loss through autograd: a "
                      f"`.detach()`, `torch.no_grad()`, or a branch the loss does not use")
            self._run("stalled", _Subject(str(key.kind), key.label, root), step, still, max(1, t.stalled_steps - 1),
                      0.0, reason=reason)
            flag = self._flags.get(("stalled", f"{key.kind} {key.label}"))
            if flag is not None and still and flag.since > start:
                self._flags[("stalled", flag.name)] = replace(flag, since=int(start))
        return none

    def _check_groups(self, step: int, entries: Summary) -> set[str]:
        """Param groups whose learning rate is 0, or tiny next to the group's highest so far
        (``LR_CUT``): ``stalled``, one row per group naming it and its learning rate, read
        from the optimizer's ``param_groups``; returns their parameters (explained by it)."""
        t = self.thresholds
        groups: dict[tuple[int | None, int], list[tuple[Key, float]]] = {}
        for key, s in entries.items():
            if key.kind == Kind.PARAM and "group" in s and math.isfinite(s.get("lr", math.nan)):
                groups.setdefault((key.optimizer, int(s["group"])), []).append((key, s["lr"]))
        cut_off = set()
        for (optimizer, index), members in groups.items():
            lr = members[0][1]
            of = "" if optimizer is None else f" of optimizer {optimizer}"
            label = f"param_groups[{index}]{of}"
            peak = self._lr_peaks[label] = max(self._lr_peaks.get(label, 0.0), lr)
            cut = lr <= LR_CUT * peak
            module = _common_module(tuple(self._subjects[key].module for key, _ in members))
            reason = (f"learning rate {lr:g} (`param_groups[{index}]['lr']`{of}, its highest so far {peak:g}): "
                      f"the {counted(len(members), 'parameter')} of the group do not move")
            self._run("stalled", _Subject(PARAM_GROUP, label, module), step, cut, t.stalled_steps, lr, reason=reason)
            if cut:
                cut_off |= {key.label for key, _ in members}
        return cut_off

    def _moving(self, entries: Summary):  # noqa: ANN202
        """Whether a gradient entry's parameters still move at a normal rate: an update ratio at
        least ``vanishing_update_ratio`` of the model's median (Adam-family steps do not scale
        with the gradient). False where no update ratio was measured."""
        t = self.thresholds
        ratios = {key: s["update_ratio"] for key, s in entries.items()
                  if key.kind == Kind.PARAM and math.isfinite(s.get("update_ratio", math.nan))
                  and s.get("in_optimizer", 1.0) != 0.0}
        median = _median(list(ratios.values()))
        if not median:
            return lambda key: False
        fast = {key.label for key, r in ratios.items() if r >= t.vanishing_update_ratio * median}
        by_module: dict[str, list[bool]] = {}
        for key in ratios:
            by_module.setdefault(self._subjects[key].module, []).append(key.label in fast)

        def moving(key: Key) -> bool:
            if key.kind == Kind.PARAM_GRAD:
                return key.label in fast
            module = by_module.get(self._subjects[key].module)
            return bool(module) and all(module)

        return moving

    def _promote_explosions(self) -> None:
        """At the first non-finite logged step, an explosion seen on the logged step before it
        (or on this one) is named even though it had no time to last: the next logged step was
        already NaN."""
        for (check, label), track in self._tracks.items():
            if check != "exploding" or track.start is None or (check, label) in self._flags:
                continue
            subject = track.subject
            self._flags[(check, label)] = Flag(check, *subject[:2], track.start, track.last, subject.module, track.score)

    def _check_dead(self, step: int, entries: Summary, bad: Mapping[Key, str]) -> None:
        t = self.thresholds
        zeros: dict[str, dict[str, list[float]]] = {}
        for key, s in entries.items():
            if key.kind in (Kind.GRAD_OUTPUT, Kind.PARAM_GRAD) and s.get("zero_fraction") is not None \
                    and key not in bad:
                zeros.setdefault(self._subjects[key].module, {}).setdefault(key.kind, []).append(s["zero_fraction"])
        for module, kinds in zeros.items():
            dead = all(z >= t.dead_zero_fraction for values in kinds.values() for z in values)
            value = min(z for values in kinds.values() for z in values)
            self._run("dead", _Subject("", module, module), step, dead, t.dead_steps, value)

    def _check_updates(self, step: int, params: list[tuple[Key, Mapping[str, float]]], explained: set[str]) -> None:
        """``exploding`` and ``stalled`` from the update ratios; parameters whose stall has a
        cause of its own (``explained``: a cut learning rate, no gradient) count towards the
        model's medians but are not judged ``stalled`` here."""
        t = self.thresholds
        subjects = {key.label: self._subjects[key] for key, _ in params}
        ratios = {key.label: s["update_ratio"] for key, s in params if math.isfinite(s.get("update_ratio", math.nan))}
        sizes = {
            key.label: s["param_norm"] / math.sqrt(self._sizes[key.label])
            for key, s in params
            if key.label in self._sizes and math.isfinite(s.get("param_norm", math.nan))
        }
        median_size = _median(list(sizes.values()))
        readable = {n for n, size in sizes.items() if median_size is not None and size >= t.floor_ratio * median_size}
        # The model's typical update: of parameters at their own scale (near-zero ones move by
        # more than their size in healthy training, and would inflate it).
        median_ratio = _median([r for n, r in ratios.items() if n in readable]) or _median(list(ratios.values()))
        for name, ratio in ratios.items():
            size = sizes.get(name)
            big = name in readable and ratio > t.exploding_update_ratio
            # One such step is enough when it lands the weights far beyond the model's own scale.
            far = big and size >= median_size / max(t.floor_ratio, 1e-12)
            self._run("exploding", subjects[name], step, big, 1 if far else t.exploding_steps, ratio, score=ratio)
            still = ratio == 0 or (median_ratio is not None and ratio < t.stalled_update_ratio * median_ratio)
            if name not in explained:  # (their own check keeps their run of stalled steps)
                self._run("stalled", subjects[name], step, still, t.stalled_steps, ratio)

    def _check_nonfinite(self, step: int, entries: Summary, bad: Mapping[Key, str]) -> None:
        first = self._nonfinite
        if first is not None and first.since <= step:
            # Caught by the sentinel on a step that was not logged: the next logged step, logged
            # in full, says where it is born when it comes again.
            if first.detail.startswith("caught") and "logged in full" not in first.detail and not any(
                    key.kind == Kind.CAUGHT for key in entries):
                again = _origin(entries, bad)
                if again is not None and not again[1].startswith("weights"):
                    first.detail += f"; at step {step}, logged in full after it: {again[1]}"
            return
        origin = _origin(entries, bad)
        if origin is not None:
            module, detail, value = origin
            before = [s for s in self._seen if s < step]
            exploding = any(c == "exploding" and t.start is not None for (c, _), t in self._tracks.items())
            if before and exploding:
                detail += f"; last finite logged step {before[-1]}, already exploding there"
            else:
                detail += f"; last clean logged step {before[-1]}" if before else "; no clean logged step before it"
            self._nonfinite = Row("nonfinite", module, step, value, detail, score=math.inf)

    @property
    def first_nonfinite(self) -> Row | None:
        """The ``nonfinite`` row: the first logged step with NaN/Inf and where they were born."""
        self._judge_pending()
        return self._nonfinite

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the report has learnt, in plain Python values (for a checkpoint)."""
        return {
            "version": _STATE_VERSION,
            "seen": list(self._seen),
            "flags": [asdict(f) for f in self._flags.values()],
            "tracks": [[c, label, t.start, t.length, list(t.values), t.last, t.score, list(t.subject)]
                       for (c, label), t in self._tracks.items()],
            "nonfinite": asdict(self._nonfinite) if self._nonfinite is not None else None,
            "order": dict(self._order),
            "sizes": dict(self._sizes),
            "zero_grads": sorted(self._zero_grads),
            "notes": [asdict(f) for f in self._notes.values()],
            "pending": [[step, [[str(key.kind), key.name, key.optimizer, dict(s)] for key, s in stats.items()]]
                        for step, stats in self._pending.items()],
            "lr_peaks": dict(self._lr_peaks),
            "no_grad": {name: list(v) for name, v in self._no_grad.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the thresholds stay this report's own).

        A state of version 1 (written before flags carried their kind and entry as fields) is
        read too, so a checkpoint of an earlier release resumes.

        Raises:
            ValueError: ``state`` is not a state of a version this report reads.
        """
        if isinstance(state, Mapping) and state.get("version") == 1:
            state = _from_version_1(state)
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict expected a state of version 1 or "
                             f"{_STATE_VERSION}, got {got!r}")
        self._seen = [int(s) for s in state["seen"]]
        self._flags = {(flag.flag, flag.name): flag for flag in (Flag(**f) for f in state["flags"])}
        self._tracks = {(c, label): _Track(start, length, list(values), last, score, _Subject(*subject))
                        for c, label, start, length, values, last, score, subject in state["tracks"]}
        row = state["nonfinite"]
        self._nonfinite = None if row is None else Row(**{**row, "consequences": [Flag(**f) for f in row["consequences"]]})
        self._order = dict(state["order"])
        self._sizes = dict(state["sizes"])
        self._zero_grads = set(state["zero_grads"])
        self._notes = {f["entry"]: Flag(**f) for f in state["notes"]}
        self._pending = {int(step): {Key(Kind(k), n, o): dict(s) for k, n, o, s in stats} for step, stats in state["pending"]}
        self._lr_peaks = dict(state.get("lr_peaks", {}))
        self._no_grad = {name: list(v) for name, v in state.get("no_grad", {}).items()}

    def _track(self, check: str, label: str) -> _Track:
        track = self._tracks.get((check, label))
        if track is None:
            track = self._tracks[(check, label)] = _Track()
        return track

    def _run(self, flag: str, subject: _Subject, step: int, bad: bool, needed: int, value: float,
             score: float = 0.0, reason: str = "") -> None:
        label = f"{subject.kind} {subject.entry}" if subject.kind else subject.entry
        track = self._tracks.get((flag, label))
        if track is None:
            track = self._tracks[(flag, label)] = _Track()
        if not bad:
            if track.start is not None:
                track.start, track.length = None, 0
            return
        if track.start is None:
            track.start = step
        track.length += 1
        track.last, track.score, track.subject = value, score, subject
        if track.length >= needed:
            previous = self._flags.get((flag, label))
            since = previous.since if previous else track.start
            worst = max(score, previous.score) if previous else score
            self._flags[(flag, label)] = Flag(flag, *subject[:2], since, value, subject.module, worst, reason)

    # -- reading the report ----------------------------------------------------------------
    def flags(self) -> list[Flag]:
        """Every flagged entry (the full table): non-finite first, then by flag, then by step."""
        self._judge_pending()
        found = sorted([*self._flags.values(), *self._stalled_behind_dead()], key=lambda f: (FLAGS.index(f.flag), f.since, -f.score))
        first = self._nonfinite
        head = [Flag("nonfinite", "", first.module, first.since, first.value, first.module, math.inf)] if first else []
        return head + found

    def rows(self) -> list[Row]:
        """The grouped report: one row per flag per module (its entries folded in), worst first;
        upstream modules with the same flag, and stalled parameters of dead modules, under
        their cause; non-finite weights under the explosion that made them."""
        self._judge_pending()
        groups: dict[tuple[str, str], list[Flag]] = {}
        for f in self._flags.values():
            groups.setdefault((f.flag, f.module), []).append(f)
        rows = {key: _row(key, flags) for key, flags in groups.items()}
        order = self._order
        _fold_upstream(rows, groups, "dead", order)
        _fold_upstream(rows, groups, "vanishing", order)
        # Stalled parameters of a dead module, or whose gradient is all zero (downstream of a dead
        # layer): a consequence of the first dead layer.
        dead = sorted((r for r in rows.values() if r.flag == "dead"), key=lambda r: r.since)
        for (flag, module), row in list(rows.items()):
            stalled = groups[(flag, module)]
            if flag == "stalled" and dead and not any(f.reason for f in stalled) and (
                ("dead", module) in groups or all(f.entry in self._zero_grads for f in stalled)
            ):
                cause = next((r for r in dead if r.module == module or any(c.module == module for c in r.consequences)), dead[0])
                cause.consequences += stalled
                del rows[(flag, module)]
        _fold_upstream(rows, groups, "stalled", order)
        # A weight whose gradient is exactly zero because its input is (downstream of a dead
        # layer) is no redundant parameter: it is stalled, under the dead layer.
        if dead:
            dead[0].consequences += self._stalled_behind_dead()
        ranked = sorted(rows.values(), key=lambda r: (FLAGS.index(r.flag), -r.score, r.since, order.get(r.module, 0)))
        if self._nonfinite is None:
            return ranked
        first = self._nonfinite
        earlier = [r for r in ranked if r.flag == "exploding" and r.since <= first.since]
        made_by_updates = first.detail.startswith(("weights already non-finite", "the optimizer step"))
        if earlier and made_by_updates:
            # The weights went non-finite through the updates of an explosion: name the
            # explosion, where it was seen, with the non-finite weights as its consequence.
            cause = min(earlier, key=lambda r: (r.since, -r.score))
            cause.consequences.append(Flag("nonfinite", "", first.module, first.since, first.value, first.module,
                                           math.inf, first.detail))
            return [cause] + [r for r in ranked if r is not cause]
        detail = first.detail
        if earlier:
            modules = len({r.module for r in earlier})
            detail += f"; preceded by exploding since step {min(r.since for r in earlier)} on {counted(modules, 'module')}"
        return [Row("nonfinite", first.module, first.since, first.value, detail, score=math.inf)] + ranked

    def notes(self) -> list[Flag]:
        """What is worth knowing and is no problem: parameters that get no gradient by
        construction (``note`` entries, in backward order). Never a flag, never ``--fail-on``."""
        self._judge_pending()
        behind_dead = set(map(id, self._behind_dead()))
        return sorted((f for f in self._notes.values() if id(f) not in behind_dead),
                      key=lambda f: (self._order.get(f.module, 0), f.name))

    def _behind_dead(self) -> list[Flag]:
        """Notes of parameters whose gradient is exactly zero, when a module is dead: a weight
        whose input is zero, not a redundant parameter."""
        if not any(f.flag == "dead" for f in self._flags.values()):
            return []
        return [f for f in self._notes.values() if f.entry in self._zero_grads]

    def _stalled_behind_dead(self) -> list[Flag]:
        return [Flag("stalled", str(Kind.PARAM), n.entry, n.since, 0.0, n.module) for n in self._behind_dead()]

    def names(self, flags: set[str] | None = None) -> set[str]:
        """The flags present (optionally only among ``flags``)."""
        present = {f.flag for f in self.flags()}
        return present if flags is None else present & flags


@functools.lru_cache(maxsize=1 << 16)
def _ancestors(module: str) -> tuple[str, ...]:
    """``"a.b.c"`` -> ``("a", "a.b", "a.b.c")``: outermost first."""
    parts = module.split(".")
    return tuple(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=256)
def _common_module(modules: tuple[str, ...]) -> str:
    """The innermost module holding all of ``modules`` (``(model)`` for the model itself)."""
    split = [m.split(".") for m in modules]
    common = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common) or "(model)"


def _middle(values: list[float]) -> float:
    """``statistics.median`` of a non-empty list, without its checks (a few values per entry per step)."""
    ordered, half = sorted(values), len(values) // 2
    return ordered[half] if len(values) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return _statistics.median(values) if len(values) > 2 else None


def _fold_upstream(rows: dict[tuple[str, str], Row], groups: dict[tuple[str, str], list[Flag]], flag: str,
                   order: dict[str, int]) -> None:
    """Fold the rows of ``flag`` under the first flagged module in backward order (the one
    nearest the loss): a module upstream of it flagged since the same step or later is one of
    its consequences (no gradient flows up through a dead layer; a vanishing one keeps
    shrinking; nothing moves where nothing arrives)."""
    # A row with a reason of its own (a parameter in no optimizer) is its own cause.
    flagged = sorted((r for (fl, m), r in rows.items() if fl == flag and not any(f.reason for f in groups[(fl, m)])),
                     key=lambda r: order.get(r.module, 0))
    causes: list[Row] = []
    for row in flagged:
        cause = next((c for c in causes if c.since <= row.since), None)
        if cause is None:
            causes.append(row)
            continue
        cause.consequences += groups[(flag, row.module)]
        del rows[(flag, row.module)]


def _row(key: tuple[str, str], flags: list[Flag]) -> Row:
    flag, module = key
    flags = sorted(flags, key=lambda f: (f.since, -f.score))
    worst = max(flags, key=lambda f: f.score)
    entries = [f.name for f in flags]
    if flag == "dead":
        detail = "output and parameter gradients all zero"
    elif flag == "stalled":
        reasons: dict[str, list[str]] = {}
        for f in flags:
            reasons.setdefault(f.reason or "update ratio 0 or far below the model's", []).append(f.entry)
        # A param group's row says what the group is; other rows list the parameters.
        detail = "; ".join(why if any(f.kind == PARAM_GROUP and f.reason == why for f in flags) else
                           f"{why}: {listed(names, 6)}" for why, names in reasons.items())
    else:
        detail = listed(entries, 4)
        if flag == "exploding":
            detail = f"worst x{worst.score:.3g}: " + detail
    return Row(flag, module, flags[0].since, worst.last, detail, entries, score=worst.score)


def _split_label(label: str) -> tuple[str, str]:
    """``"<kind> <entry>"`` (version 1's flag names and track labels) as ``(kind, entry)``; a
    module's own label has no kind."""
    kind, space, entry = label.partition(" ")
    return (kind, entry) if space else ("", label)


def _from_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 state (flags named ``"<kind> <entry>"``, summary keys ``(kind, name)`` with
    ``optimizer_<i>/`` in the name) in the shape of :data:`_STATE_VERSION`."""

    def flag(f: Mapping[str, Any]) -> dict[str, Any]:
        kind, entry = _split_label(f["name"])
        return {**{k: v for k, v in f.items() if k != "name"}, "kind": kind, "entry": entry}

    def subject(label: str) -> list[str]:
        kind, entry = _split_label(label)
        return [kind, entry, Key.of_label(kind, entry).module if kind else entry]

    row = state["nonfinite"]
    return {
        **state,
        "version": _STATE_VERSION,
        "flags": [flag(f) for f in state["flags"]],
        "tracks": [[c, label, start, length, values, last, score, subject(label)]
                   for c, label, start, length, values, last, score in state["tracks"]],
        "nonfinite": None if row is None else {**row, "consequences": [flag(f) for f in row["consequences"]]},
        "notes": [flag(f) for f in state["notes"]],
        "pending": [[step, [[k, key.name, key.optimizer, s] for k, n, s in stats for key in [Key.of_label(k, n)]]]
                    for step, stats in state["pending"]],
    }
