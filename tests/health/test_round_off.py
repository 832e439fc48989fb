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


def kept_compiled(bias_norm: float, weight_norm: float = 1.0) -> dict:
    """A Linear of 16 x 16 whose module statistics are not told (kept compiled): parameter gradients only."""
    return {("param_grad", "k.weight"): {"mean": 0.0, "std": weight_norm / 16, "norm": weight_norm},
            ("param_grad", "k.bias"): {"mean": 0.0, "std": bias_norm / 4, "norm": bias_norm}}


def test_without_module_statistics_a_bias_at_round_off_of_its_weights_gradient_is_a_note():
    tracker = drive(RoundOff(Thresholds()), dict.fromkeys(range(3), kept_compiled(3e-8)))
    assert flagged(tracker) == [] and list(tracker.notes) == ["k.bias"]
    for bias, weight in ((1e-3, 1.0), (1.0, 1e-9), (0.0, 0.0)):  # a real bias; a weight behind a vanishing input
        assert drive(RoundOff(Thresholds()), dict.fromkeys(range(3), kept_compiled(bias, weight))).notes == {}
