"""health/exploding.py: a gradient many times the median of its own last values."""

from health_steps import drive, flagged, grads

from lightning_gradhooks.health.exploding import Exploding
from lightning_gradhooks.health.thresholds import Thresholds


def series(big: float, at: int = 3, steps: int = 6) -> dict:
    return {n: grads({"a": big if n >= at else 1.0, "b": 1.0, "c": 1.0}) for n in range(steps)}


def test_exploding_after_two_logged_steps_at_100_times_the_baseline():
    check = Exploding(Thresholds())
    assert flagged(drive(check, series(1e3))) == [("exploding", "grad_output a", 3)]
    assert flagged(drive(Exploding(Thresholds()), series(50.0))) == []


def test_the_baseline_survives_a_resume():
    first = Exploding(Thresholds())
    drive(first, {n: grads({"a": 1.0, "b": 1.0, "c": 1.0}) for n in range(3)})
    resumed = Exploding(Thresholds())
    resumed.load_state_dict(first.state_dict())
    late = {n: grads({"a": 1e3, "b": 1.0, "c": 1.0}) for n in (3, 4)}
    assert flagged(drive(resumed, late)) == [("exploding", "grad_output a", 3)]
