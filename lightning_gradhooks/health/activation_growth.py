"""``activation_growth``: a module's output RMS many times its own early level. Python and numpy."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step, median
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.core.records import Kind


class ActivationGrowth(Check):
    """An ``output`` entry (``GradHooks(activations=True)``) whose RMS is ``activation_factor``
    times its early level, ``activation_steps`` logged steps in a row. The early level is the
    median of its first ``activation_early_steps`` logged values at the model's scale: values
    below ``floor_ratio`` of the step's median output RMS (a zero- or tiny-initialised branch, a
    LayerScale of 1e-4, a LoRA adapter growing to its own scale) are not read, as for
    ``exploding``. Without output statistics (``activations=False``) there is nothing to read
    and nothing is said.

    State: each entry's early values (its level, once it has ``activation_early_steps``).
    """

    name = "activation_growth"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.early: dict[str, list[float]] = {}  # subject label -> its first values at the model's scale

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t = self.thresholds
        at = step.layout.of_kind(Kind.OUTPUT)
        values = step.column("rms")[at]
        with np.errstate(invalid="ignore"):
            at, values = at[np.isfinite(values) & (values > 0)].tolist(), values[np.isfinite(values) & (values > 0)].tolist()
        middle = median(values)
        for i, value in zip(at, values):
            subject = step.layout.subjects[i]
            early = self.early.setdefault(subject.label, [])
            full = len(early) >= t.activation_early_steps
            level = statistics.median(early) if full else None
            grown = level is not None and value > t.activation_factor * level
            tracker.run("activation_growth", subject, step.number, grown, t.activation_steps, value,
                        score=value / level if grown else 0.0, reason=f"grew past {t.activation_factor:g}x its early level")
            if not full and (middle is None or value >= t.floor_ratio * middle):
                early.append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"early": {label: list(values) for label, values in self.early.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.early = {label: [float(v) for v in values] for label, values in state["early"].items()}
