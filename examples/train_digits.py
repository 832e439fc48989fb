"""Train a small classifier on scikit-learn's bundled digits (no download) with GradHooks.

    python examples/train_digits.py            # logs to ./lightning_logs
    python examples/train_digits.py --offload  # and saved activations go to disk
    tensorboard --logdir lightning_logs        # then open the printed address

Every 8 optimizer steps, per-module gradient statistics (norm, mean, std, abs-max, zero
fraction, non-finite counts), update ratios, the total gradient norm, histograms and the
gradient-flow picture land in TensorBoard; at the end the gradient-health report is printed.
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--logdir", default="lightning_logs", help="folder of the TensorBoard runs")
    parser.add_argument("--epochs", type=positive_int, default=2, help="training epochs (94 steps each)")
    # Batches of 16, well below this task's gradient noise scale (~100 examples), and 24 logged
    # steps: enough estimates in the run's second half for the noise scale to advise.
    parser.add_argument("--batch-size", type=positive_int, default=16, help="examples per optimizer step")
    parser.add_argument("--every-n-steps", type=positive_int, default=8, help="log gradients every this many steps")
    parser.add_argument(
        "--offload", action="store_true", help="offload saved activations of at least 1 KiB to disk and print what went"
    )
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    train_loader, val_loader = digits_loaders(args.batch_size)
    logger = TensorBoardLogger(save_dir=".", name=args.logdir)
    hooks = GradHooks(every_n_steps=args.every_n_steps, offload_threshold_bytes=1024 if args.offload else None)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=8,  # train_loss: a point per logged step (the default, 50, is long for 188 steps)
        callbacks=[hooks],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsClassifier(), train_loader, val_loader)
    print(f"\nval_acc: {trainer.callback_metrics['val_acc']:.3f}")
    if hooks.offload_stats is not None:
        s = hooks.offload_stats
        print(
            f"Offload: {s.bytes_offloaded / 2**20:.1f} MiB of saved activations went to disk in "
            f"{s.tensors_offloaded} tensors ({s.tensors_kept} small ones kept in memory), "
            f"{s.bytes_read / 2**20:.1f} MiB read back; {s.files_on_disk} files left open at the end."
        )
    print(f"Gradient statistics, histograms and the gradient-flow picture written to: {logger.log_dir}")
    print(f"Open them with:  tensorboard --logdir {args.logdir}")
    print(f"The gradient-health report above, again from the logs:  python -m lightning_gradhooks report {args.logdir}")


if __name__ == "__main__":
    main()
