"""``activation_growth``: a module's output RMS many times its own early level. Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.series import Series
from lightning_gradhooks.health.step import Step, median
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind


class ActivationGrowth(Check):
    """An ``output`` entry (``GradHooks(activations=True)``) whose RMS is ``activation_factor``
    times its early level, ``activation_steps`` logged steps in a row. The early level is the
    median of its first ``activation_early_steps`` logged values at the model's scale: values
    below ``floor_ratio`` of the step's median output RMS (a zero- or tiny-initialised branch, a
    LayerScale of 1e-4, a LoRA adapter growing to its own scale) are not read, as for
    ``exploding``. An early level below the model's own (the median output RMS of its first
    ``activation_early_steps`` logged steps) is raised to it: an output that starts small (the
    logits of a fresh classifier head, a branch that reaches ``floor_ratio`` of the model's scale
    on its way up) and grows to the model's scale is learning, not blowing up; growth is then read
    against the model's early scale. Without output statistics (``activations=False``) there is
    nothing to read and nothing is said.

    State: each entry's early values (its level, once it has ``activation_early_steps``), in
    ``early``; the model's early medians, in ``model``.
    """

    name = "activation_growth"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.early = Series(thresholds.activation_early_steps)
        self.model: list[float] = []

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, layout = self.thresholds, step.layout
        at = layout.of_kind(Kind.OUTPUT)
        if not len(at):
            return
        values = step.column("rms")[at]
        told = np.isfinite(values) & (values > 0)
        at, values = at[told], values[told]
        middle = median(values.tolist())
        if middle is not None and len(self.model) < t.activation_early_steps:
            self.model.append(middle)
        subjects, labels = layout.chosen(at)
        rows = self.early.of(labels)
        full = self.early.count[rows] >= t.activation_early_steps
        level = self.early.median(rows)
        if self.model:
            level = np.maximum(level, float(np.median(self.model)))  # (NaN, no level yet, stays NaN)
        grown = np.flatnonzero(full & (values > t.activation_factor * level))
        tracker.run_many("activation_growth", subjects, labels, step.number, grown, t.activation_steps, values[grown],
                         values[grown] / level[grown], reason=f"grew past {t.activation_factor:g}x its early level")
        adding = ~full & (values >= t.floor_ratio * middle) if middle is not None else ~full
        self.early.add(rows[adding], values[adding])

    def state_dict(self) -> dict[str, Any]:
        return {"early": self.early.state_dict(), "model": list(self.model)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.early.load_state_dict(state["early"])
        self.model = [float(v) for v in state.get("model", ())]  # (a state saved before it: learnt again)
