"""``exploding`` from the optimizer step: an update many times the size of the weights it moves.
Pure Python."""

from __future__ import annotations

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
        far = updates.median_size / max(t.floor_ratio, 1e-12) if updates.median_size is not None else None
        big = [(i, 1 if far is not None and updates.sizes[name] >= far else t.exploding_steps, ratio, ratio)
               for i, (name, ratio) in enumerate(updates.ratios.items())
               if ratio > t.exploding_update_ratio and name in updates.readable]
        tracker.run_many("exploding", updates.subjects, updates.labels, step.number, big)
