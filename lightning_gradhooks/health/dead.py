"""``dead``: a module whose output and parameter gradients are all zero. Python and numpy."""

from __future__ import annotations

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.core.records import Kind


_KINDS = [str(Kind.GRAD_OUTPUT), str(Kind.PARAM_GRAD)]


class Dead(Check):
    """A module whose output gradient and parameter gradients are all (at least
    ``dead_zero_fraction``) exactly zero, ``dead_steps`` logged steps in a row."""

    name = "dead"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, layout = self.thresholds, step.layout
        zero = step.column("zero_fraction", -1.0)  # (a fraction: never -1)
        chosen = np.flatnonzero(step.finite & (zero != -1.0) & np.isin(layout.kinds, _KINDS))
        zeros: dict[str, list[float]] = {}
        for i, fraction in zip(chosen.tolist(), zero[chosen].tolist()):
            zeros.setdefault(layout.modules[i], []).append(fraction)
        modules = list(zeros)
        tracker.run_many("dead", [Subject("", module, module) for module in modules], modules, step.number,
                         [(i, t.dead_steps, min(values), 0.0) for i, values in enumerate(zeros.values())
                          if all(z >= t.dead_zero_fraction for z in values)])
