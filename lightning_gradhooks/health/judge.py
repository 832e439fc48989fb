"""The judge: a step loop over :data:`CHECKS`. Pure Python.

Example:
    >>> judge = Judge()
    >>> for step in (0, 10, 20):  # a ReLU that lets no gradient through
    ...     judge.add_stats(step, {("grad_output", "relu"): {"zero_fraction": 1.0}})
    >>> [(f.flag, f.kind, f.entry, f.since) for f in judge.flags()]
    [('dead', '', 'relu', 0)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health import rows as grouping
from lightning_gradhooks.health.activation_growth import ActivationGrowth
from lightning_gradhooks.health.attention_logits import AttentionLogits
from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.dead import Dead
from lightning_gradhooks.health.exploding import Exploding
from lightning_gradhooks.health.exploding_at_nonfinite import ExplodingAtNonfinite
from lightning_gradhooks.health.exploding_updates import ExplodingUpdates
from lightning_gradhooks.health.flags import FLAGS, Flag, Row, Subject
from lightning_gradhooks.health.lr_cut import LrCut
from lightning_gradhooks.health.no_gradient import NoGradient
from lightning_gradhooks.health.nonfinite import NonFinite
from lightning_gradhooks.health.round_off import RoundOff
from lightning_gradhooks.health.scaler import ScalerSkips
from lightning_gradhooks.health.shape import Shape
from lightning_gradhooks.health.spikes import SpikeRows, is_spike
from lightning_gradhooks.health.stalled import Stalled
from lightning_gradhooks.health.step import Layout, Packed, Step, merged
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.health.unowned import Unowned
from lightning_gradhooks.health.vanishing import Vanishing
from lightning_gradhooks.summary.records import Key, Kind

#: The checks, in the order they judge each step: a check reads what those before it wrote on
#: the step (see :class:`~lightning_gradhooks.health.step.Step`).
CHECKS: tuple[type[Check], ...] = (
    ScalerSkips,  # writes scaler_skipped
    NonFinite,  # reads scaler_skipped; writes first_nonfinite
    Unowned,  # writes unowned
    RoundOff,  # writes round_off
    NoGradient,  # writes no_gradient
    LrCut,  # writes lr_cut
    Vanishing,  # reads quiet (round_off, unowned)
    Exploding,  # reads quiet
    Dead,
    ExplodingUpdates,  # reads updates (quiet)
    Stalled,  # reads updates, explained (no_gradient, lr_cut)
    ExplodingAtNonfinite,  # reads first_nonfinite; after every check that runs "exploding"
    AttentionLogits,  # the forward pass: reads no field
    ActivationGrowth,
)
#: The most keys whose subject a judge keeps (a model's entries; beyond it, the cache starts over).
_SUBJECTS_MAX = 1 << 16
#: The most layouts (sets of keys) a judge keeps: a model has one or a few.
_LAYOUTS_MAX = 64


#: The version of the state a judge writes and reads.
VERSION = 3


class Judge:
    """Accumulates logged steps and flags gradient problems (see :mod:`lightning_gradhooks.health`).

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
        self.tracker = Tracker()
        self.shape = Shape(self.thresholds.dead_zero_fraction)
        self.checks = tuple(check(self.thresholds) for check in CHECKS)
        self._seen: list[int] = []
        self._pending: dict[int, list[Packed]] = {}  # steps not judged yet: what was given for each
        self._subjects: dict[Key, Subject] = {}  # a cache: the subject of each key seen
        self._layouts: dict[tuple[Key, ...], Layout] = {}  # a cache: each set of keys seen, in order
        self._layout: Layout | None = None  # the latest (the next step's keys are most likely the same)
        self._merges: dict[tuple[int, ...], Any] = {}  # a cache of :func:`merged`
        self.spikes = SpikeRows()  # spikes between logged steps: rows of their own, not logged steps

    @property
    def steps(self) -> int:
        """The number of logged steps taken in."""
        return len(self._seen)

    def add_stats(self, step: int, stats: Mapping[tuple[str, ...], Mapping[str, float]] | Packed) -> None:
        """Take in statistics of logged step ``step``: its :data:`~lightning_gradhooks.summary.records.Summary`
        (:func:`~lightning_gradhooks.summary.records.step_summary`), or ``{(kind, name): {statistic: value}}``,
        in record order, or a :class:`~lightning_gradhooks.health.step.Packed` of it (the
        ``report`` command's, read from the log as numbers). Several calls for one step are
        merged (one step, counted once); a call for a later step judges the earlier ones. Statistics of a step already judged are
        ignored (a resume replays no step the report has seen). A spike's summary
        (:func:`~lightning_gradhooks.health.spikes.spike_summary`) is no logged step: it goes to
        :attr:`spikes`, whatever its step."""
        if is_spike(stats.keys if isinstance(stats, Packed) else stats):
            self.spikes.take(step, stats.summary() if isinstance(stats, Packed) else stats)
            return
        if step not in self._pending:
            if self._seen and step <= self._seen[-1]:
                return
            self._judge_pending()
            self._pending[step] = []
            self._seen.append(step)
        self._pending[step].append(stats.rounded() if isinstance(stats, Packed) else Packed.of(stats))

    def _judge_pending(self) -> None:
        for number in sorted(self._pending):
            self._judge(number, self._pending.pop(number))

    def _judge(self, number: int, parts: list[Packed]) -> None:
        packed = merged(parts, self._merges)
        subjects, layout = self._subjects, self._layout
        if layout is None or layout.keys != packed.keys:  # (the same keys: compared by identity first)
            layout = self._layout_of(packed.keys)
        previous = next((s for s in reversed(self._seen) if s < number), None)
        # One errstate for the step: its arrays hold NaN (not told) and inf, and the checks compare and divide them.
        with np.errstate(all="ignore"):
            step = Step(number, packed, previous, subjects, self.shape, self.thresholds, layout)
            self.shape.learn(step.layout, step.column)
            for check in self.checks:
                check(step, self.tracker)

    def _layout_of(self, keys: list[Key]) -> Layout:
        """The layout of a step with ``keys``, made once per set of keys."""
        subjects = self._subjects
        layout = self._layouts.get(tuple(keys))
        if layout is None:
            if len(subjects) > _SUBJECTS_MAX or len(self._layouts) >= _LAYOUTS_MAX:  # names that keep changing: start over
                subjects.clear()
                self._layouts.clear()
            for key in keys:
                if key not in subjects:
                    subjects[key] = Subject.of(key)
            layout = self._layouts[tuple(keys)] = Layout(keys, subjects)
        self._layout = layout
        return layout

    # -- reading the report ----------------------------------------------------------------
    @property
    def first_nonfinite(self) -> Row | None:
        """The ``nonfinite`` row: the first logged step with NaN/Inf and where they were born."""
        self._judge_pending()
        return self.tracker.nonfinite

    def flags(self) -> list[Flag]:
        """Every flagged entry (the full table): non-finite first, then by flag, then by step."""
        self._judge_pending()
        return sorted(grouping.all_flags(self.tracker, self.shape) + self.spikes.flags(),
                      key=lambda f: (f.flag != "nonfinite" or f.score != float("inf"), FLAGS.index(f.flag), f.since))

    def rows(self) -> list[Row]:
        """The grouped report (:func:`~lightning_gradhooks.health.rows.rows`), worst first."""
        self._judge_pending()
        rows = grouping.rows(self.tracker, self.shape)
        spikes = self.spikes.rows(self._seen)
        return sorted(rows + spikes, key=lambda r: FLAGS.index(r.flag)) if spikes else rows

    def notes(self) -> list[Flag]:
        """What is worth knowing and is no problem: parameters that get no gradient by
        construction (``note`` entries, in backward order). Never a flag, never ``--fail-on``."""
        self._judge_pending()
        return grouping.notes(self.tracker, self.shape)

    def check_notes(self) -> list[str]:
        """The checks' lines for the end of the report (a gradient scaler's skipped steps): never a
        flag, never ``--fail-on``."""
        self._judge_pending()
        return [line for check in self.checks if (line := check.note()) is not None]

    def names(self, flags: set[str] | None = None) -> set[str]:
        """The flags present (optionally only among ``flags``)."""
        present = {f.flag for f in self.flags()}
        return present if flags is None else present & flags

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the judge has learnt, in plain Python values (for a checkpoint)."""
        return {
            "version": VERSION,
            "seen": list(self._seen),
            "pending": [[step, [[str(key.kind), key.name, key.optimizer, s] for key, s in merged(parts, {}).summary().items()]]
                        for step, parts in self._pending.items()],
            "tracker": self.tracker.state_dict(),
            "shape": self.shape.state_dict(),
            "checks": {check.name: check.state_dict() for check in self.checks},
            "spikes": self.spikes.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the thresholds stay this judge's own).

        Raises:
            ValueError: ``state`` is not a judge's state of :data:`VERSION`.
        """
        version = state.get("version") if isinstance(state, Mapping) else None
        if version != VERSION:
            got = version if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict expected a state of version {VERSION}, got {got!r}")
        self._seen = [int(s) for s in state["seen"]]
        self._pending = {int(step): [Packed.of({Key(Kind(k), n, o): dict(s) for k, n, o, s in stats})]
                         for step, stats in state["pending"]}
        self.tracker.load_state_dict(state["tracker"])
        self.shape.load_state_dict(state["shape"])
        for check in self.checks:
            if check.name in state["checks"]:  # a check of a later release than the state starts fresh
                check.load_state_dict(state["checks"][check.name])
        self.spikes.load_state_dict(state.get("spikes", {}))
