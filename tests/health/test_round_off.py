"""health/round_off.py: a gradient at float round-off next to its module's is a note, never a flag."""

from health_steps import drive, flagged, step

from lightning_gradhooks.health.round_off import RoundOff
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker


def layer(bias_norm: float) -> dict:
    return {("grad_output", "ln"): {"mean": 0.0, "std": 1.0, "norm": 8.0},  # 64 elements
            ("param_grad", "ln.bias"): {"mean": 0.0, "std": bias_norm / 8, "norm": bias_norm}}


def test_a_note_after_vanishing_steps_and_the_parameter_is_quiet_at_once():
    tracker = drive(RoundOff(Thresholds()), dict.fromkeys(range(3), layer(1e-9)))
    assert flagged(tracker) == [] and list(tracker.notes) == ["ln.bias"]
    made = step(0, layer(1e-9))
    RoundOff(Thresholds())(made, Tracker())
    assert made.round_off == {"ln.bias"}


def test_a_real_gradient_is_no_round_off():
    tracker = drive(RoundOff(Thresholds()), dict.fromkeys(range(3), layer(1.0)))
    assert tracker.notes == {}
