"""``exploding`` named at the first non-finite step, however short it was. Pure Python."""

from __future__ import annotations

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class ExplodingAtNonfinite(Check):
    """At the first non-finite logged step (``step.first_nonfinite``), an explosion seen on the
    logged step before it (or on this one) is flagged even though it had no time to last: the
    next logged step was already NaN. Runs after every check that steps ``exploding`` runs."""

    name = "exploding_at_nonfinite"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        if step.first_nonfinite:
            tracker.promote("exploding")
