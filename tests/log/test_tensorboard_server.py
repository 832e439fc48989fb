"""Start the real ``tensorboard`` server over a run's logs, ask its HTTP data API for tags, and
read the sections its Time Series dashboard shows in headless Chromium."""

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import pytorch_lightning as pl

from lightning_gradhooks import GradHooks
from lightning_gradhooks.log import LOGGED_STATISTICS

from conftest import MLP, loader, make_trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):  # noqa: ANN201
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@contextlib.contextmanager
def tensorboard(logdir) -> Iterator[tuple[subprocess.Popen, int]]:  # noqa: ANN001
    """The real server over ``logdir``, stopped at the end."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield server, port
    finally:
        server.terminate()
        server.wait(timeout=30)  # raises if the server does not stop
    with pytest.raises(ConnectionRefusedError):  # and nothing of it listens on the port any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_tensorboard_server_serves_our_tags(tmp_path):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=2, statistics=list(LOGGED_STATISTICS))], max_steps=4)
    trainer.fit(MLP(), loader())

    with tensorboard(tmp_path / "logs") as (server, port):
        base = f"http://127.0.0.1:{port}/data/plugin"
        scalars = histograms = images = texts = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read().decode()
            try:
                scalars = get_json(f"{base}/scalars/tags").get("version_0", {})
                histograms = get_json(f"{base}/histograms/tags").get("version_0", {})
                images = get_json(f"{base}/images/tags").get("version_0", {})
                texts = get_json(f"{base}/text/tags").get("version_0", [])
            except OSError:
                pass
            if scalars and histograms and images and texts:
                break
            time.sleep(0.5)
        assert {"∇2 grad_output_norm/net.0", "∇7 grad_input_std/net.4", "∇7 param_grad_zero_fraction/net.2.weight",
                "∇1 overview/total_norm", "∇1 overview/nonfinite_total", "∇5 param_update_ratio/net.0.weight"} <= set(scalars)
        assert {"∇6 histograms/grad_output/net.0", "∇6 histograms/param_grad/net.4.bias"} <= set(histograms)
        assert "∇1 overview/gradient_flow" in images  # the gradient-flow picture (matplotlib is in the test extra)
        assert "gradhooks/health_report/text_summary" in texts  # the health report
        tag = urllib.parse.quote("∇2 grad_output_norm/net.0")
        points = get_json(f"{base}/scalars/scalars?run=version_0&tag={tag}")
        assert [p[1] for p in points] == [0, 2]


class LossMLP(MLP):
    """Logs the user's own metrics, named to sort last among the letters."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.log("zz_last_letter", 2 * loss)
        return loss


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless Chromium")
def test_time_series_shows_the_users_metrics_first_and_six_sections_of_ours(tmp_path):
    """What a person sees: TensorBoard's own frontend, in headless Chromium, orders the sections."""
    pl.seed_everything(0, verbose=False)
    make_trainer(tmp_path, [GradHooks(every_n_steps=2)], max_steps=4).fit(LossMLP(), loader())
    with tensorboard(tmp_path / "logs") as (server, port):
        titles: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "∇6 histograms" not in titles:
            assert server.poll() is None, server.stderr.read().decode()
            dom = subprocess.run(
                ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
                 "--dump-dom", f"http://127.0.0.1:{port}/#timeseries"],
                capture_output=True, text=True, timeout=60,
            ).stdout
            titles = [t.strip() for t in re.findall(r'class="group-title"[^>]*>([^<]+)<', dom)]
    ours = [t for t in titles if t.startswith("∇")]
    assert ours == ["∇1 overview", "∇2 grad_output_norm", "∇3 grad_input_norm", "∇4 param_grad_norm",
                    "∇5 param_update_ratio", "∇6 histograms"], titles
    users = [titles.index(t) for t in ("epoch", "train_loss", "zz_last_letter")]
    assert max(users) < titles.index(ours[0]), titles
