"""``nonfinite``: the first logged step with NaN/Inf, and where they were born. Pure Python."""

from __future__ import annotations

import math

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Row
from lightning_gradhooks.health.origin import origin
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind


class NonFinite(Check):
    """One row, at the first logged step with a non-finite entry (:func:`origin`), saying where
    they were born and what came before (the last clean step, an explosion already running).

    A step caught by the sentinel but not logged tells only the parameters: the next logged step
    without a catch that is non-finite again, logged in full, adds where they are born.

    Reads ``step.scaler_skipped``. Writes: ``step.first_nonfinite``.
    """

    name = "nonfinite"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        if step.scaler_skipped or not step.bad:  # the scaler's business (ScalerSkips); a finite step
            return
        first = tracker.nonfinite
        if first is not None and first.since <= step.number:
            if first.detail.startswith("caught") and "logged in full" not in first.detail and not any(
                    key.kind == Kind.CAUGHT for key in step.layout.keys):
                again = origin(step.entries, step.bad)
                if again is not None and not again[1].startswith("weights"):
                    first.detail += f"; at step {step.number}, logged in full after it: {again[1]}"
            return
        found = origin(step.entries, step.bad)
        if found is None:
            return
        module, detail, value = found
        if step.previous is not None and tracker.running("exploding"):
            detail += f"; last finite logged step {step.previous}, already exploding there"
        else:
            detail += f"; last clean logged step {step.previous}" if step.previous is not None else "; no clean logged step before it"
        tracker.nonfinite = Row("nonfinite", module, step.number, value, detail, score=math.inf)
        step.first_nonfinite = first is None
