"""Step-time overhead of GradHooks (and of wandb.watch, where installed) on a Transformer encoder.

    python benchmarks/overhead.py [--steps 50] [--rounds 3] [--no-wandb] [--threads N]

One process, variants interleaved: each round fits every variant for ``--steps`` optimizer steps
with a fresh Trainer and the same initial weights, in turn, the order rotated every round. A step's time runs from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, our logging, optimizer
step). For each round we take each variant's mean step time and its ratio to the plain variant
of the same round; the table shows medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gradhooks import GradHooks


class RepeatedBatch(Dataset):
    def __init__(self, length: int) -> None:
        self.length = length
        self.batch = torch.randn(16, 128, 256, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batch


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.encoder(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)


class WandbWatch(pl.Callback):
    """The peer a user would pick instead: ``wandb.watch(model, log="all")``, offline."""

    def __init__(self, log_freq: int) -> None:
        self.log_freq = log_freq

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import wandb

        wandb.watch(pl_module, log="all", log_freq=self.log_freq)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import wandb

        wandb.unwatch(pl_module)


def fit_once(callbacks: list[pl.Callback], steps: int, logdir: str, state: dict) -> tuple[float, float]:
    model = Encoder()
    model.load_state_dict(state)
    timer = StepTimer()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(logdir, name="bench"),
        callbacks=[*callbacks, timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    trainer.fit(model, DataLoader(RepeatedBatch(steps), batch_size=None))
    return statistics.fmean(timer.times), statistics.fmean(timer.cpu)


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return (
        f"{model}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), pytorch-lightning {pl.__version__}, Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per fit (one window)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-wandb", action="store_true", help="leave wandb.watch out even if installed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    variants: dict[str, Callable[[], list[pl.Callback]]] = {
        "plain": lambda: [],
        "GradHooks every step": lambda: [GradHooks(every_n_steps=1)],
        "GradHooks every 50 steps": lambda: [GradHooks(every_n_steps=50)],
    }
    wandb = None
    if not args.no_wandb:
        try:
            import wandb
        except ImportError:
            print("wandb is not installed: its variants are left out")
    if wandb is not None:
        variants["wandb.watch every step"] = lambda: [WandbWatch(1)]
        variants["wandb.watch every 50 steps"] = lambda: [WandbWatch(50)]

    pl.seed_everything(0, verbose=False)
    state = Encoder().state_dict()
    with tempfile.TemporaryDirectory() as logdir:
        if wandb is not None:
            os.environ["WANDB_SILENT"] = "true"
            wandb.init(mode="offline", dir=logdir, project="gradhooks-bench")
        for make in variants.values():  # warm-up
            fit_once(make(), 3, logdir, state)
        means: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        names = list(variants)
        for round_ in range(args.rounds):
            # Rotate the order each round, so no variant always runs first (or last).
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                means[name].append(fit_once(variants[name](), args.steps, logdir, state))
            print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {m[-1][0] * 1e3:.0f} ms" for n, m in means.items() if m))
        if wandb is not None:
            wandb.finish()

    plain = means["plain"]
    print(f"\nMachine: {machine()}")
    print(f"{args.rounds} rounds x {args.steps} steps per variant, interleaved; medians over rounds\n")
    print("| variant | mean step (ms) | ratio to plain | CPU ratio to plain |")
    print("| --- | --- | --- | --- |")
    for name, values in means.items():
        ratios = [statistics.median(v[i] / p[i] for v, p in zip(values, plain)) for i in (0, 1)]
        print(f"| {name} | {statistics.median(v[0] for v in values) * 1e3:.1f} | {ratios[0]:.3f}x | {ratios[1]:.3f}x |")


if __name__ == "__main__":
    main()
