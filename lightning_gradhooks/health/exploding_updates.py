"""``exploding`` from the optimizer step: an update many times the size of the weights it moves.
Python and numpy."""

from __future__ import annotations

import math

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class ExplodingUpdates(Check):
    """An ``update_ratio`` above ``exploding_update_ratio`` on a parameter at the model's own
    scale (``floor_ratio``), ``exploding_steps`` logged steps in a row; one such update is
    enough when it lands the weights beyond ``1 / floor_ratio`` times the model's median
    parameter RMS. Not read on a skipped step (``step.skipped``); reads ``step.updates``."""

    name = "exploding_updates"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        if step.skipped:
            return
        t, updates = self.thresholds, step.updates
        far = updates.median_size / max(t.floor_ratio, 1e-12) if updates.median_size is not None else math.inf
        big = np.flatnonzero((updates.ratios > t.exploding_update_ratio) & updates.readable)
        needed = np.where(updates.sizes[big] >= far, 1, t.exploding_steps)
        subjects, labels = step.layout.chosen(updates.at)
        tracker.run_many("exploding", subjects, labels, step.number, big, needed, updates.ratios[big], updates.ratios[big])
