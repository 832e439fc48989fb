"""Fits the MLP of ``test_noise.models()`` at learning rate 0 with ``strategy="ddp"`` on two CPU
processes (gloo), 16 examples a rank, every step logged.

Run by ``tests/core/test_noise.py`` through ``python noise_sharded.py OUT_DIR ddp:mlp,...``
(:func:`fit`), beside the sharded fits; Lightning starts rank 1 by running that script again. Rank 0 writes the events and ``facts.json``: how many ``all_reduce``
calls GradHooks' noise probe made (its ``collectives``) and how many steps were logged.
"""

import json
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks
from test_noise import Fit, models

STEPS = 32


class Facts(pl.Callback):
    """Rank 0 writes how many steps were logged and how many collectives the noise probe made."""

    def __init__(self, out: Path, gradhooks: GradHooks) -> None:
        self.out, self.gradhooks, self.logged, self.collectives = out, gradhooks, 0, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self.logged += self.gradhooks.monitor.noise.armed  # runs before GradHooks' own hook

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        if trainer.is_global_zero:
            facts = {"logged_steps": self.logged, "all_reduces": self.gradhooks.monitor.noise.collectives}
            (self.out / "facts.json").write_text(json.dumps(facts))


def trainer(out: Path, strategy: object, gradhooks: GradHooks, steps: int = STEPS) -> pl.Trainer:
    """Two CPU ranks under ``strategy``, ``steps`` steps, every one logged into ``out``, ``Facts`` written there."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=TensorBoardLogger(str(out), name="logs"),
        callbacks=[Facts(out, gradhooks), gradhooks],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )


def fit(out: Path) -> None:
    out.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model, x, y = models()["mlp"]
    gradhooks = GradHooks(every_n_steps=1, histograms=False, compile_statistics=False)  # eager: see ddp_train.py
    run = trainer(out, DDPStrategy(timeout=timedelta(seconds=60)), gradhooks)
    # Lightning gives each rank its own half, shuffled (a DistributedSampler)
    run.fit(Fit(model), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
