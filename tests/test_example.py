import subprocess
import sys
from pathlib import Path

from conftest import read_events

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


def test_digits_example_trains_and_tells_where_the_logs_are(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--logdir", "runs"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Open them with:  tensorboard --logdir runs" in done.stdout
    events = read_events(str(tmp_path / "runs" / "version_0"))
    assert "grad_output_norm/net.0" in events.Tags()["scalars"]
    assert "param_grad_hist/net.4.weight" in events.Tags()["histograms"]
    assert [e.step for e in events.Scalars("grad_output_norm/net.4")] == [0, 10, 20]
