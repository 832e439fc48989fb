"""health/scaler.py: a gradient scaler's skipped steps are counted, and ``nonfinite`` once the
skipping persists. Driven through the judge (the check decides which steps ``NonFinite`` judges)."""

import pytest

from lightning_gradhooks.health import Judge, Thresholds
from lightning_gradhooks.health.report import render_table
from lightning_gradhooks.health.scaler import power_of_two

CLEAN = {("grad_output", "head"): {"norm": 1.0}, ("grad_output", "body"): {"norm": 1.0}}
OVERFLOW = {("grad_output", "head"): {"nonfinite": 8.0}, ("grad_output", "body"): {"nonfinite": 8.0}}
BLOWUP = {("forward", "blowup"): {"nonfinite": 4.0}, **OVERFLOW}


def told(entries: dict, scale: float, new_scale: float) -> dict:
    return {**entries, ("scaler", "loss_scale"): {"scale": scale, "new_scale": new_scale}}


def fit(judge: Judge, steps: dict[int, dict]) -> Judge:
    for number, entries in steps.items():
        judge.add_stats(number, entries)
    return judge


def too_high(start: float = 2.0 ** 40, skips: int = 25, steps: int = 40, every: int = 1) -> dict[int, dict]:
    """A scaler that starts at ``start`` and halves on each of its first ``skips`` steps."""
    out, scale = {}, start
    for n in range(steps):
        if n < skips:
            if n % every == 0:
                out[n] = told(OVERFLOW, scale, scale / 2)
            scale /= 2
        elif n % every == 0:
            out[n] = told(CLEAN, scale, scale)
    return out


def test_a_scale_that_starts_too_high_is_a_note_not_a_flag():
    judge = fit(Judge(), too_high())
    assert judge.rows() == [] and judge.names() == set() and judge.first_nonfinite is None
    (note,) = judge.check_notes()
    assert note.startswith("note: the gradient scaler skipped 25 of 40 logged steps") and note.endswith("from 2^40 to 2^15")
    text = render_table(judge)
    assert text.splitlines() == ["GradHooks: no gradient problems seen in 40 logged steps.", note]


def skipping_from(at: int, steps: int, every: int = 1, scale: float = 2.0 ** 16, entries: dict = BLOWUP) -> dict[int, dict]:
    """Clean steps, then every step skipped from ``at`` on (logged every ``every``)."""
    out = {}
    for n in range(steps):
        skipped = n >= at
        if n % every == 0:
            out[n] = told(entries if skipped else CLEAN, scale, scale / 2 if skipped else scale)
        scale = scale / 2 if skipped else scale
    return out


def test_skipping_that_persists_is_nonfinite_since_its_first_step_born_where_it_was():
    assert fit(Judge(), skipping_from(40, 47)).rows() == []  # 7 skipped steps: still the scaler's business
    judge = fit(Judge(), skipping_from(40, 48))
    (row,) = judge.rows()
    assert (row.flag, row.module, row.since) == ("nonfinite", "blowup", 40)
    assert row.detail == ("born in the forward of `blowup`; the gradient scaler has skipped every step since 40 "
                          "(scale now 2^8): training has stopped; last clean logged step 39")
    assert judge.names({"nonfinite"}) == {"nonfinite"}


def test_the_steps_between_logged_ones_count_when_the_scale_fell_at_each():
    (row,) = fit(Judge(), skipping_from(40, 51, every=10)).rows()  # logged 40 and 50: 11 steps skipped
    assert (row.module, row.since) == ("blowup", 40) and "(scale now 2^5)" in row.detail
    steps = skipping_from(40, 51, every=10)
    steps[50] = told(BLOWUP, 2.0 ** 14, 2.0 ** 13)  # the scale did not fall at every step between: taken ones
    assert fit(Judge(), steps).rows() == []


def test_a_collapsed_scale_is_nonfinite_even_in_a_run_from_the_start():
    judge = fit(Judge(), too_high(start=2.0 ** 4, skips=6, steps=6))
    (row,) = judge.rows()
    assert (row.module, row.since) == ("head", 0) and "(scale now 2^-2): training has stopped" in row.detail
    assert fit(Judge(Thresholds(scaler_min_scale=2.0 ** -3)), too_high(start=2.0 ** 4, skips=6, steps=6)).rows() == []


def test_a_run_that_ends_takes_its_row_back_and_the_note_counts_it():
    steps = skipping_from(10, 30, entries=OVERFLOW)
    judge = fit(Judge(), {n: s for n, s in steps.items() if n < 20})
    assert [r.since for r in judge.rows()] == [10]  # persisting, so far
    scale = steps[19][("scaler", "loss_scale")]["new_scale"]
    for n in range(20, 25):
        judge.add_stats(n, told(CLEAN, scale, scale))  # the scaler found its scale: training goes on
    assert judge.rows() == [] and judge.check_notes()[0].startswith("note: the gradient scaler skipped 10 of 25")


def test_nonfinite_weights_and_steps_no_scaler_was_told_of_are_flagged_at_once():
    weights = {("weights", "body"): {"nonfinite": 1.0}, **OVERFLOW}
    judge = fit(Judge(), {0: told(CLEAN, 8.0, 8.0), 1: told(weights, 8.0, 4.0)})
    assert [(r.module, r.since) for r in judge.rows()] == [("body", 1)]
    assert [r.since for r in fit(Judge(), {0: CLEAN, 1: OVERFLOW}).rows()] == [1]


def test_the_run_survives_a_resume():
    steps = skipping_from(40, 48)
    first = fit(Judge(), {n: s for n, s in steps.items() if n < 44})
    resumed = Judge()
    resumed.load_state_dict(first.state_dict())
    fit(resumed, {n: s for n, s in steps.items() if n >= 44})
    assert render_table(resumed) == render_table(fit(Judge(), steps))


@pytest.mark.parametrize("field, value", [("scaler_skip_steps", 0), ("scaler_min_scale", 0.0),
                                          ("scaler_min_scale", float("inf"))])
def test_thresholds_are_range_checked(field, value):
    with pytest.raises(ValueError, match=f"Thresholds.{field}` expected"):
        Thresholds(**{field: value})


def test_power_of_two():
    assert [power_of_two(v) for v in (65536.0, 2.0 ** -20, 0.75, 0.0)] == ["2^16", "2^-20", "0.75", "0"]
