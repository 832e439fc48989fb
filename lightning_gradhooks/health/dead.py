"""``dead``: a module whose output and parameter gradients are all zero. Python and numpy."""

from __future__ import annotations

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


class Dead(Check):
    """A module whose output gradient and parameter gradients are all (at least
    ``dead_zero_fraction``) exactly zero, ``dead_steps`` logged steps in a row."""

    name = "dead"

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, layout = self.thresholds, step.layout
        zero = step.column("zero_fraction", -1.0)  # (a fraction: never -1)
        chosen = np.flatnonzero(step.finite & (zero != -1.0) & layout.dead_kinds)
        modules = layout.module_ids[chosen]
        lowest = np.full(len(layout.module_names), np.inf)
        np.minimum.at(lowest, modules, zero[chosen])
        ids, first = np.unique(modules, return_index=True)
        ids = ids[np.argsort(first)]  # in the order of their first entry
        subjects, labels = layout.chosen(ids, "modules")
        lowest = lowest[ids]
        dead = np.flatnonzero(lowest >= t.dead_zero_fraction)
        tracker.run_many("dead", subjects, labels, step.number, dead, t.dead_steps, lowest[dead], 0.0)
