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
        cut = t.stalled_update_ratio * updates.median_ratio if updates.median_ratio is not None else None
        indices = [i for i, name in enumerate(updates.ratios) if name not in explained] if explained else None
        ratios = list(updates.ratios.values())
        subjects, labels = updates.subjects, updates.labels
        if indices is not None:
            ratios, subjects, labels = ([values[i] for i in indices] for values in (ratios, subjects, labels))
        tracker.run_many("stalled", subjects, labels, step.number,
                         [(i, t.stalled_steps, ratio, 0.0) for i, ratio in enumerate(ratios)
                          if ratio == 0 or (cut is not None and ratio < cut)])
