"""Trains a small model with ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``.

Run by ``tests/shell/test_ddp.py`` as ``python ddp_train.py OUT_DIR MODE`` (``local`` or ``sync``;
``nan``: local, with a NaN in one example of rank 1's batch at step 1); Lightning starts rank 1 by
running this script again. Each rank saves the gradients of ``net.2``'s output at every step
(captured with a plain tensor hook, the test's reference) to OUT_DIR, and rank 0 the report.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gloo_exit import finish
from lightning_gradhooks import GradHooks

STEPS = 3


class Net(pl.LightningModule):
    def __init__(self, nan_on_rank_1_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.nan_at = nan_on_rank_1_at

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        logits = self.net(x)
        if self.global_rank == 1 and batch_idx == self.nan_at:
            poison = torch.ones_like(logits)
            poison[0] = float("nan")  # one example of rank 1's batch; rank 0's stays finite
            logits = logits * poison
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Reference(pl.Callback):
    """The gradient of `net.2`'s output in each step on this rank, and what GradHooks did."""

    def __init__(self, out: Path, gradhooks: GradHooks) -> None:
        self.out, self.gradhooks, self.grads = out, gradhooks, []

    def on_fit_start(self, trainer, pl_module):  # noqa: ANN001
        def forward_hook(module, args, output):  # noqa: ANN001, ANN202
            output.register_hook(lambda grad: self.grads.append(grad.clone()))

        self.handle = pl_module.net[2].register_forward_hook(forward_hook)

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        self.handle.remove()
        torch.save(self.grads, self.out / f"grads-rank{trainer.global_rank}.pt")
        offload = self.gradhooks.offload.stats()
        facts = {"collectives": self.gradhooks.gradient_log.collectives, "offload_dir": offload.directory,
                 "offload_written": offload.bytes_written}
        (self.out / f"facts-rank{trainer.global_rank}.json").write_text(json.dumps(facts))
        if trainer.is_global_zero:
            (self.out / "report.txt").write_text(self.gradhooks.gradient_log.report.table())


def fit(out: Path, mode: str) -> None:
    out.mkdir(exist_ok=True)
    (out / "offload").mkdir(exist_ok=True)  # offload_dir must exist; both ranks share it
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    gradhooks = GradHooks(
        every_n_steps=1, statistics=["norm", "mean", "std", "absmax"], sync_dist=mode == "sync", offload_threshold_bytes=256, offload_dir=str(out / "offload"),
        compile_statistics=False,  # eager: each rank would compile its own kernels (test_compile.py compiles them)
    )
    trainer = pl.Trainer(
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=TensorBoardLogger(str(out), name="logs"),
        callbacks=[gradhooks, Reference(out, gradhooks)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(1 if mode == "nan" else None), DataLoader(data, batch_size=8))


def main() -> None:
    """Each mode of ``MODE,MODE...`` in turn, into ``OUT/MODE``: one pair of processes for all (the
    second fit finds the ranks and the process group of the first)."""
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    for mode in modes:
        fit(out / mode, mode)
    finish()


if __name__ == "__main__":
    main()
