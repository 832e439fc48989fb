"""The figure of docs/usage.md: the noise scale GradHooks logs in a real fit, against brute force.

    python benchmarks/noise_figure.py [--out docs/noise_scale.png] [--steps 400] [--every 10]

A Lightning fit (SGD, lr 0.05, batch 32, no accumulation: per-example norms) of an MLP
classifier on a synthetic task (a random teacher network's labels, 20 % of them flipped), with
``GradHooks(every_n_steps=...)`` and a TensorBoardLogger. At each logged step a callback also
computes the exact noise scale of the whole training set from every example's gradient
(``torch.func.vmap(grad(...))``). The figure reads the event files back: the raw per-step
estimate ``tr(Σ)/|G|²`` of the compact summary (dots), the smoothed ``∇1 overview/noise_scale``
(line), the brute-force value (dashes) and the batch (a horizontal line).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_gradhooks import GradHooks  # noqa: E402
from lightning_gradhooks.__main__ import read_folder  # noqa: E402

BATCH = 32


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Truth(pl.Callback):
    """The exact noise scale of the training set at each logged step (before the update)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, every: int) -> None:
        self.x, self.y, self.every, self.values = x, y, every, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        if trainer.global_step % self.every:
            return
        net = pl_module.net
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss(p, xi, yi):  # noqa: ANN001, ANN202
            return nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

        rows = []
        for i in range(0, len(self.x), 512):
            g = vmap(grad(loss), in_dims=(None, 0, 0))(params, self.x[i:i + 512], self.y[i:i + 512])
            rows.append(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], 1).double())
        g = torch.cat(rows)
        mean = g.mean(0)
        self.values[trainer.global_step] = float((g - mean).square().sum(1).mean() / mean.square().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/noise_scale.png")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    teacher = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10))
    with torch.no_grad():
        y = teacher(x).argmax(1)
    flip = torch.rand(2048, generator=g) < 0.2
    y[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    truth = Truth(x, y, args.every)
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=TensorBoardLogger(folder, name="logs"),
                             callbacks=[GradHooks(every_n_steps=args.every, histograms=False), truth],
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
        trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True))
        log_dir = Path(trainer.logger.log_dir)
        events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        events.Reload()
        smoothed = [(e.step, e.value) for e in events.Scalars("∇1 overview/noise_scale")]
        raw = [(step, s[("noise", "gradient")]["noise_scale"]) for step, s in sorted(read_folder(log_dir).steps.items())
               if ("noise", "gradient") in s and s[("noise", "gradient")]["noise_scale"] > 0]  # NaN: |G|² <= 0
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    ax.scatter(*zip(*raw), s=8, color="0.6", label="one logged step (raw tr(Σ)/|G|², summary)")
    ax.plot(*zip(*smoothed), color="C0", lw=2, label="∇1 overview/noise_scale (smoothed)")
    ax.plot(*zip(*sorted(truth.values.items())), color="C3", lw=1.5, ls="--",
            label="exact, from every example's gradient (torch.func)")
    ax.axhline(BATCH, color="k", lw=1, ls=":", label=f"batch per optimizer step ({BATCH})")
    ax.set_yscale("log")
    top = max(v for _, v in smoothed + list(truth.values.items())) * 4
    ax.set_ylim(BATCH / 8, top)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("noise scale (examples)")
    ax.set_title("Gradient noise scale of an MLP classifier (20 % label noise), batch 32, SGD")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    ratios = [v / truth.values[s] for s, v in smoothed if s in truth.values]
    print(f"wrote {args.out}; smoothed / exact over the run: median {sorted(ratios)[len(ratios) // 2]:.2f}, "
          f"mean raw estimate / mean exact: "
          f"{sum(v for _, v in smoothed) / len(smoothed) / (sum(truth.values.values()) / len(truth.values)):.2f}")


if __name__ == "__main__":
    main()
