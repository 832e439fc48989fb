"""``exploding``: a gradient many times its own recent median. Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class Exploding(Check):
    """A gradient whose RMS is ``exploding_factor`` times the median of its own last
    ``exploding_window`` logged values, ``exploding_steps`` logged steps in a row. Values below
    ``floor_ratio`` of the model's median (same kind, same step) are not read, and do not enter
    the baseline: growth from a near-zero start (attention's query and key at uniform attention,
    a LoRA adapter) to the model's own scale is no explosion. Reads ``step.quiet``.

    State: each entry's last values (the baseline): one row per entry in ``history`` (the
    values first, then +inf), their number in ``count``.
    """

    name = "exploding"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.rows: dict[str, int] = {}  # subject label -> its row, in the order first judged
        self.history = np.zeros((0, thresholds.exploding_window))
        self.count = np.zeros(0, dtype=np.int64)
        self._seen: dict[int, tuple[Sequence[str], np.ndarray]] = {}  # lists of labels judged, and their rows

    def _rows(self, labels: Sequence[str]) -> np.ndarray:
        """The rows of ``labels`` (new ones get rows, in order); a list seen before costs nothing."""
        seen = self._seen.get(id(labels))
        if seen is not None and seen[0] is labels:
            return seen[1]
        rows = self.rows
        found = np.fromiter(map(rows.get, labels, repeat(-1)), dtype=np.int64, count=len(labels))
        new = np.flatnonzero(found < 0)
        if len(new):
            for i in new.tolist():
                found[i] = rows[labels[i]] = len(rows)
            more = len(rows) - len(self.count)
            self.history = np.concatenate([self.history, np.full((more, self.history.shape[1]), np.inf)])
            self.count = np.concatenate([self.count, np.zeros(more, dtype=np.int64)])
        if len(self._seen) >= 16:
            self._seen.clear()
        self._seen[id(labels)] = (labels, found)
        return found

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, gradients = self.thresholds, step.gradients
        indices, subjects, labels = gradients.judged(step.quiet, ~np.isnan(gradients.rms))
        rows = self._rows(labels)
        values, medians = gradients.rms[indices], gradients.medians[indices]
        with np.errstate(invalid="ignore"):  # (a NaN median: None, every value read)
            read = np.flatnonzero(~(values < t.floor_ratio * medians))  # the others: not read, not in the baseline
        at, value = rows[read], values[read]
        count = self.count[at]
        ordered = np.sort(self.history[at], axis=1)  # (+inf after the values)
        line, half = np.arange(len(at)), count // 2
        with np.errstate(invalid="ignore"):
            baseline = np.where(count % 2 == 1, ordered[line, half], (ordered[line, np.maximum(half - 1, 0)]
                                                                       + ordered[line, half]) / 2)
            grown = np.flatnonzero((count > 0) & (value > t.exploding_factor * baseline))
        self._append(at, value)
        tracker.run_many("exploding", subjects, labels, step.number, read[grown], t.exploding_steps, value[grown],
                         value[grown] / baseline[grown])

    def _append(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Add a value to each of ``rows``, keeping the last ``exploding_window``."""
        history, count, window = self.history, self.count, self.thresholds.exploding_window
        full = count[rows] >= history.shape[1]
        shifting = rows[full]
        history[shifting, :-1] = history[shifting, 1:]
        history[shifting, -1] = values[full]
        growing = rows[~full]
        history[growing, count[growing]] = values[~full]
        count[growing] += 1
        for row in np.flatnonzero(count > window).tolist():  # (a longer history loaded: cut to the window)
            kept = history[row, count[row] - window : count[row]].copy()
            history[row] = np.inf
            history[row, :window], count[row] = kept, window

    def state_dict(self) -> dict[str, Any]:
        return {"history": {label: self.history[row, : self.count[row]].tolist() for label, row in self.rows.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        histories = {label: list(values) for label, values in state["history"].items()}
        width = max([self.thresholds.exploding_window, *map(len, histories.values())])
        self.rows = {label: row for row, label in enumerate(histories)}
        self.history = np.full((len(histories), width), np.inf)
        self.count = np.array([len(values) for values in histories.values()], dtype=np.int64)
        for row, values in enumerate(histories.values()):
            self.history[row, : len(values)] = values
        self._seen = {}
