"""``dead``: a module whose output and parameter gradients are all zero. Pure Python."""

from __future__ import annotations

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.records import Kind


_KINDS = (Kind.GRAD_OUTPUT, Kind.PARAM_GRAD)


class Dead(Check):
    """A module whose output gradient and parameter gradients are all (at least
    ``dead_zero_fraction``) exactly zero, ``dead_steps`` logged steps in a row."""

    name = "dead"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, bad, subjects = self.thresholds, step.bad, step.subjects
        zeros: dict[str, list[float]] = {}
        for key, s in step.entries.items():
            if key.kind in _KINDS and (zero := s.get("zero_fraction")) is not None and key not in bad:
                zeros.setdefault(subjects[key].module, []).append(zero)
        modules = list(zeros)
        tracker.run_many("dead", [Subject("", module, module) for module in modules], modules, step.number,
                         [(i, t.dead_steps, min(values), 0.0) for i, values in enumerate(zeros.values())
                          if all(z >= t.dead_zero_fraction for z in values)])
