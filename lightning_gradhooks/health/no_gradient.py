"""``stalled``: parameters in an optimizer whose ``.grad`` is None when it steps, and that
nothing else moves. Pure Python."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker


@functools.lru_cache(maxsize=1 << 16)
def ancestors(module: str) -> tuple[str, ...]:
    """``"a.b.c"`` -> ``("a", "a.b", "a.b.c")``: outermost first."""
    parts = module.split(".")
    return tuple(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))


class NoGradient(Check):
    """Parameters that require grad and sit in an optimizer, whose ``.grad`` is None when it
    steps (``no_gradient``), and that nothing else moves either (their norm unchanged since the
    first logged step without a gradient): ``stalled``, one row per outermost module whose
    measured parameters all have no gradient, naming the module nearest the loss among them;
    flagged since that first step.

    State: each parameter without a gradient: the first step of it and its norm then.
    Writes: ``step.no_gradient``: every parameter without a gradient at this step (one an EMA
    or another rule moves is no problem, and is not judged by its update).
    """

    name = "no_gradient"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.since: dict[str, list[float]] = {}  # parameter -> [first step without .grad, its norm then]

    def __call__(self, step: Step, tracker: Tracker) -> None:
        params = step.layout.params
        measured_at = params[step.column("group", -1.0)[params] != -1.0]  # (a group is an index: never -1)
        none = step.no_gradient
        none.update(step.layout.names[i] for i in measured_at[step.column("no_gradient")[measured_at] == 1.0].tolist())
        for name in list(self.since):
            if name not in none:
                del self.since[name]
        if not none:  # (most steps)
            return
        measured = [(step.layout.keys[i], step.entries[step.layout.keys[i]]) for i in measured_at.tolist()]
        subjects = step.subjects
        # Every module: are all the measured parameters under it without a gradient?
        whole: dict[str, bool] = {}
        for key, _ in measured:
            for module in ancestors(subjects[key].module):
                whole[module] = whole.get(module, True) and key.label in none
        roots = {key.label: next(m for m in ancestors(subjects[key].module) if whole[m])
                 for key, _ in measured if key.label in none}
        nearest = {roots[k.label]: k.module for k, _ in measured if k.label in roots}
        for key, s in measured:
            if key.label not in none:
                continue
            norm = s.get("param_norm", math.nan)
            start, before = self.since.setdefault(key.label, [float(step.number), norm])
            still = before == norm and start < step.number  # unmoved since the first logged step without it
            if not still:
                self.since[key.label] = [float(step.number), norm]
            root = roots[key.label]
            reason = (f"gets no gradient (`.grad` is None when its optimizer steps, and nothing else moves it): its "
                      f"output (nearest the loss: `{nearest[root]}`) does not reach the loss through autograd: a "
                      f"`.detach()`, `torch.no_grad()`, or a branch the loss does not use")
            tracker.run("stalled", Subject(str(key.kind), key.label, root), step.number, still,
                        max(1, self.thresholds.stalled_steps - 1), 0.0, reason=reason, began=int(start))

    def state_dict(self) -> dict[str, Any]:
        return {"since": {name: list(v) for name, v in self.since.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.since = {name: list(v) for name, v in state["since"].items()}
