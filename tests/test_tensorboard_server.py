"""Start the real ``tensorboard`` server over a run's logs and ask its HTTP data API for tags."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytorch_lightning as pl

from lightning_gradhooks import GradHooks

from conftest import MLP, loader, make_trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):  # noqa: ANN201
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_tensorboard_server_serves_our_tags(tmp_path):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=2)], max_steps=4)
    trainer.fit(MLP(), loader())

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "logs"), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/data/plugin"
    try:
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
        assert {"grad_output_norm/net.0", "grad_input_std/net.4", "param_grad_zero_fraction/net.2.weight",
                "0_overview/total_norm", "0_overview/nonfinite_total", "param_update_ratio/net.0.weight"} <= set(scalars)
        assert {"grad_output_hist/net.0", "param_grad_hist/net.4.bias"} <= set(histograms)
        assert "gradient_flow" in images  # the gradient-flow picture (matplotlib is in the test extra)
        assert "gradhooks/health_report/text_summary" in texts  # the health report
        points = get_json(f"{base}/scalars/scalars?run=version_0&tag=grad_output_norm/net.0")
        assert [p[1] for p in points] == [0, 2]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode is not None
