import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_events

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
# torch's own switch, which the statistics honour (eager ops): each run would compile its own
# kernels, and test_compile.py and test_stats.py are where the compiled ones are tested.
EAGER = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}


def test_digits_example_trains_tells_where_the_logs_are_and_what_went_to_disk(tmp_path):
    # One run, with --offload (the example's two modes differ only in offload_threshold_bytes).
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--batch-size", "64", "--every-n-steps", "10", "--logdir", "runs",
         "--offload"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=EAGER,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Open them with:  tensorboard --logdir runs" in done.stdout
    events = read_events(str(tmp_path / "runs" / "version_0"))
    assert "∇2 grad_output_norm/net.0" in events.Tags()["scalars"]
    assert "∇6 histograms/param_grad/net.4.weight" in events.Tags()["histograms"]
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.4")] == [0, 10, 20]
    assert len(events.Scalars("train_loss")) > 2  # log_every_n_steps follows --every-n-steps
    assert "smaller than the logging interval" not in done.stderr
    # The report is printed once, by the callback, through the progress bar (not inside its redraw).
    assert done.stdout.count("no gradient problems seen in 3 logged steps.") == 1
    assert "python -m lightning_gradhooks report runs" in done.stdout
    assert "Offload: " in done.stdout and "MiB of saved activations went to disk" in done.stdout


def _example(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    """The example's command line in this process (its parser runs before any work): exit code, out, err."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *argv])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    out, err = capsys.readouterr()
    return done.value.code, out, err


def test_the_example_refuses_bad_values_and_documents_its_options(capsys, monkeypatch):
    code, _, err = _example(capsys, monkeypatch, "--epochs", "-1")
    assert code == 2 and "argument --epochs: expected a positive integer, got '-1'" in err
    assert "Traceback" not in err
    code, out, _ = _example(capsys, monkeypatch, "--help")
    assert code == 0 and "(default: 8)" in out and "--offload" in out
