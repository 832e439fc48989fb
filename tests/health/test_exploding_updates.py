"""health/exploding_updates.py: an update ten times the weights it moves."""

from health_steps import drive, flagged

from lightning_gradhooks.health.exploding_updates import ExplodingUpdates
from lightning_gradhooks.health.thresholds import Thresholds


def params(ratio: float, norm: float = 8.0) -> dict:
    entries = {("param_grad", f"m{i}.weight"): {"mean": 0.0, "std": 1.0, "norm": 8.0} for i in range(4)}
    entries |= {("param", f"m{i}.weight"): {"update_ratio": 1e-3, "param_norm": 8.0} for i in range(3)}
    entries[("param", "m3.weight")] = {"update_ratio": ratio, "param_norm": norm}
    return entries


def test_two_big_updates_in_a_row_or_one_that_lands_far_away():
    assert flagged(drive(ExplodingUpdates(Thresholds()), {0: params(50.0)})) == []
    assert flagged(drive(ExplodingUpdates(Thresholds()), {0: params(50.0), 1: params(50.0)})) == [
        ("exploding", "param m3.weight", 0)]
    assert flagged(drive(ExplodingUpdates(Thresholds()), {0: params(50.0, norm=1e3)})) == [
        ("exploding", "param m3.weight", 0)]


def test_not_read_on_a_skipped_step():
    bad = params(50.0) | {("param_grad", "m0.weight"): {"nonfinite": 3.0}}
    assert flagged(drive(ExplodingUpdates(Thresholds()), {0: bad, 1: bad})) == []
