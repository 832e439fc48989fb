"""health/migrate.py: a checkpoint of an earlier release resumes as if never stopped."""

import json
from pathlib import Path

import pytest

from lightning_gradhooks.health import HealthReport
from lightning_gradhooks.health.migrate import VERSION
from lightning_gradhooks.records import Key

DATA = Path(__file__).parent / "data"


def summary(entries):  # noqa: ANN001, ANN201
    return {Key.of_label(kind, name): stats for kind, name, stats in entries}


def test_a_checkpoint_of_an_unknown_state_version_is_refused_clearly():
    with pytest.raises(ValueError, match="expected a state of version 1, 2 or 3, got 99"):
        HealthReport().load_state_dict({"version": 99})


@pytest.mark.parametrize(("version", "seen"), [(1, 6), (2, 4)])
def test_a_report_state_of_an_earlier_release_resumes_as_if_never_stopped(version, seen):
    # Written by earlier releases (data/, each file's "written_by"): the report's state part-way
    # through a run with a dead layer (version 2's with a step not judged yet), and every logged
    # step's summary of that run.
    saved = json.loads((DATA / f"report_state_v{version}.json").read_text())
    assert saved["state"]["version"] == version
    whole, resumed = HealthReport(), HealthReport()
    resumed.load_state_dict(saved["state"])
    assert resumed.steps == seen
    for step, entries in saved["steps"]:
        whole.add_stats(step, summary(entries))
        resumed.add_stats(step, summary(entries))  # steps it has seen are ignored, as on a resume
    assert resumed.steps == whole.steps == 12
    assert resumed.table() == whole.table() == saved.get("table", whole.table())
    assert [(f.flag, f.kind, f.entry, f.since) for f in resumed.flags()] == [
        (f.flag, f.kind, f.entry, f.since) for f in whole.flags()]
    (row,) = resumed.rows()
    assert (row.flag, row.module, row.since) == ("dead", "2", 0)


def test_todays_state_round_trips_through_json():
    saved = json.loads((DATA / "report_state_v1.json").read_text())
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
