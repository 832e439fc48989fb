"""The documented recipe: GradientMonitor and save_on_disk in Lightning Fabric and plain loops."""

import os

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from lightning_gradhooks import GradientMonitor, save_on_disk, write_record

from conftest import read_events


def train(model, optimizer, step_fn, log_dir, offload_dir, watched=None, steps=4):  # noqa: ANN001, ANN201
    """The recipe of docs/usage.md, written once for both loops."""
    monitor = GradientMonitor(watched or model, include=["0", "2"])
    offload_dir.mkdir(exist_ok=True)
    offload = save_on_disk(threshold_bytes=1024, directory=offload_dir)
    writer = SummaryWriter(log_dir)
    g = torch.Generator().manual_seed(0)
    try:
        with monitor.attach():
            for step in range(steps):
                x = torch.randn(64, 8, generator=g)
                with monitor.arm(when=step % 2 == 0):
                    with offload:
                        loss = model(x).square().mean()
                    step_fn(loss)
                    write_record(writer, monitor.collect(), step)  # no-op on steps not armed
                optimizer.step()
                optimizer.zero_grad()
    finally:
        offload.close()
        writer.close()
    return offload


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def check(log_dir, offload, offload_dir) -> None:  # noqa: ANN001
    events = read_events(str(log_dir))
    assert [e.step for e in events.Scalars("grad_output_norm/2")] == [0, 2]
    assert [e.step for e in events.Scalars("param_grad_norm/0.weight")] == [0, 2]
    assert "grad_output_hist/0" in events.Tags()["histograms"]
    assert offload.closed and os.listdir(offload_dir) == []


def test_plain_pytorch_loop(tmp_path):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    offload = train(net, optimizer, lambda loss: loss.backward(), tmp_path / "tb", tmp_path / "off")
    check(tmp_path / "tb", offload, tmp_path / "off")
    assert offload.stats().bytes_offloaded > 0


def test_lightning_fabric_loop(tmp_path):
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    net = model()
    wrapped, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    # Monitor the module itself: Fabric's wrapper adds a prefix to every name.
    offload = train(wrapped, optimizer, fabric.backward, tmp_path / "tb", tmp_path / "off", watched=net)
    check(tmp_path / "tb", offload, tmp_path / "off")
