"""health/stalled.py: a parameter whose update ratio is 0 or far below the model's."""

from health_steps import drive, flagged

from lightning_gradhooks.health.stalled import Stalled
from lightning_gradhooks.health.thresholds import Thresholds

STILL = {("param", f"m{i}.weight"): {"update_ratio": 1e-3, "param_norm": 1.0} for i in range(3)}
STILL[("param", "frozen.weight")] = {"update_ratio": 0.0, "param_norm": 1.0}


def test_stalled_after_three_logged_steps():
    assert flagged(drive(Stalled(Thresholds()), dict.fromkeys(range(2), STILL))) == []
    assert flagged(drive(Stalled(Thresholds()), dict.fromkeys(range(3), STILL))) == [("stalled", "param frozen.weight", 0)]


def test_a_stall_explained_by_another_check_is_not_judged_here():
    assert flagged(drive(Stalled(Thresholds()), dict.fromkeys(range(3), STILL), lr_cut={"frozen.weight"})) == []
    assert flagged(drive(Stalled(Thresholds()), dict.fromkeys(range(3), STILL), unowned={"frozen.weight"})) == []
