"""health/unowned.py: a parameter in no optimizer is stalled at its first gradient."""

from health_steps import drive, flagged, step

from lightning_gradhooks.health.flags import UNOWNED
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.health.unowned import Unowned

HEAD = {("param_grad", "head.weight"): {"norm": 2.0}, ("param", "head.weight"): {"in_optimizer": 0.0}}


def test_stalled_at_once_with_its_reason_and_told_to_the_next_checks():
    tracker = drive(Unowned(Thresholds()), {0: HEAD})
    assert flagged(tracker) == [("stalled", "param head.weight", 0)]
    assert next(iter(tracker.flags.values())).reason == UNOWNED
    made = step(0, HEAD)
    Unowned(Thresholds())(made, Tracker())
    assert made.unowned == {"head.weight"} and made.quiet == {"head.weight"}


def test_no_flag_while_it_gets_no_gradient():
    silent = {("param_grad", "head.weight"): {"norm": 0.0}, ("param", "head.weight"): {"in_optimizer": 0.0}}
    assert flagged(drive(Unowned(Thresholds()), {0: silent})) == []
