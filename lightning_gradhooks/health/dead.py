"""``dead``: a module whose output and parameter gradients are all zero. Pure Python."""

from __future__ import annotations

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.records import Kind


class Dead(Check):
    """A module whose output gradient and parameter gradients are all (at least
    ``dead_zero_fraction``) exactly zero, ``dead_steps`` logged steps in a row."""

    name = "dead"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t = self.thresholds
        zeros: dict[str, list[float]] = {}
        for key, s in step.entries.items():
            if key.kind in (Kind.GRAD_OUTPUT, Kind.PARAM_GRAD) and s.get("zero_fraction") is not None \
                    and key not in step.bad:
                zeros.setdefault(step.subjects[key].module, []).append(s["zero_fraction"])
        for module, values in zeros.items():
            dead = all(z >= t.dead_zero_fraction for z in values)
            tracker.run("dead", Subject("", module, module), step.number, dead, t.dead_steps, min(values))
