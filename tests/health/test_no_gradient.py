"""health/no_gradient.py: a parameter in an optimizer whose .grad is None, and that nothing moves."""

from health_steps import drive, flagged

from lightning_gradhooks.health.no_gradient import NoGradient
from lightning_gradhooks.health.thresholds import Thresholds


def none(norm: float = 3.0) -> dict:
    return {("param", "branch.weight"): {"group": 0.0, "no_gradient": 1.0, "param_norm": norm},
            ("param", "trunk.weight"): {"group": 0.0, "no_gradient": 0.0, "param_norm": 1.0}}


def test_stalled_since_the_first_step_without_a_gradient():
    tracker = drive(NoGradient(Thresholds()), {0: none(), 10: none(), 20: none()})
    assert flagged(tracker) == [("stalled", "param branch.weight", 0)]
    assert "gets no gradient" in next(iter(tracker.flags.values())).reason


def test_moved_by_something_else_is_no_stall():
    assert flagged(drive(NoGradient(Thresholds()), {0: none(3.0), 10: none(3.1), 20: none(3.2)})) == []
