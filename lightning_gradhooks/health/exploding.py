"""``exploding``: a gradient many times its own recent median. Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


def _middle(values: list[float]) -> float:
    """The median of a non-empty list, without ``statistics.median``'s checks."""
    ordered, half = sorted(values), len(values) // 2
    return ordered[half] if len(values) % 2 else (ordered[half - 1] + ordered[half]) / 2


class Exploding(Check):
    """A gradient whose RMS is ``exploding_factor`` times the median of its own last
    ``exploding_window`` logged values, ``exploding_steps`` logged steps in a row. Values below
    ``floor_ratio`` of the model's median (same kind, same step) are not read, and do not enter
    the baseline: growth from a near-zero start (attention's query and key at uniform attention,
    a LoRA adapter) to the model's own scale is no explosion. Reads ``step.quiet``.

    State: each entry's last values (the baseline).
    """

    name = "exploding"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.history: dict[str, list[float]] = {}  # subject label -> its last values at the model's scale

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, gradients = self.thresholds, step.gradients
        indices, subjects, labels = gradients.judged(step.quiet, ~np.isnan(gradients.rms))
        histories, grown = self.history, []
        floor_ratio, factor, window = t.floor_ratio, t.exploding_factor, t.exploding_window
        for i, (label, value, median) in enumerate(zip(labels, gradients.rms[indices].tolist(),
                                                       gradients.medians[indices].tolist())):
            history = histories.setdefault(label, [])
            if value < floor_ratio * median:  # (False where the median is NaN: None)
                continue  # not read, not in the baseline
            if history and value > factor * (baseline := _middle(history)):
                grown.append((i, t.exploding_steps, value, value / baseline))
            history.append(value)
            del history[:-window]
        tracker.run_many("exploding", subjects, labels, step.number, grown)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {label: list(values) for label, values in self.history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {label: list(values) for label, values in state["history"].items()}
