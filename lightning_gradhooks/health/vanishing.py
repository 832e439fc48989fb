"""``vanishing``: a gradient far below the model's own scale, while learning stops with it. Pure Python."""

from __future__ import annotations

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.records import Kind


class Vanishing(Check):
    """A gradient whose RMS is below ``vanishing_ratio`` times the median RMS of its kind at the
    same step, while the parameters it reaches move by less than ``vanishing_update_ratio`` of
    the model's median update (or no update was measured), ``vanishing_steps`` logged steps in a
    row. Reads ``step.quiet``: round-off and unowned parameters are not judged."""

    name = "vanishing"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, quiet, medians, moving = self.thresholds, step.quiet, step.medians, step.moving
        for key, value in step.values.items():
            if key.kind == Kind.PARAM_GRAD and key.label in quiet:
                continue
            median = medians[key.kind]
            low = value is not None and median is not None and value < t.vanishing_ratio * median and not moving(key)
            tracker.run("vanishing", step.subjects[key], step.number, low, t.vanishing_steps, value or 0.0,
                        score=median / value if low else 0)
