"""A gradient scaler's skipped steps: counted while they are its business, ``nonfinite`` once the
skipping persists. Pure Python."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.summary.text import counted
from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Row
from lightning_gradhooks.health.origin import origin
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Key, Kind

#: Where a step's summary holds what its gradient scaler did (``GradientLog.write_scaler``).
SCALER = Key(Kind.SCALER, "loss_scale")


def power_of_two(scale: float) -> str:
    """A scale as people read it: ``2^-20`` for a power of two (as a scaler's are), else 3 digits.

    Example:
        >>> power_of_two(2.0 ** -20), power_of_two(3000.0), power_of_two(0.0)
        ('2^-20', '3e+03', '0')
    """
    if scale > 0 and math.isfinite(scale):
        mantissa, exponent = math.frexp(scale)
        if mantissa == 0.5:
            return f"2^{exponent - 1}"
    return f"{scale:.3g}"


class ScalerSkips(Check):
    """A logged step whose gradient scaler skipped the optimizer step (its scale after
    ``update()`` is lower than the step's: it found non-finite gradients) is the scaler's
    business, not a fault: counted (one note at the end: :meth:`note`), and the step is left to
    no other ``nonfinite`` judgement (``step.scaler_skipped``).

    The skipping is a fault once it persists: the scaler skipped every step for
    ``scaler_skip_steps`` optimizer steps in a row after it had found a working scale (a run
    that begins at the start of training is a scale that starts too high, coming down), or its
    scale fell below ``scaler_min_scale``. Steps between logged ones count as skipped when the
    scale fell by the scaler's backoff factor at each of them. Then the ``nonfinite`` row is the
    run's: its first logged step, where the NaN/Inf were born there, and that training has
    stopped. A run that ends (a step the scaler takes again, at a scale not collapsed) takes its
    row back: the scaler found its scale.

    Stepping with weights that are already non-finite is no scaler's business: such a step is
    left to :class:`~lightning_gradhooks.health.nonfinite.NonFinite`.

    State: the counts, the first and latest scale, the run of skipped steps. Writes: ``step.scaler_skipped``.
    """

    name = "scaler"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.logged = 0  # logged steps the scaler was told of
        self.skipped = 0  # of them, skipped
        self.first: float | None = None  # the scale at the first of them
        self.last: float | None = None  # the scale after the latest
        self.worked = False  # a logged step the scaler did not skip was seen
        self.previous: tuple[int, float] | None = None  # the latest told step and the scale after it, if skipped
        self.run: dict[str, Any] | None = None  # the run of skipped steps going on
        self.flagged = False  # the tracker's nonfinite row is this run's

    def __call__(self, step: Step, tracker: Tracker) -> None:
        at = step.layout.position.get(SCALER)
        if at is None:
            return
        told = step.entry(at)
        scale, new = told["scale"], told["new_scale"]
        self.logged += 1
        self.first = scale if self.first is None else self.first
        self.last = new
        previous, self.previous = self.previous, None
        if not new < scale:  # the scaler stepped
            self.worked = True
            self._end(tracker, new)
            return
        self.skipped += 1
        if any(key.kind == Kind.WEIGHTS for key in step.bad):
            return  # the weights are gone: the scaler's skipping is not what went wrong
        step.scaler_skipped = True
        self.previous = (step.number, new)
        backoff = new / scale
        if self.run is None or previous is None or not scale <= previous[1] * backoff ** (
                step.number - previous[0] - 1) * (1 + 1e-6):
            self._end(tracker, new)  # a step between was taken: a new run begins here
            found = origin(step.entries, step.bad)
            module, detail, value = found if found is not None else (
                "", "non-finite gradients that the logged statistics do not show", 0.0)
            last_clean = f"; last clean logged step {step.previous}" if step.previous is not None else ""
            self.run = {"start": step.number, "module": module, "detail": detail, "value": value,
                        "last_clean": last_clean if self.worked else ""}
        run, t = self.run, self.thresholds
        persists = (self.worked and step.number - run["start"] + 1 >= t.scaler_skip_steps) or new < t.scaler_min_scale
        if persists and (tracker.nonfinite is None or self.flagged):
            tracker.nonfinite = Row("nonfinite", run["module"], run["start"], run["value"],
                                    f"{run['detail']}; the gradient scaler has skipped every step since {run['start']} "
                                    f"(scale now {power_of_two(new)}): training has stopped{run['last_clean']}",
                                    score=math.inf)
            self.flagged = True

    def _end(self, tracker: Tracker, scale: float) -> None:
        """End the run going on: its row is taken back unless the scale collapsed."""
        if self.flagged and scale >= self.thresholds.scaler_min_scale:
            tracker.nonfinite = None
        self.run, self.flagged = None, False

    def note(self) -> str | None:
        """How many logged steps the scaler skipped, and its scale at the first and now."""
        if not self.skipped:
            return None
        return (f"note: the gradient scaler skipped {self.skipped} of {counted(self.logged, 'logged step')} (non-finite "
                f"gradients of the scaled loss: it skips the step and lowers its scale, by design); its scale went "
                f"from {power_of_two(self.first)} to {power_of_two(self.last)}")

    def state_dict(self) -> dict[str, Any]:
        return {"logged": self.logged, "skipped": self.skipped, "first": self.first, "last": self.last,
                "worked": self.worked, "previous": list(self.previous) if self.previous else None,
                "run": dict(self.run) if self.run else None, "flagged": self.flagged}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.logged, self.skipped = int(state["logged"]), int(state["skipped"])
        self.first, self.last, self.worked = state["first"], state["last"], bool(state["worked"])
        self.previous = tuple(state["previous"]) if state["previous"] else None
        self.run = dict(state["run"]) if state["run"] else None
        self.flagged = bool(state["flagged"])
