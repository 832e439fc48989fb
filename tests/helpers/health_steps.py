"""Hand-made logged steps for the checks of ``lightning_gradhooks.health`` (tests/health): a check
is driven with :func:`step` objects, one :class:`Tracker` for the run, no judge and no model."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.shape import Shape
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Key, Kind


def step(number: int, entries: Mapping[tuple, Mapping[str, float]], shape: Shape | None = None,
         thresholds: Thresholds | None = None, previous: int | None = None) -> Step:
    """A :class:`Step` of ``{(kind, name): {statistic: value}}`` (values taken as they are)."""
    thresholds = thresholds or Thresholds()
    summary = {Key(Kind(key[0]), *key[1:]): dict(stats) for key, stats in entries.items()}
    subjects = {key: Subject.of(key) for key in summary}
    shape = shape or Shape(thresholds.dead_zero_fraction)
    with np.errstate(all="ignore"):  # as the judge builds and reads a step (Judge.add)
        made = Step(number, summary, previous, subjects, shape, thresholds)
        shape.learn(made.layout, made.column)
    return made


def drive(check: Check, steps: Mapping[int, Mapping[tuple, Mapping[str, float]]], tracker: Tracker | None = None,
          **fields: object) -> Tracker:
    """Run ``check`` over ``{step number: entries}`` (in order), each step's ``fields`` (as earlier
    checks would write them) set first; the tracker it wrote to."""
    tracker = tracker or Tracker()
    shape, previous = Shape(check.thresholds.dead_zero_fraction), None
    for number, entries in steps.items():
        made = step(number, entries, shape, check.thresholds, previous)
        for name, value in fields.items():
            setattr(made, name, set(value) if isinstance(value, (set, list, tuple)) else value)
        with np.errstate(all="ignore"):
            check(made, tracker)
        previous = number
    return tracker


def flagged(tracker: Tracker) -> list[tuple[str, str, int]]:
    """``(flag, name, since)`` of every flag raised."""
    return [(f.flag, f.name, f.since) for f in tracker.flags.values()]


def grads(scales: Mapping[str, float], **extra: float) -> dict[tuple, dict[str, float]]:
    """``grad_output`` entries of modules with the given gradient RMS (std; mean 0)."""
    return {("grad_output", name): {"mean": 0.0, "std": scale, **extra} for name, scale in scales.items()}
