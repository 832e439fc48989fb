"""health/activation_growth.py: an output RMS many times its own early level."""

from health_steps import drive, flagged

from lightning_gradhooks.health import HealthReport
from lightning_gradhooks.health.activation_growth import ActivationGrowth
from lightning_gradhooks.health.thresholds import Thresholds


def outputs(**scales: float) -> dict:
    return {("output", name.replace("_", ".")): {"rms": value} for name, value in scales.items()}


def series(values: list[float]) -> dict:
    return {10 * n: outputs(a=v, b=1.0, c=1.0) for n, v in enumerate(values)}


def test_flagged_after_two_logged_steps_at_100_times_the_early_level():
    tracker = drive(ActivationGrowth(Thresholds()), series([1.0, 1.2, 0.9, 5.0, 150.0, 400.0, 2e3]))
    assert flagged(tracker) == [("activation_growth", "output a", 40)]
    assert flagged(drive(ActivationGrowth(Thresholds()), series([1.0, 1.2, 0.9, 50.0, 90.0, 60.0]))) == []


def test_a_branch_that_starts_below_the_models_scale_is_read_from_where_it_reaches_it():
    # A LayerScale branch (init 1e-4) growing to the model's scale: no growth over its early level.
    grows = [1e-4, 1e-3, 1e-2, 0.2, 0.5, 0.8, 1.0, 1.0]
    assert flagged(drive(ActivationGrowth(Thresholds()), series(grows))) == []
    check = ActivationGrowth(Thresholds())
    drive(check, series(grows))
    assert check.early.state_dict()["output a"] == [0.2, 0.5, 0.8]



def test_an_output_that_starts_below_the_models_scale_is_read_against_the_models_scale():
    # The logits of a fresh head (at 0.2, above the floor of 0.1 x the model's 1.0, so read as its
    # early level) growing to 40 as it learns: 200x its own early level but 40x the model's early
    # scale, not growth; the same head at 150 is.
    learns = [0.2, 0.2, 0.2, 0.5, 2.0, 10.0, 40.0, 40.0]
    assert flagged(drive(ActivationGrowth(Thresholds()), series(learns))) == []
    assert flagged(drive(ActivationGrowth(Thresholds()), series(learns[:5] + [150.0, 200.0]))) == [
        ("activation_growth", "output a", 50)]
    # Where the model itself starts small, its own early level is kept.
    small = {10 * n: outputs(a=v, b=0.01, c=0.01) for n, v in enumerate([0.01, 0.01, 0.01, 2.0, 2.0])}
    assert flagged(drive(ActivationGrowth(Thresholds()), small)) == [("activation_growth", "output a", 30)]

def test_without_output_statistics_nothing_is_said():
    steps = {n: {("grad_output", "a"): {"mean": 0.0, "std": 10.0 ** n}, ("attention_logit", "a"): {"max": 5.0}}
             for n in range(6)}
    assert flagged(drive(ActivationGrowth(Thresholds()), steps)) == []


def test_the_factor_and_the_early_length_are_thresholds():
    values = [1.0, 2.0, 3.0, 40.0, 60.0]
    loose = ActivationGrowth(Thresholds(activation_factor=10.0, activation_early_steps=2))
    assert flagged(drive(loose, series(values))) == [("activation_growth", "output a", 30)]  # level 1.5
    assert flagged(drive(ActivationGrowth(Thresholds(activation_factor=30.0)), series(values))) == []  # level 2


def test_the_early_level_survives_a_resume():
    first = ActivationGrowth(Thresholds())
    drive(first, series([1.0, 1.0, 1.0]))
    resumed = ActivationGrowth(Thresholds())
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict() == {"early": first.early.state_dict(), "model": [1.0, 1.0, 1.0]}
    late = {n: outputs(a=500.0, b=1.0, c=1.0) for n in (30, 40)}
    assert flagged(drive(resumed, late)) == [("activation_growth", "output a", 30)]
    # A state saved before the model's scale was kept: learnt again from the next steps.
    older = ActivationGrowth(Thresholds())
    older.load_state_dict({"early": first.early.state_dict()})
    assert flagged(drive(older, late)) == [("activation_growth", "output a", 30)] and older.model == [1.0, 1.0]


def test_a_gradient_flag_downstream_of_it_says_it_came_after():
    report = HealthReport()
    for n in range(8):
        scale = 1.0 if n < 3 else 10.0 ** n
        stats = {("grad_output", "head"): {"mean": 0.0, "std": 1.0 if n < 5 else 1e4},
                 ("grad_output", "blocks.1"): {"mean": 0.0, "std": 1.0},
                 ("grad_output", "blocks.0"): {"mean": 0.0, "std": 1.0},  # backward order: blocks.0 is upstream
                 ("output", "blocks.0"): {"rms": scale}, ("output", "blocks.1"): {"rms": 1.0},
                 ("output", "head"): {"rms": 1.0}}
        report.add_stats(n, stats)
    rows = {r.flag: r for r in report.rows()}
    growth = rows["activation_growth"]
    assert (growth.module, growth.since) == ("blocks.0", 3)
    assert growth.detail.startswith("the output RMS grew past 100x its early level (worst x")
    assert "QK-norm" not in growth.detail  # no remedy the literature does not name
    assert rows["exploding"].detail.endswith("; after the output RMS of `blocks.0` grew past 100x its early level at step 3")


def test_growth_that_compounds_block_after_block_is_one_row_where_it_began():
    report = HealthReport()
    for n in range(6):
        stats = {("grad_output", f"blocks.{i}"): {"mean": 0.0, "std": 1.0} for i in (3, 2, 1, 0)}  # backward order
        stats |= {("output", f"blocks.{i}"): {"rms": 1.0 if n < 3 else 1e3 * 2.0 ** i} for i in range(4)}
        report.add_stats(n, stats)
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("activation_growth", "blocks.0", 3)
    assert [f.module for f in row.consequences] == ["blocks.1", "blocks.2", "blocks.3"]
    assert "follows from it (downstream): activation_growth: blocks.1, blocks.2, blocks.3" in report.table()
