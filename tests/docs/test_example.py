import os
import subprocess
import sys
from pathlib import Path

from conftest import read_events

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
# torch's own switch, which the statistics honour (eager ops): each run would compile its own
# kernels, and test_compile.py and test_stats.py are where the compiled ones are tested.
EAGER = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}


def test_digits_example_trains_and_tells_where_the_logs_are(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--logdir", "runs"],
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


def test_digits_example_with_offload_prints_what_went_to_disk_and_refuses_bad_values(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--logdir", "runs", "--offload"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=EAGER,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Offload: " in done.stdout and "MiB of saved activations went to disk" in done.stdout
    bad = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "-1"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "argument --epochs: expected a positive integer, got '-1'" in bad.stderr
    assert "Traceback" not in bad.stderr
    helped = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert "(default: 10)" in helped.stdout and "--offload" in helped.stdout
