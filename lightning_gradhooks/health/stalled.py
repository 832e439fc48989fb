"""``stalled``: a parameter that does not move. Pure Python."""

from __future__ import annotations

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
        for name, ratio in updates.ratios.items():
            if name in explained:
                continue
            still = ratio == 0 or (updates.median_ratio is not None and ratio < t.stalled_update_ratio * updates.median_ratio)
            tracker.run("stalled", step.subjects[updates.keys[name]], step.number, still, t.stalled_steps, ratio)
