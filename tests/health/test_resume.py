"""The report's state: it resumes as if never stopped, and a state of another version is refused clearly."""

import json
from pathlib import Path

import pytest

from lightning_gradhooks.health import HealthReport
from lightning_gradhooks.health.judge import VERSION
from lightning_gradhooks.summary.records import Key

DATA = Path(__file__).parent / "data"


def summary(entries):  # noqa: ANN001, ANN201
    return {Key.of_label(kind, name): stats for kind, name, stats in entries}


def test_a_checkpoint_of_an_unknown_state_version_is_refused_clearly():
    with pytest.raises(ValueError, match="expected a state of version 3, got 99"):
        HealthReport().load_state_dict({"version": 99})


def test_todays_state_round_trips_through_json():
    saved = json.loads((DATA / "dead_relu_steps.json").read_text())
    report = HealthReport()
    for step, entries in saved["steps"][:10]:
        report.add_stats(step, summary(entries))
    state = json.loads(json.dumps(report.state_dict()))
    assert state["version"] == VERSION and set(state["checks"]) >= {"exploding", "round_off", "lr_cut", "no_gradient"}
    again = HealthReport()
    again.load_state_dict(state)
    for step, entries in saved["steps"]:
        report.add_stats(step, summary(entries))
        again.add_stats(step, summary(entries))
    assert again.table(full=True) == report.table(full=True)


def _forward_steps() -> list:
    """A run whose attention logits pass 100 at step 20 and 1000 at step 40 and whose block 0 output
    grows from step 40."""
    steps = []
    for n in range(8):
        stats = {Key("grad_output", f"blocks.{i}"): {"mean": 0.0, "std": 1.0} for i in (1, 0)}
        stats[Key("attention_logit", "blocks.0.attn")] = {"max": 10.0 * 4.0 ** n}  # 2560 at step 40
        stats[Key("output", "blocks.0")] = {"rms": 1.0 if n < 4 else 1e3 * n}
        stats[Key("output", "blocks.1")] = {"rms": 1.0}
        steps.append((10 * n, stats))
    return steps


def test_the_forward_checks_state_resumes_mid_run_and_a_state_without_it_starts_them_fresh():
    steps = _forward_steps()
    whole, resumed = HealthReport(), HealthReport()
    for step, stats in steps[:3]:
        whole.add_stats(step, stats)
    state = json.loads(json.dumps(whole.state_dict()))
    assert state["version"] == VERSION and {"attention_logits", "activation_growth"} <= set(state["checks"])
    resumed.load_state_dict(state)
    for step, stats in steps:
        whole.add_stats(step, stats)
        resumed.add_stats(step, stats)
    assert resumed.table(full=True) == whole.table(full=True)
    assert {(r.flag, r.since) for r in whole.rows()} == {("attention_logits", 20), ("activation_growth", 40)}
    # A version 3 state of the release before the forward checks: they start fresh at the resume
    # (from step 20, not judged yet when saved): the output's early level is that of steps 20-40.
    older = {**state, "checks": {k: v for k, v in state["checks"].items() if k not in ("attention_logits",
                                                                                          "activation_growth")}}
    fresh = HealthReport()
    fresh.load_state_dict(older)
    for step, stats in steps:
        fresh.add_stats(step, stats)
    assert {(r.flag, r.since) for r in fresh.rows()} == {("attention_logits", 20), ("activation_growth", 50)}
