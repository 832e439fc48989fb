"""``python -m lightning_gradhooks report`` tells the truth about its input: damaged
event files are named with what was read, a folder without GradHooks data exits 2, ``--fail-on``
exits 1 only on a named flag; thresholds are range-checked everywhere they are given."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys

import pytest

import report_panel as panel
from lightning_gradhooks import GradHooks
from lightning_gradhooks.health import HealthReport, Thresholds


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory) -> tuple[str, str]:  # noqa: ANN001
    """A real run of a model with a dead ReLU layer: its log folder and the printed report."""
    _, text, log_dir, _ = panel.fit(tmp_path_factory.mktemp("dead"), panel.dead_relu, steps=12)
    return log_dir, text


def test_fail_on_exits_1_only_when_a_named_flag_is_found(dead_run):
    log_dir, text = dead_run
    assert panel.cli("report", log_dir)[0] == 0
    code, out, err = panel.cli("report", log_dir, "--fail-on", "dead")
    assert code == 1 and "failing on: dead" in err and panel.without_noise(out).rstrip().endswith(text.splitlines()[-1])
    assert panel.cli("report", log_dir, "--fail-on", "nonfinite,exploding")[0] == 0


def test_the_text_tab_holds_the_grouped_report_and_every_entry(dead_run):
    from conftest import read_events

    log_dir, _ = dead_run
    events = read_events(log_dir)
    (text,) = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("gradhooks/health_report/text_summary")]
    assert "| dead | `net.2` | 0 | 1 | output and parameter gradients all zero<br>follows from it" in text
    assert "Every flagged entry:" in text and "| `param net.4.weight` | stalled | 0 | 0 |" in text


def test_the_printed_report_holds_at_most_40_lines_worst_first():
    report = HealthReport()
    for step in range(0, 40, 5):
        stats = {("grad_output", f"m{i}"): {"mean": 0.0, "std": 1.0 if step < 10 or i >= 50 else 1e4 * step} for i in range(60)}
        stats |= {("grad_output", f"v{i}"): {"mean": 0.0, "std": 1e-9} for i in range(20)}
        stats |= {("grad_output", f"d{i}"): {"mean": 0.0, "std": 1.0, "zero_fraction": 1.0} for i in range(40)}
        report.add_stats(step, stats)
    lines = report.table(limit=100).splitlines()
    assert len(lines) == 40 and lines[2].startswith("exploding")
    assert "    ... and 18 more modules flagged exploding (--all)" in lines
    assert lines[-2].startswith("dead       d0") and "dead: d1, d2" in lines[-1]  # every flag keeps its worst row
    assert len(report.table(full=True).splitlines()) > 60


def test_a_truncated_events_file_is_read_up_to_the_cut_and_named(dead_run, tmp_path):
    log_dir, _ = dead_run
    copy = tmp_path / "run"
    shutil.copytree(log_dir, copy)
    (events,) = copy.glob("events.out.tfevents.*.gradhooks")  # the file of ours: the logged steps
    data = events.read_bytes()
    events.write_bytes(data[: len(data) // 2])
    code, out, err = panel.cli("report", str(tmp_path))
    assert code == 0
    assert f"warning: {events}: cut short" in err and " of GradHooks data) before it" in err
    events_read, steps_read = map(int, re.search(r"read (\d+) events? \((\d+) logged steps? of", err).groups())
    whole = panel.cli("report", log_dir)[1]
    steps = lambda text: int(re.search(r"(\d+) logged steps?\b", text).group(1))  # noqa: E731
    assert events_read > 0 and steps(out) == steps_read < steps(whole) == 4  # what was read, said so


def test_random_bytes_an_empty_folder_and_a_run_without_gradhooks_exit_2(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "events.out.tfevents.1.host").write_bytes(bytes(range(256)) * 40)
    code, out, err = panel.cli("report", str(garbage), "--fail-on", "nonfinite")
    assert code == 2 and out == ""
    assert "damaged record header" in err and "read 0 events (0 logged steps" in err
    assert "error: no GradHooks data under" in err and "none with GradHooks tags" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = panel.cli("report", str(empty))
    assert code == 2 and "no TensorBoard event files" in err

    from torch.utils.tensorboard import SummaryWriter

    other = tmp_path / "other"
    with SummaryWriter(str(other)) as writer:
        writer.add_scalar("loss", 1.0, 0)
    done = subprocess.run([sys.executable, "-m", "lightning_gradhooks", "report", str(other), "--fail-on", "dead"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no GradHooks data" in done.stderr and "no gradient problems" not in done.stdout


BAD = [
    ({"exploding_window": -1}, "`Thresholds.exploding_window` expected a positive int, got -1"),
    ({"vanishing_steps": 0}, "`Thresholds.vanishing_steps` expected a positive int, got 0"),
    ({"stalled_steps": 2.5}, "`Thresholds.stalled_steps` expected a positive int, got 2.5"),
    ({"dead_steps": True}, "`Thresholds.dead_steps` expected a positive int, got True"),
    ({"vanishing_ratio": math.nan}, "`Thresholds.vanishing_ratio` expected a finite number in (0, 1), got nan"),
    ({"exploding_factor": "100"}, "`Thresholds.exploding_factor` expected a finite number > 1, got '100'"),
    ({"dead_zero_fraction": 1.5}, "`Thresholds.dead_zero_fraction` expected a number in (0, 1], got 1.5"),
    ({"exploding_update_ratio": -1.0}, "`Thresholds.exploding_update_ratio` expected a number > 0, got -1.0"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_thresholds_are_range_checked_in_gradhooks_thresholds_and_the_report(overrides, message):
    for make in (lambda: GradHooks(report_thresholds=overrides), lambda: HealthReport(Thresholds(**overrides))):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == message


def test_thresholds_from_the_command_line_are_range_checked_without_a_traceback(dead_run):
    log_dir, _ = dead_run
    code, out, err = panel.cli("report", log_dir, "--exploding-window", "-1")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "argument --exploding-window: `Thresholds.exploding_window` expected a positive int, got -1" in err
    code, _, err = panel.cli("report", log_dir, "--vanishing-ratio", "nan")
    assert code == 2 and "`Thresholds.vanishing_ratio` expected a finite number in (0, 1), got nan" in err


def test_whole_floats_from_a_config_file_are_taken_as_step_counts():
    hooks = GradHooks(report_thresholds={"vanishing_steps": 4.0, "vanishing_ratio": 1e-4})
    assert hooks.thresholds.vanishing_steps == 4 and type(hooks.thresholds.vanishing_steps) is int


def test_the_report_command_reads_the_compact_summary_whatever_is_charted(tmp_path):
    """With only the norms charted, the command still gives the report printed at the end of fit:
    every statistic is in the one `gradhooks/stats` summary of each logged step."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_gradhooks import GradHooks
    from lightning_gradhooks.summary.events import STATS_TAG

    import torch
    from conftest import MLP, loader

    class Dead(MLP):
        def __init__(self) -> None:
            super().__init__()
            torch.nn.init.constant_(self.net[2].bias, -50.0)  # a dead ReLU layer

    pl.seed_everything(0, verbose=False)
    callback = GradHooks(every_n_steps=1, statistics=["norm"], histograms=False)
    trainer = pl.Trainer(max_steps=6, logger=TensorBoardLogger(str(tmp_path), name="logs"), callbacks=[callback],
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         log_every_n_steps=1)
    trainer.fit(Dead(), loader())
    printed = callback.gradient_log.report
    assert "dead" in printed.names()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert len(events.Tensors(STATS_TAG)) >= 6  # one per logged step, and one per measured update
    assert not [t for t in events.Tags()["scalars"] if "_mean/" in t or "zero_fraction" in t]
    code, out, _ = panel.cli("report", trainer.logger.log_dir, "--all")
    assert code == 0 and printed.table(full=True) in out


def test_the_report_command_imports_neither_torch_lightning_nor_tensorboard(dead_run):
    """The report reads event files with the torch-free summary layer: a CI guard pays no
    `import torch`, and a machine without torch can run it."""
    log_dir, text = dead_run
    probe = ("import sys, runpy; sys.argv = ['lightning_gradhooks', 'report', sys.argv[1]]\n"
             "try:\n    runpy.run_module('lightning_gradhooks', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('IMPORTED', sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'tensorboard') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, log_dir], capture_output=True, text=True, timeout=60)
    assert "IMPORTED []" in done.stdout, done.stdout + done.stderr
    assert text.splitlines()[-1] in done.stdout  # the same report as at the end of fit
