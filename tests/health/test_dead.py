"""health/dead.py: a module whose output and parameter gradients are all zero, three logged steps in a row."""

from health_steps import drive, flagged

from lightning_gradhooks.health.dead import Dead
from lightning_gradhooks.health.thresholds import Thresholds

ZERO = {("grad_output", "relu"): {"zero_fraction": 1.0}, ("param_grad", "relu.bias"): {"zero_fraction": 0.995}}
ALIVE = {("grad_output", "relu"): {"zero_fraction": 0.5}}


def test_dead_after_three_logged_steps_since_the_first():
    assert flagged(drive(Dead(Thresholds()), {0: ZERO, 10: ZERO})) == []
    assert flagged(drive(Dead(Thresholds()), {0: ZERO, 10: ZERO, 20: ZERO})) == [("dead", "relu", 0)]


def test_a_live_step_starts_the_run_over_and_a_partly_live_module_is_not_dead():
    assert flagged(drive(Dead(Thresholds()), {0: ZERO, 10: ALIVE, 20: ZERO, 30: ZERO})) == []
    half = {**ZERO, ("param_grad", "relu.weight"): {"zero_fraction": 0.2}}
    assert flagged(drive(Dead(Thresholds()), dict.fromkeys(range(5), half))) == []
