"""``stalled``: a parameter that does not move. Python and numpy."""

from __future__ import annotations

import math

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class Stalled(Check):
    """An ``update_ratio`` of 0, or below ``stalled_update_ratio`` times the model's median,
    ``stalled_steps`` logged steps in a row. Parameters whose stall has a cause of its own
    (``step.explained``: no gradient, a cut learning rate; their checks keep their runs) are not
    judged here. Not read on a skipped step (``step.skipped``); reads ``step.updates``."""

    name = "stalled"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        if step.skipped:
            return
        t, updates, explained = self.thresholds, step.updates, step.explained
        cut = t.stalled_update_ratio * updates.median_ratio if updates.median_ratio is not None else -math.inf
        at, ratios = updates.at, updates.ratios
        if explained:
            judged = ~step.layout.named(explained)[at]
            at, ratios = at[judged], ratios[judged]
        subjects, labels = step.layout.chosen(at)
        bad = np.flatnonzero((ratios == 0) | (ratios < cut))
        tracker.run_many("stalled", subjects, labels, step.number, bad, t.stalled_steps, ratios[bad], 0.0)
