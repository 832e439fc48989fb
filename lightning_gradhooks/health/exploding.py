"""``exploding``: a gradient many times its own recent median. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.records import Kind


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
        t, quiet, medians = self.thresholds, step.quiet, step.medians
        for key, value in step.values.items():
            if value is None or (key.kind == Kind.PARAM_GRAD and key.label in quiet):
                continue
            subject, median = step.subjects[key], medians[key.kind]
            history = self.history.setdefault(subject.label, [])
            baseline = _middle(history) if history else None
            floor = median is not None and value < t.floor_ratio * median
            grown = baseline is not None and not floor and value > t.exploding_factor * baseline
            tracker.run("exploding", subject, step.number, grown, t.exploding_steps, value,
                        score=value / baseline if grown else 0)
            if not floor:
                history.append(value)
                del history[: -t.exploding_window]

    def state_dict(self) -> dict[str, Any]:
        return {"history": {label: list(values) for label, values in self.history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {label: list(values) for label, values in state["history"].items()}
