"""Train a small classifier on scikit-learn's bundled digits (no download) with GradHooks.

    python examples/train_digits.py            # logs to ./lightning_logs
    tensorboard --logdir lightning_logs        # then open the printed address

Every 10 optimizer steps, per-module gradient norms, means, stds, abs-max and non-finite counts,
and histograms of module output gradients and parameter gradients, land in TensorBoard.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", accuracy, prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def digits_loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    train, val = order[:1500], order[1500:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--every-n-steps", type=int, default=10)
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    train_loader, val_loader = digits_loaders()
    logger = TensorBoardLogger(save_dir=".", name=args.logdir)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[GradHooks(every_n_steps=args.every_n_steps)],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsClassifier(), train_loader, val_loader)
    print(f"\nval_acc: {trainer.callback_metrics['val_acc']:.3f}")
    print(f"Gradient statistics and histograms written to: {logger.log_dir}")
    print(f"Open them with:  tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
