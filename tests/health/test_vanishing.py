"""health/vanishing.py: far below the model's median of its kind, while the update stalls too."""

from health_steps import drive, flagged, grads

from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.vanishing import Vanishing

SMALL = grads({"a": 1.0, "b": 1e-9, "c": 2.0})


def test_vanishing_after_vanishing_steps_and_not_before():
    assert flagged(drive(Vanishing(Thresholds()), dict.fromkeys(range(2), SMALL))) == []
    assert flagged(drive(Vanishing(Thresholds()), {0: SMALL, 1: SMALL, 2: SMALL})) == [("vanishing", "grad_output b", 0)]
    assert flagged(drive(Vanishing(Thresholds(vanishing_steps=4)), dict.fromkeys(range(3), SMALL))) == []


def test_quiet_parameters_are_not_judged():
    params = {("param_grad", f"m{i}.weight"): {"mean": 0.0, "std": 1.0} for i in range(3)}
    params[("param_grad", "m0.bias")] = {"mean": 0.0, "std": 1e-12}
    steps = dict.fromkeys(range(4), params)
    assert flagged(drive(Vanishing(Thresholds()), steps)) == [("vanishing", "param_grad m0.bias", 0)]
    assert flagged(drive(Vanishing(Thresholds()), steps, round_off={"m0.bias"})) == []
