"""Shared models and helpers for the tests, importable by name from every folder below.

One folder per part of the package:

- ``core/``: monitor.py (choosing modules, the read plan), stats.py (the reductions against
  plain torch), noise.py, sentinel.py, and what crosses the core: in-place models,
  ``torch.compile``, the GPU path;
- ``log/``: log.py (plain loops and Fabric), flow.py, updates.py, distributed.py (pooling over
  ranks), the console, the real TensorBoard server;
- ``health/``: the report: its checks, one file each, driven by hand-made steps
  (``helpers/health_steps.py``); the resume state of earlier releases (``health/data``); the
  report through real fits, its validation panel and ``python -m lightning_gradhooks report``;
- ``shell/``: the Lightning callback: arguments, lifecycle, set-ups, loggers, LightningCLI, both
  namespaces, DDP and sharded strategies, models of every shape;
- ``offload/``: ``save_on_disk``: engine, budget, errors, signals, in-place truth, in the callback;
- ``docs/``: the README's and docs' snippets, the example;
- ``helpers/``: no tests: scripts that tests run in other processes (DDP ranks, offload victims),
  the report's validation panel, and ``launch.run_script``.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable

import pytest
import pytorch_lightning as pl
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(pl.LightningModule):
    """A small classifier; ``fail_at`` raises inside ``training_step`` at that batch index."""

    def __init__(self, fail_at: int | None = None, nan_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.nan_at = nan_at
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        logits = self(x)
        if batch_idx == self.nan_at:
            poison = torch.ones_like(logits)
            poison[0] = float("nan")  # one sample's gradients become NaN
            logits = logits * poison
        loss = nn.functional.cross_entropy(logits, y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return self(batch[0])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AdamMLP(MLP):
    """The MLP stepped by Adam, fused (the optimizer unscales in its own step) or not."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=self.fused)


class ManualGAN(pl.LightningModule):
    """Two optimizers and two manual_backward calls per step."""

    def __init__(self, probe=lambda: True) -> None:  # noqa: ANN001
        super().__init__()
        self.probe = probe  # called inside each training step, results in `saved_inside`
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.disc = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.saved_inside: list[bool] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        opt_g, opt_d = self.optimizers()
        self.saved_inside.append(self.probe())
        x, _ = batch
        fake = self.gen(torch.randn_like(x))
        loss_d = self.disc(fake.detach()).mean() - self.disc(x).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = -self.disc(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(self.disc.parameters(), lr=0.01)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class FailingBackward(torch.autograd.Function):
    """Identity in forward; raises in backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise RuntimeError("boom in backward")


class GradRecorder(pl.Callback):
    """Keeps a copy of every parameter gradient at each optimizer step."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self.grads.append([p.grad.clone() for p in pl_module.parameters() if p.requires_grad])


def make_trainer(tmp_path, callbacks=(), **kwargs) -> pl.Trainer:  # noqa: ANN001
    from pytorch_lightning.loggers import TensorBoardLogger

    options = dict(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=str(tmp_path), name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        log_every_n_steps=1,
        deterministic=True,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **options)


def hook_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Every hook dict of every module, by module name, plus the full-backward-hook flag."""
    return {
        name: (
            list(module._backward_hooks.items()),
            list(module._backward_pre_hooks.items()),
            list(module._forward_hooks.items()),
            list(module._forward_pre_hooks.items()),
            module._is_full_backward_hook,
        )
        for name, module in model.named_modules()
    }


def graph_nodes(loss: torch.Tensor) -> collections.Counter:
    """How many autograd nodes of each type the graph of ``loss`` holds (``grad_fn.next_functions``)."""
    seen, stack, found = set(), [loss.grad_fn], collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return found


def calls_into_the_library(run: Callable[[], object]) -> tuple[list[str], object]:
    """The functions of lightning_gradhooks that Python enters while ``run()`` runs, and what it returns."""
    calls = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and "lightning_gradhooks" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return calls, result


def tag(kind: str, stat: str, name: str) -> str:
    """The chart of a statistic (``∇2 grad_output_norm/net.0``; the scheme itself is asserted
    literally in test_callback and test_tensorboard_server)."""
    from lightning_gradhooks.log._tensorboard import section

    return f"{section(kind, stat)}/{name}"


def pooled_calls(log_dir: str, name: str, kind: str = "grad_output", optimizer: int | None = None) -> dict[int, int]:
    """How many gradients the entry of ``name`` (logged for ``optimizer``) pools at each logged
    step, read from the compact summary as the report command reads it (which names the count
    when it is more than one)."""
    from lightning_gradhooks.__main__ import read_folder
    from lightning_gradhooks.summary.records import Key

    steps, key = read_folder(Path(log_dir)).steps, Key(kind, name, optimizer)
    return {step: int(stats[key].get("calls", 1)) for step, stats in sorted(steps.items()) if key in stats}


def read_events(log_dir: str):  # noqa: ANN201
    """Load a run's event files with TensorBoard's EventAccumulator (everything kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    yield
