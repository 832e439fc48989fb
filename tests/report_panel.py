"""The validation panel of the health report: small real architectures, healthy and broken on
purpose, fitted for a few dozen steps on the CPU by a real Lightning Trainer.

Each maker returns ``(LightningModule, DataLoader)`` for a seed. The models are written here
(torchvision and timm need another torch than CI's), GPT-2 comes from ``transformers`` with a
small config. ``fit`` runs one fit with ``GradHooks`` and returns the report the callback
printed, its text, and the run's log folder; ``cli`` runs ``python -m lightning_gradhooks
report`` in this process on that folder.

Run as a script for a sweep over more seeds: ``python tests/report_panel.py 0 1 2 3 4``.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import FailingBackward
from lightning_gradhooks import GradHooks


class Lit(pl.LightningModule):
    """``net`` under a loss, an optimizer and optional damage.

    Args:
        net: the model; called on the batch's input.
        optimizer: ``"sgd"`` (momentum 0.9), ``"adamw"`` or ``"adam"``.
        lr: the learning rate.
        task: ``"classify"`` (cross entropy on ``net(x)`` against ``y``), ``"mse"`` (squared
            error against one-hot ``y``: unbounded, so a too-large step diverges) or ``"lm"``
            (the model returns the loss, HF style).
        loss_scale: multiply the loss by this (overflow on purpose).
        nan_weights_at: after the optimizer step of this global step, set one weight to NaN.
        nan_input_at: from this global step on, the batch holds a NaN.
    """

    def __init__(self, net: nn.Module, optimizer: str = "adamw", lr: float = 1e-3, task: str = "classify",
                 loss_scale: float = 1.0, nan_weights_at: int | None = None, nan_input_at: int | None = None) -> None:
        super().__init__()
        self.net, self.optimizer, self.lr, self.task = net, optimizer, lr, task
        self.loss_scale, self.nan_weights_at, self.nan_input_at = loss_scale, nan_weights_at, nan_input_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        if self.nan_input_at is not None and self.global_step >= self.nan_input_at:
            x = x.clone()
            x.view(-1)[0] = float("nan")
        if self.task == "lm":
            loss = self.net(input_ids=x, labels=x).loss
        elif self.task == "mse":
            out = self.net(x)
            loss = F.mse_loss(out, F.one_hot(y, out.shape[-1]).to(out.dtype))
        else:
            loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss * self.loss_scale

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.nan_weights_at is not None and self.global_step - 1 == self.nan_weights_at:
            with torch.no_grad():
                next(p for p in self.net.parameters() if p.requires_grad).view(-1)[0] = float("nan")

    def configure_optimizers(self):  # noqa: ANN201
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr)


# -- data: learnable, so that a healthy run trains ------------------------------------------

def images(seed: int, n: int = 512, size: int = 16, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    x = x + torch.randn(n, 3, 1, 1, generator=g)  # a colour per image: what the label depends on
    w = torch.randn(3, classes, generator=g)
    y = (x.mean((2, 3)) @ w).argmax(1)
    return TensorDataset(x, y)


def zipf_tokens(g: torch.Generator, shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, math.prod(shape), replacement=True, generator=g).view(shape)


def sequences(seed: int, n: int = 512, length: int = 24, vocab: int = 50) -> TensorDataset:
    """Token sequences whose label is whether token 1 is more frequent than token 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    y = ((x == 1).sum(1) > (x == 2).sum(1)).long()
    return TensorDataset(x, y)


# -- models ----------------------------------------------------------------------------------

