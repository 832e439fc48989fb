"""health/nonfinite.py and origin.py: the first non-finite logged step and where it was born."""

from health_steps import drive

from lightning_gradhooks.health.nonfinite import NonFinite
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.origin import nonfinite_origin
from lightning_gradhooks.summary.records import Key, Kind

CLEAN = {("grad_output", "b"): {"norm": 1.0}, ("grad_output", "a"): {"norm": 1.0}}
BAD = {("grad_output", "b"): {"norm": 1.0}, ("grad_output", "a"): {"nonfinite": 4.0}}


def test_one_row_at_the_first_nonfinite_step_naming_the_last_clean_one():
    tracker = drive(NonFinite(Thresholds()), {0: CLEAN, 10: BAD, 20: BAD})
    row = tracker.nonfinite
    assert (row.flag, row.module, row.since) == ("nonfinite", "a", 10)
    assert row.detail.startswith("born in backward") and row.detail.endswith("last clean logged step 0")


def test_the_loss_when_the_first_gradient_of_backward_is_bad():
    module, detail, value = nonfinite_origin({Key(Kind.GRAD_OUTPUT, "a"): {"nonfinite": 2.0}})
    assert (module, value) == ("a", 2.0) and detail.startswith("the loss")
    assert nonfinite_origin({Key(Kind.GRAD_OUTPUT, "a"): {"norm": 1.0}}) is None
