"""``vanishing``: a gradient far below the model's own scale, while learning stops with it. Python and numpy."""

from __future__ import annotations

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class Vanishing(Check):
    """A gradient whose RMS is below ``vanishing_ratio`` times the median RMS of its kind at the
    same step, while the parameters it reaches move by less than ``vanishing_update_ratio`` of
    the model's median update (or no update was measured), ``vanishing_steps`` logged steps in a
    row. Reads ``step.quiet``: round-off and unowned parameters are not judged."""

    name = "vanishing"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, gradients = self.thresholds, step.gradients
        indices, subjects, labels = gradients.judged(step.quiet)
        values, medians = gradients.rms[indices], gradients.medians[indices]
        low = np.flatnonzero(values < t.vanishing_ratio * medians)  # NaN: no value, or no median: never low
        low = low[~step.moving[gradients.at[indices[low]]]]
        tracker.run_many("vanishing", subjects, labels, step.number, low, t.vanishing_steps, values[low],
                         medians[low] / values[low])