class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A small ResNet: a frozen stem conv (requires_grad False), BN, three basic blocks, a head."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.conv1.weight.requires_grad_(False)  # a frozen parameter
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = Block(16, 16, 1)
        self.layer2 = Block(16, 32, 2)
        self.layer3 = Block(32, 32, 1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A tiny ViT as timm builds it: ``cls_token`` initialised with std 1e-6, zero biases, a
    frozen position embedding."""

    def __init__(self, dim: int = 32, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 1e-6)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02, requires_grad=False)
        self.blocks = nn.Sequential(*[ViTBlock(dim, 4) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class LSTMClassifier(nn.Module):
    """Embedding, LSTM, a head on ``h_n`` or on the last output only (``last=True``: the other
    timesteps of ``out`` get an exactly-zero gradient, by construction)."""

    def __init__(self, vocab: int = 50, last: bool = False) -> None:
        super().__init__()
        self.last = last
        self.emb = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.fc = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, _) = self.lstm(self.emb(x))
        return self.fc(out[:, -1] if self.last else h[-1])


class BagOfWords(nn.Module):
    """Mean of token embeddings over a 30,000-token vocabulary (most rows untouched by a batch)."""

    def __init__(self, vocab: int = 30000) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x).mean(1) * 4)


class LogOf(nn.Module):
    """A parameterless module: ``log`` of its input from step ``at`` on (NaN where negative)."""

    def __init__(self, owner: list) -> None:
        super().__init__()
        self.owner, self.at = owner, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.at is not None and self.owner[0].global_step >= self.at:
            return x.log()
        return x


# -- makers: (LightningModule, dataset) for a seed -------------------------------------------

def resnet(seed: int, lr: float = 0.05, task: str = "classify") -> tuple[Lit, TensorDataset]:
    return Lit(ResNet(), "sgd", lr, task=task), images(seed)


def vit(seed: int) -> tuple[Lit, TensorDataset]:
    return Lit(ViT(), "adamw", 1e-3), images(seed)


def lstm_h_n(seed: int) -> tuple[Lit, TensorDataset]:
    return Lit(LSTMClassifier(), "adam", 3e-3), sequences(seed)


def lstm_last(seed: int) -> tuple[Lit, TensorDataset]:
    # 128 timesteps: 127 of 128 output gradients are exactly zero (zero_fraction 0.992).
    return Lit(LSTMClassifier(last=True), "adam", 3e-3), sequences(seed, length=128)


def bag_of_words(seed: int) -> tuple[Lit, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    x = zipf_tokens(g, (512, 16), 30000)
    y = ((x < 5).sum(1) > (x.clamp(max=40) >= 10).float().mul(0.12).sum(1)).long()
    return Lit(BagOfWords(), "adam", 1e-2), TensorDataset(x, y)


def gpt2(seed: int) -> tuple[Lit, TensorDataset]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=4)
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 8, (256, 1), generator=g)
    x = (start + torch.arange(32)) % 64  # counting sequences: learnable
    return Lit(GPT2LMHeadModel(config), "adamw", 3e-4, task="lm"), TensorDataset(x, x)


def deep_sigmoid(seed: int) -> tuple[Lit, TensorDataset]:
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    for _ in range(30):
        layers += [nn.Sigmoid(), nn.Linear(16, 16)]
    layers += [nn.Sigmoid(), nn.Linear(16, 3)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    return Lit(nn.Sequential(*layers), "sgd", 0.05), TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def dead_relu(seed: int) -> tuple[Lit, TensorDataset]:
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    return Lit(net, "sgd", 0.05), TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def log_mlp(seed: int, at: int) -> tuple[Lit, TensorDataset]:
    """An MLP whose parameterless ``net.3`` takes the log of a ``Linear`` output from step ``at``."""
    owner: list = []
    log = LogOf(owner)
    log.at = at
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), log, nn.Tanh(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    lit = Lit(net, "adamw", 1e-3)
    owner.append(lit)
    return lit, TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class NanInBackward(FailingBackward):
    """Identity in forward; NaN gradients in backward."""

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * float("nan")


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanInBackward.apply(x)


def nan_backward_mlp(seed: int) -> tuple[Lit, TensorDataset]:
    """An MLP whose parameterless ``net.3`` makes NaN in backward only."""
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), BadBackward(), nn.Tanh(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    return Lit(net, "adamw", 1e-3), TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


HEALTHY = {
    "resnet": resnet, "vit": vit, "lstm_h_n": lstm_h_n, "lstm_last": lstm_last,
    "bag_of_words": bag_of_words, "gpt2": gpt2,
}


def damaged(make, **attributes):  # noqa: ANN001, ANN201
    """``make`` with attributes of its LightningModule set: ``damaged(resnet, loss_scale=1e30)``."""

    def made(seed: int) -> tuple[Lit, TensorDataset]:
        model, data = make(seed)
        for name, value in attributes.items():
            setattr(model, name, value)
        return model, data

    return made


# -- one fit, and the CLI on its log ---------------------------------------------------------

def fit(root: Path, make, seed: int = 0, steps: int = 30, every: int = 3, batch: int = 16,  # noqa: ANN001
        **hooks_kwargs) -> tuple[object, str, str, Lit]:
    """Fit ``make(seed)`` for ``steps`` steps with ``GradHooks(every_n_steps=every)``.

    Returns:
        the report the callback printed, its text, the run's log folder and the model.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on a shared 2-core machine: threads cost 10-100x
    try:
        return _fit(root, make, seed, steps, every, batch, **hooks_kwargs)
    finally:
        torch.set_num_threads(threads)


def _fit(root: Path, make, seed: int, steps: int, every: int, batch: int, **hooks_kwargs):  # noqa: ANN001, ANN202
    pl.seed_everything(seed, verbose=False)
    model, data = make(seed)
    callback = GradHooks(every_n_steps=every, histograms=False, **hooks_kwargs)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(str(root), name="logs"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=every, callbacks=[callback],
    )
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))
    with contextlib.suppress(Exception):  # a fit that dies of its damage still reports
        trainer.fit(model, loader)
    report = callback.gradient_log.report  # the report it printed, kept after fit
    return report, report.table(), trainer.logger.log_dir, model


def cli(*args: str) -> tuple[int, str, str]:
    """``python -m lightning_gradhooks`` in this process: exit status, stdout, stderr."""
    from lightning_gradhooks.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def cli_table(log_dir: str, *args: str) -> str:
    """The report the CLI prints for one run folder (without its ``== folder`` line)."""
    code, out, err = cli("report", log_dir, *args)
    assert code in (0, 1), err
    return out.split("\n", 1)[1].rstrip("\n")


if __name__ == "__main__":  # a sweep: python tests/report_panel.py SEED...
    import logging
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    seeds = [int(s) for s in sys.argv[1:]] or [0]
    for name, make in HEALTHY.items():
        for seed in seeds:
            with tempfile.TemporaryDirectory() as root:
                start = time.perf_counter()
                report, text, log_dir, model = fit(Path(root), make, seed)
                same = cli_table(log_dir) == text
                print(f"{name:13s} seed {seed}: {time.perf_counter() - start:5.1f} s, loss {model.losses[0]:.3f} -> "
                      f"{sum(model.losses[-5:]) / 5:.3f}, cli agrees: {same}; {text.splitlines()[0]}")
                if report.rows():
                    print(report.table(full=True))
