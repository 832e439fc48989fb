"""The health report under fp16 with a gradient scaler, on real Lightning fits (CPU autocast,
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", ...))``): the scaler's skipped steps
are a note, for fused and unfused Adam; an overflow that stays is ``nonfinite`` at its step,
born where it was; the report command prints the same and ``--fail-on`` ignores the note.
Models: tests/helpers/report_panel.py."""

from __future__ import annotations

import pytest

import report_panel as panel


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_a_scale_that_starts_too_high_is_one_note_and_fails_nothing(tmp_path, optimizer):
    report, text, log_dir, model = panel.fit(tmp_path, lambda seed: panel.fp16_mlp(seed, optimizer), steps=30,
                                             every=1, trainer={"init_scale": 2.0 ** 40})
    assert report.rows() == [] and report.flags() == [], text
    clean, note = text.splitlines()
    assert clean == "GradHooks: no gradient problems seen in 30 logged steps."
    assert note.startswith("note: the gradient scaler skipped 23 of 30 logged steps") and "from 2^40 to 2^17" in note
    assert model.losses[-1] < model.losses[0]  # it trains once the scale has come down
    code, out, err = panel.cli("report", log_dir, "--fail-on", "nonfinite")
    assert code == 0 and panel.without_noise(out).rstrip().endswith(text), err


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_an_overflow_that_stays_is_nonfinite_since_its_step_born_in_the_forward(tmp_path, optimizer):
    make = lambda seed: panel.fp16_mlp(seed, optimizer, events={15: panel.weight_times("net.blowup", 1e6)})  # noqa: E731
    report, text, log_dir, _ = panel.fit(tmp_path, make, steps=25, every=1, trainer={"init_scale": 2.0 ** 16})
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("nonfinite", "net.blowup", 15)
    assert row.detail.startswith("born in the forward of `net.blowup`; the gradient scaler has skipped every step "
                                 "since 15 (scale now 2^6): training has stopped"), text
    code, out, _ = panel.cli("report", log_dir, "--fail-on", "nonfinite")
    assert code == 1 and panel.without_noise(out).rstrip().endswith(text)
