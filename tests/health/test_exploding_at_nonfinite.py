"""health/exploding_at_nonfinite.py: an explosion one step before NaN is named though it had no time to last."""

from health_steps import drive, flagged

from lightning_gradhooks.health.exploding_at_nonfinite import ExplodingAtNonfinite
from lightning_gradhooks.health.flags import Subject
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker


def test_a_running_explosion_is_flagged_at_the_first_nonfinite_step_only():
    tracker = Tracker()
    tracker.run("exploding", Subject("grad_output", "a", "a"), 5, True, 2, 1e3, score=1e3)
    assert flagged(drive(ExplodingAtNonfinite(Thresholds()), {10: {}}, tracker)) == []
    drive(ExplodingAtNonfinite(Thresholds()), {10: {}}, tracker, first_nonfinite=True)
    assert flagged(tracker) == [("exploding", "grad_output a", 5)]
