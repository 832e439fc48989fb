"""What the user reads: the CLI's --help, counts in the report and the CLI, pattern errors."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
import torch.nn as nn

from lightning_gradhooks.__main__ import _parser
from lightning_gradhooks.core.monitor import select_modules
from lightning_gradhooks.summary.text import counted
from lightning_gradhooks.health import HealthReport, Thresholds


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        _parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_help_is_plain_text_with_a_sentence_for_each_threshold(capsys):
    top, report = _help(capsys), _help(capsys, "report", ".")
    for text in (top, report):
        assert "``" not in text and not re.search(r":(class|mod|func|meth|attr):", text)
    flat = " ".join(report.split())  # argparse wraps lines
    for f in fields(Thresholds):
        option = f"--{f.name.replace('_', '-')}"
        sentence = re.search(re.escape(option) + r" [NX] ([A-Z][^.]*(?:\.\d+[^.]*)*\.) Default: ", flat)
        assert sentence, f"{option} has no sentence of its own in --help"
        assert len(sentence.group(1).split()) >= 6


def test_counted_is_singular_for_one():
    assert counted(1, "logged step") == "1 logged step"
    assert counted(0, "logged step") == "0 logged steps"
    assert counted(2, "flagged entry", "flagged entries") == "2 flagged entries"
    assert counted(1, "flagged entry", "flagged entries") == "1 flagged entry"


def _dead_for(steps: int) -> HealthReport:
    report = HealthReport(Thresholds(dead_steps=1))
    for step in range(steps):
        report.add_stats(step, {
            ("grad_output", "alive"): {"mean": 0.0, "std": 1.0},
            ("grad_output", "dead"): {"mean": 0.0, "std": 0.0, "zero_fraction": 1.0},
        })
    return report


def test_the_report_says_1_logged_step_and_1_module():
    report = _dead_for(1)
    table, full, markdown = report.table(), report.table(full=True), report.markdown()
    assert table.startswith("GradHooks: dead on 1 module in 1 logged step (worst first")
    assert full.startswith("GradHooks: 1 flagged entry in 1 logged step:")
    assert "1 logged steps" not in table + full + markdown and "1 modules" not in table
    assert _dead_for(2).table().startswith("GradHooks: dead on 1 module in 2 logged steps ")


def test_a_clean_report_of_one_step_is_singular():
    report = HealthReport()
    report.add_stats(0, {("grad_output", "m"): {"mean": 0.0, "std": 1.0}})
    assert report.table() == "GradHooks: no gradient problems seen in 1 logged step."
    assert report.markdown() == "No gradient problems seen in 1 logged step."


class _Wrapper(nn.Module):
    """A LightningModule-like shape: the network held as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.encoder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.model.head = nn.Linear(2, 1)


def test_an_include_pattern_that_matches_nothing_suggests_the_prefixed_pattern():
    with pytest.raises(ValueError, match=re.escape('did you mean "model.encoder.*"?')) as raised:
        select_modules(_Wrapper(), include=["encoder.*"])
    assert "'encoder.*' matches no module" in str(raised.value)
    with pytest.raises(ValueError, match=re.escape('did you mean "model.head"?')):
        select_modules(_Wrapper(), include=["head"])


def test_no_suggestion_where_no_prefix_helps():
    with pytest.raises(ValueError) as raised:
        select_modules(_Wrapper(), include=["decoder.*"])
    assert "did you mean" not in str(raised.value)
