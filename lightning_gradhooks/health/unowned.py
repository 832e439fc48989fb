"""``stalled`` at once: a parameter that gets gradients but that no optimizer steps. Pure Python."""

from __future__ import annotations

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import UNOWNED
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind


class Unowned(Check):
    """Parameters logged with ``in_optimizer`` 0 are ``stalled`` (reason :data:`UNOWNED`) at the
    first logged step where they get a gradient.

    Writes: ``step.unowned`` (not judged by their gradient or update afterwards).
    """

    name = "unowned"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        params = step.layout.params
        unowned = params[step.column("in_optimizer", 1.0)[params] == 0.0].tolist()
        if not unowned:
            return
        grads = {key.label: s for key, s in step.entries.items() if key.kind == Kind.PARAM_GRAD}
        for key in (step.layout.keys[i] for i in unowned):
            step.unowned.add(key.label)
            gradient = grads.get(key.label, {})
            gets = gradient.get("norm", 0.0) > 0 or gradient.get("nonfinite", 0.0) > 0
            tracker.run("stalled", step.subjects[key], step.number, gets, 1, gradient.get("norm", 0.0), reason=UNOWNED)
