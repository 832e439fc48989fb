"""The noise-scale sentence against the truth: a GroupNorm CNN at learning rate 0, so the truth
does not move (docs/usage.md, "How big should my batch be").

Usage: ``PYTHONPATH=. python benchmarks/noise_advice.py SEED LABEL_NOISE`` (the table's rows:
``0 1``, ``1 4``, ``2 1``). Prints the exact noise scale of the whole data set (every example's
gradient, ``torch.func``) and, for one process (per-example norms) and accumulation x4, the
summary and the sentence of the end of fit.
"""

import logging
import sys
import tempfile
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path[:0] = ["tests", "tests/helpers", "tests/core"]
from test_noise import truth  # noqa: E402

from lightning_gradhooks import GradHooks  # noqa: E402


class Fit(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.0)


def cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 5))


def main(seed: int, label_noise: float) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 3, 12, 12, generator=g)
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 100, 5))
    with torch.no_grad():
        y = (teacher(x) + label_noise * torch.randn(1024, 5, generator=g)).argmax(1)
    grad_sq, trace = truth(cnn(seed), nn.functional.cross_entropy, x, y)
    print(f"truth {trace / grad_sq:.1f}")
    for accumulation in (1, 4):
        said = []
        hooks = GradHooks(every_n_steps=2, histograms=False)
        hooks._echo = lambda trainer: said.append
        trainer = pl.Trainer(max_steps=120, accumulate_grad_batches=accumulation, accelerator="cpu",
                             logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp()), callbacks=[hooks],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        loader = DataLoader(TensorDataset(x, y), batch_size=64 // accumulation, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        trainer.fit(Fit(cnn(seed)), loader)
        print(f"accumulation {accumulation}: {hooks.gradient_log.noise_scale.summary()}\n  {said[-1]}")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
