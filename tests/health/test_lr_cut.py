"""health/lr_cut.py: a param group whose learning rate is cut to 0 stalls, one row for the group."""

from health_steps import drive, flagged

from lightning_gradhooks.health.lr_cut import LrCut
from lightning_gradhooks.health.thresholds import Thresholds


def group(lr: float) -> dict:
    return {("param", f"enc.{i}.weight"): {"group": 0.0, "lr": lr} for i in range(2)}


def test_a_cut_learning_rate_stalls_its_group_after_stalled_steps():
    tracker = drive(LrCut(Thresholds()), {0: group(0.1), 1: group(0.0), 2: group(0.0), 3: group(0.0)})
    assert flagged(tracker) == [("stalled", "param_group param_groups[0]", 1)]
    assert next(iter(tracker.flags.values())).module == "enc"


def test_a_learning_rate_that_decays_normally_is_no_cut():
    assert flagged(drive(LrCut(Thresholds()), {n: group(0.1 / (n + 1)) for n in range(5)})) == []
