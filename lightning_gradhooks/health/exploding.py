"""``exploding``: a gradient many times its own recent median. Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.series import Series
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class Exploding(Check):
    """A gradient whose RMS is ``exploding_factor`` times the median of its own last
    ``exploding_window`` logged values, ``exploding_steps`` logged steps in a row. Values below
    ``floor_ratio`` of the model's median (same kind, same step) are not read, and do not enter
    the baseline: growth from a near-zero start (attention's query and key at uniform attention,
    a LoRA adapter) to the model's own scale is no explosion. Reads ``step.quiet``.

    State: each entry's last values (the baseline), in ``history``.
    """

    name = "exploding"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.history = Series(thresholds.exploding_window)

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, gradients = self.thresholds, step.gradients
        indices, subjects, labels = gradients.judged(step.quiet, ~np.isnan(gradients.rms))
        rows = self.history.of(labels)
        values, medians = gradients.rms[indices], gradients.medians[indices]
        # The others: not read, not in the baseline (a NaN median: every value read).
        read = np.flatnonzero(~(values < t.floor_ratio * medians))
        at, value = rows[read], values[read]
        baseline = self.history.median(at)
        grown = np.flatnonzero(value > t.exploding_factor * baseline)  # (NaN: no values yet)
        self.history.add(at, value)
        tracker.run_many("exploding", subjects, labels, step.number, read[grown], t.exploding_steps, value[grown],
                         value[grown] / baseline[grown])

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history.load_state_dict(state["history"])
