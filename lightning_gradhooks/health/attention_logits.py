"""``attention_logits``: attention logits past a level no healthy run reaches, still rising. Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind


class AttentionLogits(Check):
    """A module's maximum attention logit (``attention_logit`` entries: the largest scaled
    ``q·kᵀ`` the softmax saw) above ``attention_logit_level`` and higher than at the logged step
    before, ``attention_steps`` logged steps in a row. The flag's ``since`` is the logged step
    where the logit went above the level (and stayed there). Healthy runs stay below it (the
    validation's: 30-45 with QK-norm at a learning rate of 0.1, a causal LM without QK-norm at
    0.01 creeping from 10 to 125 over 400 steps, past Megatron's QK-clip threshold of 100); the
    unstable runs pass it within ten steps and go on to 1e4-1e5. A logit that is not a number
    (the forward is NaN) is the ``nonfinite`` check's, not read.

    State: each entry's last value and the logged steps it went above the level and the healthy range.
    """

    name = "attention_logits"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.last: dict[str, float] = {}  # subject label -> its latest maximum
        self.above: dict[str, int] = {}  # subject label -> the logged step it went above the level
        self.left: dict[str, int] = {}  # subject label -> the logged step it left the healthy range (and stayed out)

    def __call__(self, step: Step, tracker: Tracker) -> None:
        t, layout = self.thresholds, step.layout
        at = layout.of_kind(Kind.ATTENTION_LOGIT)
        if not len(at):
            return
        values = step.column("max")[at]
        at, values = at[~np.isnan(values)], values[~np.isnan(values)]  # (not logged, or the forward is NaN)
        _, labels = layout.chosen(at)
        groups: dict[tuple[int, int], list[int]] = {}  # (left the healthy range, passed the level) -> rising ones
        quiet = []
        for i, (label, value) in enumerate(zip(labels, values.tolist())):
            previous = self.last.get(label)
            self.last[label] = value
            for bound, since in ((t.attention_logit_level, self.above), (t.attention_logit_healthy, self.left)):
                if value <= bound:
                    since.pop(label, None)
                else:
                    since.setdefault(label, step.number)
            if label in self.above and previous is not None and value > previous:
                key = (self.left.get(label, self.above[label]), self.above[label])
                groups.setdefault(key, []).append(i)
            else:
                quiet.append(i)
        # One call per onset, so that each row says its own steps; each subject in exactly one call.
        if quiet:
            tracker.run_many("attention_logits", *layout.chosen(at[quiet]), step.number, [], t.attention_steps, [])
        for (left, passed), rising in groups.items():
            reason = (f"passed {t.attention_logit_healthy:g} at step {left} and {t.attention_logit_level:g} at step {passed}"
                      if left < passed else f"passed {t.attention_logit_level:g} at step {passed}")
            tracker.run_many("attention_logits", *layout.chosen(at[rising]), step.number, range(len(rising)),
                             t.attention_steps, values[rising], values[rising] / t.attention_logit_level, reason=reason,
                             began=[left] * len(rising))

    def state_dict(self) -> dict[str, Any]:
        return {"last": dict(self.last), "above": dict(self.above), "left": dict(self.left)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last = {label: float(v) for label, v in state["last"].items()}
        self.above = {label: int(v) for label, v in state["above"].items()}
        self.left = {label: int(v) for label, v in state["left"].items()}
