"""The validation panel of the health report: small real architectures, healthy and broken on
purpose, fitted for a few dozen steps on the CPU by a real Lightning Trainer.

Each maker returns ``(LightningModule, DataLoader)`` for a seed. The models are written here
(torchvision and timm need another torch than CI's), GPT-2 comes from ``transformers`` with a
small config. ``fit`` runs one fit with ``GradHooks`` and returns the report the callback
printed, its text, and the run's log folder; ``cli`` runs ``python -m lightning_gradhooks
report`` in this process on that folder.

Run as a script for a sweep of the healthy makers above over more seeds:
``PYTHONPATH=$PWD:$PWD/tests python tests/helpers/report_panel.py 0 1 2 3 4``; the bigger panel
(runs of the makers below, in two halves, with expected outcomes:
tests/helpers/report_panel_runs.py):
``PYTHONPATH=$PWD:$PWD/tests python tests/helpers/report_panel.py --half tune|heldout|all [--seeds 0 1]``.
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
        optimizer: ``"sgd"`` (momentum 0.9), ``"adamw"`` or ``"adam"`` (``"adamw_fused"``,
            ``"adam_fused"``: ``fused=True``, which unscales inside its own step under a scaler).
        lr: the learning rate.
        task: ``"classify"`` (cross entropy on ``net(x)`` against ``y``; an HF output's
            ``.logits`` is taken; a ``(B, C, H, W)`` output against ``(B, H, W)`` labels is a
            per-pixel cross entropy), ``"mse"`` (squared error against one-hot ``y``: unbounded, so a
            too-large step diverges), ``"lm"`` (the model returns the loss, HF style) or
            ``"seq2seq"`` (HF encoder-decoder: ``net(input_ids=x, labels=y).loss``).
        loss_scale: multiply the loss by this (overflow on purpose).
        nan_weights_at: after the optimizer step of this global step, set one weight to NaN.
        nan_input_at: from this global step on, the batch holds a NaN (only at that step with
            ``nan_input_once``).
        schedule: ``None`` (constant), ``"cosine"`` or ``"linear"``: a per-step
            (``interval="step"``) LambdaLR, linear warmup over ``warmup`` steps then decay to 0 at
            ``total_steps`` (default: the trainer's ``max_steps``; set it for a resumed run, whose
            first fit stops early).
        weight_decay: of the optimizer (AdamW's decoupled one, L2 for SGD and Adam).
        label_smoothing: of the cross entropy.
        momentum: SGD's momentum.
        left_out: prefixes of parameter names (``"net.fc"``) that no optimizer holds: a
            forgotten head (they still get gradients).
        frozen_lr: prefixes of parameter names put in a param group of their own with lr 0.
        events: ``{global step: fn(lit)}``, each called once before the first batch of that step
            (damage mid-run: ``fn`` sets a bias to -50).
        group_lr: prefixes of parameter names put in a param group of their own with that
            learning rate (discriminative learning rates).
        lr_zero_at: from this global step on, the schedule's factor is 0 (a scheduler that sets
            the learning rate to 0), for the group holding ``lr_zero_group`` (a prefix of
            ``group_lr``) or, when that is None, for every group.

    Attributes:
        bad_batch_at: global steps whose batch is bad (set with :func:`damaged`): a classifier's
            labels shifted by one class, a language model's tokens shuffled across the batch.
    """

    bad_batch_at: tuple[int, ...] = ()

    def __init__(self, net: nn.Module, optimizer: str = "adamw", lr: float = 1e-3, task: str = "classify",
                 loss_scale: float = 1.0, nan_weights_at: int | None = None, nan_input_at: int | None = None,
                 *, nan_input_once: bool = False, schedule: str | None = None, warmup: int = 0,
                 total_steps: int | None = None, weight_decay: float = 0.0, label_smoothing: float = 0.0,
                 momentum: float = 0.9,
                 left_out: tuple[str, ...] = (), frozen_lr: tuple[str, ...] = (), events: dict | None = None,
                 group_lr: dict[str, float] | None = None, lr_zero_at: int | None = None,
                 lr_zero_group: str | None = None) -> None:
        super().__init__()
        self.net, self.optimizer, self.lr, self.task = net, optimizer, lr, task
        self.loss_scale, self.nan_weights_at, self.nan_input_at = loss_scale, nan_weights_at, nan_input_at
        self.nan_input_once, self.schedule, self.warmup, self.total_steps = nan_input_once, schedule, warmup, total_steps
        self.weight_decay, self.label_smoothing, self.momentum = weight_decay, label_smoothing, momentum
        self.left_out, self.frozen_lr, self.events = tuple(left_out), tuple(frozen_lr), dict(events or {})
        self.group_lr, self.lr_zero_at, self.lr_zero_group = dict(group_lr or {}), lr_zero_at, lr_zero_group
        self.losses: list[float] = []

    def on_train_batch_start(self, batch, batch_idx) -> None:  # noqa: ANN001
        for step in sorted(self.events):
            if self.global_step >= step:
                self.events.pop(step)(self)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        at = self.nan_input_at
        if at is not None and (self.global_step == at if self.nan_input_once else self.global_step >= at):
            x = x.clone()
            x.view(-1)[0] = float("nan")
        if self.global_step in self.bad_batch_at:
            x, y = bad_batch(x, y, self.task)
        if self.task == "lm":
            loss = self.net(input_ids=x, labels=x).loss
        elif self.task == "seq2seq":
            loss = self.net(input_ids=x, labels=y).loss
        elif self.task == "contrastive":  # two towers: net(x, y) scores every x against every y of the batch
            logits, target = self.net(x, y), torch.arange(len(x), device=x.device)
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        elif self.task == "mse":
            out = self.net(x)
            loss = F.mse_loss(out, F.one_hot(y, out.shape[-1]).to(out.dtype))
        else:
            out = self.net(x)
            out = getattr(out, "logits", out)
            loss = F.cross_entropy(out, y, label_smoothing=self.label_smoothing)
        self.losses.append(loss.item())
        aux = getattr(self.net, "aux_loss", None)  # a model's own extra loss (MoE load balancing)
        return (loss if aux is None else loss + aux) * self.loss_scale

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.nan_weights_at is not None and self.global_step - 1 == self.nan_weights_at:
            with torch.no_grad():
                next(p for p in self.net.parameters() if p.requires_grad).view(-1)[0] = float("nan")

    def configure_optimizers(self):  # noqa: ANN201
        def under(name: str, prefixes: tuple[str, ...]) -> bool:
            return any(name == p or name.startswith(p + ".") for p in prefixes)

        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad and not under(n, self.left_out)]
        own = (*self.frozen_lr, *self.group_lr)
        groups: list = [{"params": [p for n, p in named if not under(n, own)]}]
        if self.frozen_lr:
            groups.append({"params": [p for n, p in named if under(n, self.frozen_lr)], "lr": 0.0})
        for prefix, lr in self.group_lr.items():
            groups.append({"params": [p for n, p in named if under(n, (prefix,))], "lr": lr})
        fused = {"fused": True} if self.optimizer.endswith("_fused") else {}  # unscales inside its own step()
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        elif self.optimizer.startswith("adam_"):
            opt = torch.optim.Adam(groups, lr=self.lr, weight_decay=self.weight_decay, **fused)
        elif self.optimizer == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr, weight_decay=self.weight_decay)
        elif self.optimizer == "adafactor":
            opt = torch.optim.Adafactor(groups, lr=self.lr, weight_decay=self.weight_decay)
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, weight_decay=self.weight_decay, **fused)
        if self.schedule is None and self.lr_zero_at is None:
            return opt
        total = self.total_steps or self.trainer.max_steps
        shape = warmup_decay(opt, self.warmup, total, self.schedule).lr_lambdas[0] if self.schedule else (lambda s: 1.0)
        cut_group = None if self.lr_zero_group is None else 1 + bool(self.frozen_lr) + list(self.group_lr).index(
            self.lr_zero_group)
        cut = [self.lr_zero_at is not None and cut_group in (None, i) for i in range(len(groups))]

        def factor(i: int):  # noqa: ANN202
            return lambda step: 0.0 if cut[i] and step >= self.lr_zero_at else shape(step)

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [factor(i) for i in range(len(groups))])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def bad_batch(x: torch.Tensor, y: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A bad batch: the labels of a classifier shifted by one class (of those present), the tokens
    of a language model shuffled across the batch."""
    if task == "lm":
        g = torch.Generator().manual_seed(0)
        return x.reshape(-1)[torch.randperm(x.numel(), generator=g)].reshape(x.shape), y
    return x, (y + 1) % (int(y.max()) + 1)


def lr_times(factor: float):  # noqa: ANN201
    """An event: multiply the learning rate of every param group by ``factor`` from then on (a
    scheduler's base learning rates too)."""

    def event(lit: Lit) -> None:
        optimizer = lit.optimizers().optimizer
        for group in optimizer.param_groups:
            group["lr"] *= factor
        for config in lit.trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]

    return event


def warmup_decay(optimizer: torch.optim.Optimizer, warmup: int, total: int, shape: str = "cosine"):  # noqa: ANN201
    """Linear warmup over ``warmup`` steps, then ``shape`` (``"cosine"`` or ``"linear"``) decay to 0 at ``total``;
    ``"restarts"``: cosine to 0 and back to the top, three times (SGDR, warm restarts)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if shape == "restarts":
            period = max(1, (total - warmup) // 3)
            return 0.5 * (1 + math.cos(math.pi * ((step - warmup) % period) / period))
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * done)) if shape == "cosine" else 1.0 - done

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


# -- the bigger panel: more architectures and practices -----------------------------
# Each maker's docstring says what was checked on it, on the code of the day it was written
# (1 CPU thread, seed 0); tests/helpers/report_panel_runs.py holds the runs (maker, fit settings, the
# expected outcome) and the runner.

def hf_offline() -> None:
    """No download: every transformers model here is built from a config."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def counting(seed: int, n: int = 256, length: int = 32, vocab: int = 64, low: int = 0) -> torch.Tensor:
    """Counting sequences ``start, start+1, ...`` (mod ``vocab``, from ``low``): learnable LM data."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - low, (n, 1), generator=g)
    return low + (start + torch.arange(length)) % (vocab - low)


def sequence_labels(seed: int, n: int = 512, length: int = 16, vocab: int = 50) -> TensorDataset:
    """Token sequences labelled by whether token 1 occurs (half the examples hold it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, vocab, (n, length), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(0, length, (n,), generator=g)
    x[y == 1, where[y == 1]] = 1
    return TensorDataset(x, y)


def points(seed: int, n: int = 512, dim: int = 8) -> TensorDataset:
    """Gaussian points, 3 classes from the signs of the first two coordinates."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def gpt2_schedule(seed: int, frozen_lr: tuple[str, ...] = ()) -> tuple[Lit, TensorDataset]:
    """GPT-2 (``transformers``, 2 layers, 32 wide, tied input/output embeddings) on counting
    sequences, AdamW 1e-3 with weight decay 0.01, 20 warmup steps then cosine decay.

    Checked (seed 0, 1 thread, as for every maker below): loss 4.17 -> 1.54 (mean of the last
    tenth) in 200 steps with clip 1.0. With ``frozen_lr=("net.transformer.h.1",)`` block 1 sits in a
    param group with lr 0: its 12 tensors are bit-identical after 60 steps while their gradients
    are not zero (norms 4e-4 to 0.1) and the loss falls (4.17 -> 3.22)."""
    hf_offline()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    x = counting(seed)
    lit = Lit(GPT2LMHeadModel(config), "adamw", 1e-3, task="lm", schedule="cosine", warmup=20, weight_decay=0.01,
              frozen_lr=frozen_lr)
    return lit, TensorDataset(x, x)


def bart_reverse(seed: int) -> tuple[Lit, TensorDataset]:
    """BART (``transformers``, 2+2 layers, 32 wide, dropout 0.1) learning to reverse a
    sequence; AdamW 3e-3, 10 warmup steps then linear decay.

    Checked: loss 3.46 -> 1.75 in 200 steps. At step 0 every ``k_proj`` bias gets a gradient of
    1e-15 to 1e-12, 1.7e-7 of its module's output gradient: ``q . (k + b)`` shifts every score
    of a query by the same ``q . b``, which the softmax over the keys removes (zero by
    construction inside a stock transformer, not only in hand-written CNNs)."""
    hf_offline()
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=32, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, dropout=0.1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 32, (512, 8), generator=g)
    lit = Lit(BartForConditionalGeneration(config), "adamw", 3e-3, task="seq2seq", schedule="linear", warmup=10)
    return lit, TensorDataset(x, x.flip(1))


def t5_shift(seed: int) -> tuple[Lit, TensorDataset]:
    """T5 (``transformers``, 2+2 layers, d_model 32, no biases, relative attention bias)
    learning ``y = x + 1`` token by token; AdamW 1e-3, 10 warmup steps then cosine decay.

    Checked: loss 4.57 -> 3.80 in 200 steps."""
    hf_offline()
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, 47, (512, 8), generator=g)
    return Lit(T5ForConditionalGeneration(config), "adamw", 1e-3, task="seq2seq", schedule="cosine", warmup=10), \
        TensorDataset(x, x + 1)


def bert_classifier(seed: int, left_out: tuple[str, ...] = ()) -> tuple[Lit, TensorDataset]:
    """BERT for sequence classification (``transformers``, 2 layers, 32 wide, dropout 0.1, a
    pooler) on "does token 1 occur"; AdamW 2e-3 with weight decay 0.01, label smoothing 0.1,
    20 warmup steps then linear decay (run with clipping and ``accumulate_grad_batches=2``).

    Checked: loss 0.691 -> 0.199 in 200 optimizer steps; the key biases get 1.7e-7 of their
    module's output gradient (the softmax over keys, as in BART). With
    ``left_out=("net.classifier",)`` the classifier is in no optimizer: its weight and bias are
    bit-identical after 60 steps while their gradient norms are ~1, and the loss stays at 0.69."""
    hf_offline()
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    lit = Lit(BertForSequenceClassification(config), "adamw", 2e-3, schedule="linear", warmup=20,
              weight_decay=0.01, label_smoothing=0.1, left_out=left_out)
    return lit, sequence_labels(seed)


def lora_gpt2(seed: int) -> tuple[Lit, TensorDataset]:
    """``peft`` LoRA (r 8, on ``c_attn``, ``c_proj`` and ``c_fc``) on a frozen random GPT-2 (2
    layers, 32 wide): most parameters frozen, every ``lora_B`` zero-initialised (so every
    ``lora_A`` gradient is exactly 0 at step 0); AdamW 1e-2, cosine after 10 warmup steps.

    Checked: loss 4.17 -> 3.75 in 200 steps (the frozen random base limits it)."""
    hf_offline()
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], lora_dropout=0.0,
                           fan_in_fan_out=True)
    net = peft.get_peft_model(GPT2LMHeadModel(config), lora)
    x = counting(seed)
    return Lit(net, "adamw", 1e-2, task="lm", schedule="cosine", warmup=10), TensorDataset(x, x)


def lora_distilbert(seed: int) -> tuple[Lit, TensorDataset]:
    """``peft`` LoRA (r 8, on ``q_lin`` and ``v_lin``) on a frozen random DistilBERT classifier
    (2 layers, 32 wide), its ``pre_classifier`` and ``classifier`` trained in full
    (``modules_to_save``); AdamW 3e-3, linear decay after 10 warmup steps.

    Checked: loss 0.695 -> 0.053 in 200 steps."""
    hf_offline()
    import peft
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=32, num_labels=2)
    net = peft.get_peft_model(DistilBertForSequenceClassification(config), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_lin", "v_lin"], modules_to_save=["pre_classifier", "classifier"]))
    return Lit(net, "adamw", 3e-3, schedule="linear", warmup=10), sequence_labels(seed)


class BiasBlock(nn.Module):
    """A ResNet basic block written as many hand-written ones are: ``Conv2d(bias=True)`` right
    before ``BatchNorm2d`` (the bias is removed by the normalisation's mean)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride), nn.BatchNorm2d(cout)) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class BiasResNet(nn.Module):
    """A small ResNet with a conv bias before every BatchNorm (stem and blocks), a head."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = BiasBlock(16, 16, 1)
        self.layer2 = BiasBlock(16, 32, 2)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def bias_resnet(seed: int, left_out: tuple[str, ...] = ()) -> tuple[Lit, TensorDataset]:
    """:class:`BiasResNet`, SGD 0.05 momentum 0.9, weight decay 5e-4, 20 warmup steps then
    cosine (run with ``gradient_clip_val=1.0``).

    Checked: loss 1.49 -> 0.39 in 200 steps. At step 0 every conv bias before a BatchNorm gets
    a gradient norm of 5e-8 to 1e-7, ~2e-6 of its conv's output-gradient norm, against 0.56 for
    the stem conv's weight; never exactly 0.0 (float32 round-off of a mean that is 0 in exact
    arithmetic). With ``left_out=("net.fc",)`` the head is in no optimizer: ``net.fc`` is
    bit-identical after 60 steps while its weight's gradient norm is ~37, and the loss still
    falls (1.49 -> 0.54): the body adapts to the random head."""
    lit = Lit(BiasResNet(), "sgd", 0.05, schedule="cosine", warmup=20, weight_decay=5e-4, left_out=left_out)
    return lit, images(seed)


class DepthwiseSeparable(nn.Module):
    """MobileNet's block: depthwise 3x3 conv, BN, ReLU6, pointwise 1x1 conv, BN, ReLU6."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.bn2(self.pw(F.relu6(self.bn1(self.dw(x))))))


class MobileNet(nn.Module):
    """A MobileNet-v1-like CNN: a stem, four depthwise-separable blocks, dropout, a head."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.blocks = nn.Sequential(DepthwiseSeparable(16, 32, 1), DepthwiseSeparable(32, 32, 2),
                                    DepthwiseSeparable(32, 64, 1), DepthwiseSeparable(64, 64, 2))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.blocks(self.stem(x)).mean((2, 3))))


def mobilenet(seed: int, lr: float = 0.05, task: str = "classify", frozen_lr: tuple[str, ...] = ()) -> tuple[Lit, TensorDataset]:
    """:class:`MobileNet`, SGD momentum 0.9 (Nesterov-free), weight decay 4e-5, warmup 10 then
    cosine (run with ``accumulate_grad_batches=4`` on batches of 8).

    Checked: loss 1.44 -> 0.46 in 200 optimizer steps (``accumulate_grad_batches=4``, batches
    of 8). With ``frozen_lr=("net.blocks.2",)`` (60 steps) block 2's parameters are bit-identical
    after the fit (its BN running statistics move: buffers) while their gradient norms are
    7e-4 to 1.1, and the loss falls (1.44 -> 0.69). With ``lr=50, task="mse"`` the loss grows
    0.27, 38, 8e4, ... and is inf at step 7, NaN from step 9."""
    lit = Lit(MobileNet(), "sgd", lr, task=task, schedule="cosine", warmup=10, weight_decay=4e-5, frozen_lr=frozen_lr)
    return lit, images(seed)


class UNet(nn.Module):
    """A two-level UNet for per-pixel classes: every conv has a bias and is followed by
    BatchNorm (so its bias gets a gradient of round-off only), a transposed-conv upsampling and
    a skip connection by concatenation, a 1x1 head with a (useful) bias."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()

        def cbr(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU())

        self.enc1, self.enc2 = cbr(3, 8), cbr(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, 2)
        self.dec = cbr(16, 8)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        return self.head(self.dec(torch.cat([self.up(e2), e1], 1)))


def unet(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`UNet` segmenting where ``x[0] + x[1]`` (smoothed) is positive; Adam 3e-3,
    warmup 10 then cosine.

    Checked: loss 0.775 -> 0.136 in 200 steps; at step 0 the conv biases of ``enc1.0``,
    ``enc2.0`` and ``dec.0`` get gradient norms of 2e-9 to 1.4e-8 (4e-7 to 9e-7 of their conv's
    output gradient), never exactly 0.0, against 0.28 for the head's bias. With a NaN in the
    batch of step 23 only, the loss is NaN from step 23 on (the weights are)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 3, 16, 16, generator=g)
    smooth = F.avg_pool2d(x[:, :2].sum(1, keepdim=True), 3, 1, 1)
    y = (smooth[:, 0] > 0).long()
    return Lit(UNet(), "adam", 3e-3, schedule="cosine", warmup=10), TensorDataset(x, y)


class Generator(nn.Module):
    """DCGAN's generator: ``Linear(bias=True)`` then ``BatchNorm1d``, two transposed convs (the
    first with a bias before ``BatchNorm2d``), tanh: 16x16 one-channel images."""

    def __init__(self, z: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(z, 32 * 4 * 4)
        self.bn0 = nn.BatchNorm1d(32 * 4 * 4)
        self.up1 = nn.ConvTranspose2d(32, 16, 4, 2, 1)
        self.bn1 = nn.BatchNorm2d(16)
        self.up2 = nn.ConvTranspose2d(16, 1, 4, 2, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn0(self.fc(z))).view(-1, 32, 4, 4)
        return torch.tanh(self.up2(F.relu(self.bn1(self.up1(x)))))


class Discriminator(nn.Module):
    """DCGAN's discriminator: two strided convs (the second with a bias before BatchNorm),
    LeakyReLU, a linear logit."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 4, 2, 1)
        self.c2 = nn.Conv2d(16, 32, 4, 2, 1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.c1(x), 0.2)
        return self.fc(F.leaky_relu(self.bn2(self.c2(x)), 0.2).flatten(1))


class GAN(pl.LightningModule):
    """A DCGAN under manual optimization with two optimizers (discriminator, then generator,
    Adam 2e-4 betas (0.5, 0.999) each). ``losses`` holds what should fall in healthy training:
    the distance between the batch statistics (per-pixel mean and std) of fakes and reals."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = Generator(), Discriminator()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx) -> None:  # noqa: ANN001
        real, _ = batch
        opt_d, opt_g = self.optimizers()
        z = torch.randn(len(real), 16)
        fake = self.gen(z)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = F.binary_cross_entropy_with_logits(self.disc(real), ones) + \
            F.binary_cross_entropy_with_logits(self.disc(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.disc(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        with torch.no_grad():
            gap = (fake.mean(0) - real.mean(0)).norm() + (fake.std(0) - real.std(0)).norm()
        self.losses.append(gap.item())

    def configure_optimizers(self):  # noqa: ANN201
        return (torch.optim.Adam(self.disc.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999)))


def blobs(seed: int, n: int = 512) -> TensorDataset:
    """16x16 images in [-1, 1]: one bright Gaussian blob near the centre on a dark background."""
    g = torch.Generator().manual_seed(seed)
    centre = 8 + torch.randn(n, 2, generator=g) * 1.5
    grid = torch.arange(16.0)
    d2 = (grid.view(1, 16, 1) - centre[:, 0].view(n, 1, 1)) ** 2 + (grid.view(1, 1, 16) - centre[:, 1].view(n, 1, 1)) ** 2
    return TensorDataset((2 * torch.exp(-d2 / 8) - 1).unsqueeze(1), torch.zeros(n, dtype=torch.long))


def dcgan(seed: int) -> tuple[GAN, TensorDataset]:
    """:class:`GAN` on :func:`blobs`, batches of 32.

    Checked: the fake/real batch-statistics gap falls 20.7 -> 12.9 in 150 batches (300
    optimizer steps: Lightning counts both optimizers' steps in ``global_step``); D and G
    losses stay finite. At step 0 the biases before a BatchNorm get round-off: ``disc.c2.bias``
    1.9e-7 (its weight 5.7), ``gen.fc.bias`` 1.3e-8 (weight 0.28), ``gen.up1.bias`` 5e-8 (weight 1.3)."""
    return GAN(), blobs(seed)


class MoE(nn.Module):
    """A mixture-of-experts MLP with top-1 routing: a router, four expert MLPs, each expert run on
    the tokens routed to it only (an expert with no token in a batch is skipped, as real MoE code
    does), its output weighted by the router's probability; ``balance``: the weight of Switch's
    load-balancing loss (``aux_loss``, added by :class:`Lit`); ``router_bias``: the router's
    initial bias (default 0)."""

    def __init__(self, dim: int = 8, hidden: int = 32, experts: int = 4, classes: int = 3, balance: float = 0.0,
                 router_bias: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.balance, self.aux_loss = balance, None
        self.inp = nn.Linear(dim, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))
                                     for _ in range(experts))
        self.out = nn.Linear(hidden, classes)
        with torch.no_grad():
            self.router.bias.copy_(torch.tensor(router_bias or [0.0] * experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        probs = self.router(h).softmax(-1)
        top, choice = probs.max(-1)
        if self.balance:  # Switch Transformer's load-balancing loss: E * sum_i(tokens share_i * mean prob_i)
            share = F.one_hot(choice, probs.shape[-1]).float().mean(0)
            self.aux_loss = self.balance * probs.shape[-1] * (share * probs.mean(0)).sum()
        mixed = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(1)
            if len(rows):
                mixed = mixed.index_add(0, rows, expert(h[rows]) * top[rows, None])
        return self.out(h + mixed)


def moe(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`MoE` on :func:`points` (batches of 32), AdamW 3e-3, linear decay after 10 warmup
    steps, Switch's load-balancing loss with weight 0.05.

    Checked on seeds 0 to 3: the loss falls (1.11 -> 0.29 on seed 0); the least used expert gets
    11 to 20 % of the tokens (seed 0: expert 0, 11 %, no token in 7 of 200 batches, never 3
    batches in a row). With a weight of 0.01 it is not healthy: on seed 1 expert 0 gets no token
    from step ~40 to the end (a collapse, as in :func:`moe_collapsed`)."""
    return Lit(MoE(balance=0.05), "adamw", 3e-3, schedule="linear", warmup=10), points(seed)


def moe_collapsed(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`MoE` without load balancing, its router biased against expert 3
    (``[0.5, 0.5, 0.5, -2]``): the routing collapses. AdamW 3e-3, linear decay after 10 warmup steps.

    Checked: expert 3 gets no token in any of 200 batches, expert 0 ~5 at step 0 and none from
    step ~20 on: their parameters have no gradient (``None``), expert 3's are bit-identical at the
    end, while the loss still falls (1.11 -> 0.28) through experts 1 and 2."""
    net = MoE(router_bias=(0.5, 0.5, 0.5, -2.0))
    return Lit(net, "adamw", 3e-3, schedule="linear", warmup=10), points(seed)


class ScaleShift(nn.Module):
    """``x * scale + shift`` with a learned scalar scale and shift: removed entirely by the
    LayerNorm after it (it normalises over the same features)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def scale_before_norm(seed: int) -> tuple[Lit, TensorDataset]:
    """An MLP ``Linear, ScaleShift, LayerNorm, GELU, Dropout(0.1), Linear, LayerNorm, GELU, Linear``:
    ``net.1`` (a learned scalar scale and shift) is removed by the LayerNorm ``net.2`` after it.
    Adam 3e-3, label smoothing 0.1.

    Checked: loss 1.10 -> 0.58 in 100 steps (label smoothing keeps it up). At step 0
    ``net.1.shift`` gets a gradient of 3e-8 (2e-7 of its module's output gradient: round-off)
    and ``net.1.scale`` 1.1e-6 (7e-6: LayerNorm's eps makes the scale not exactly removable),
    against 0.43 for ``net.0.weight``."""
    net = nn.Sequential(nn.Linear(8, 32), ScaleShift(), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1),
                        nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))
    return Lit(net, "adam", 3e-3, label_smoothing=0.1), points(seed)


class AttentionPool(nn.Module):
    """Embedding, GRU, then attention pooling over time: ``score = Linear(h, 1)`` and a softmax
    over timesteps. The score's bias is the same for every timestep, so the softmax removes it."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.score = nn.Linear(dim, 1)
        self.fc = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(x))
        weights = self.score(h).softmax(1)
        return self.fc((weights * h).sum(1))


def attention_pool(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`AttentionPool` on "does token 1 occur", Adam 3e-3, label smoothing 0.05.

    Checked: loss 0.691 -> 0.118 in 150 steps; at step 0 ``net.score.bias`` gets a gradient of
    2.1e-9 (3.7e-7 of its module's output gradient) against 1.2e-2 for ``net.score.weight``."""
    return Lit(AttentionPool(), "adam", 3e-3, label_smoothing=0.05), sequence_labels(seed)


class LayerScaleBlock(nn.Module):
    """A pre-norm ViT block with layer scale (CaiT): each branch multiplied by a learned
    per-channel ``gamma`` initialised at 1e-4, so the branches start 1e-4 times smaller."""

    def __init__(self, dim: int, heads: int, init: float = 1e-4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.gamma1 = nn.Parameter(torch.full((dim,), init))
        self.gamma2 = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma1 * self.attn(self.norm1(x))
        return x + self.gamma2 * self.mlp(self.norm2(x))


class LayerScaleViT(nn.Module):
    """A tiny ViT (4 blocks, 32 wide) with layer scale, a learned position embedding, mean pooling."""

    def __init__(self, dim: int = 32, depth: int = 4, classes: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.pos = nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        self.blocks = nn.Sequential(*[LayerScaleBlock(dim, 4) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(1))


def vit_layerscale(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`LayerScaleViT`, AdamW 2e-3 weight decay 0.05, warmup 20 then cosine (run with clipping 1.0).

    Checked: loss 1.23 -> 0.13 in 200 steps; at step 0 the attention and MLP weights'
    gradient norms are ~5e-5, against ~1.4 for the patch embedding and the head (the layer
    scale), and AdamW moves them at the usual rate anyway."""
    return Lit(LayerScaleViT(), "adamw", 2e-3, schedule="cosine", warmup=20, weight_decay=0.05), images(seed)


class TiedRNNLM(nn.Module):
    """An Elman (tanh) RNN language model whose output projection is its input embedding (tied)."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.RNN(dim, dim, batch_first=True, nonlinearity="tanh")
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.out(h).transpose(1, 2)  # (batch, vocab, time) for cross_entropy


def tied_rnn_lm(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`TiedRNNLM` predicting the next token of counting sequences, SGD 0.5 momentum 0.9,
    linear decay after 10 warmup steps (run with ``gradient_clip_val=0.5``, the classic setting).

    Checked: loss 6.07 -> 2e-4 in 200 steps."""
    x = counting(seed, length=17, vocab=32)
    return Lit(TiedRNNLM(), "sgd", 0.5, schedule="linear", warmup=10), TensorDataset(x[:, :-1], x[:, 1:])


class ReLURNN(nn.Module):
    """Embedding, a ReLU RNN whose recurrent matrix is orthogonal times ``radius``, a head."""

    def __init__(self, vocab: int = 50, dim: int = 64, radius: float = 1.6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.rnn = nn.RNN(16, dim, batch_first=True, nonlinearity="relu")
        self.fc = nn.Linear(dim, 2)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(radius)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(x))
        return self.fc(out[:, -1])


def relu_rnn_explode(seed: int, length: int = 128) -> tuple[Lit, TensorDataset]:
    """:class:`ReLURNN` with spectral radius 1.6 over 24 timesteps, SGD 0.01: explodes.

    Checked: the loss at step 0 is 0.56 but the total gradient norm is 8.6e3 and SGD's update
    moves weights by up to ~26 times their norm; the loss is NaN from step 1 on (as in issue 31:
    the explosion is seen at logged step 0, the weights are NaN before the next logged step)."""
    return Lit(ReLURNN(), "sgd", 0.01), sequences(seed, length=length)


def dead_cnn(seed: int) -> tuple[Lit, TensorDataset]:
    """A plain CNN ``Conv, ReLU, Conv, ReLU, pool, Linear`` whose second conv ``net.2`` has bias
    -50: every output of it is negative, its ReLU passes no gradient. Adam 1e-3.

    Checked: at step 0 (and every step after) the gradients of ``net.2`` and of ``net.0``
    (upstream) are exactly 0, only the head's bias gets one; the loss does not fall (1.38 -> 1.40
    in 60 steps)."""
    net = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 1, 1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    return Lit(net, "adam", 1e-3), images(seed)


def relu_mlp(seed: int, kill_at: int | None = None, bias: float | None = None) -> tuple[Lit, TensorDataset]:
    """A ReLU MLP ``Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear`` on :func:`points`, Adam
    3e-3, cosine after 10 warmup steps. ``bias``: ``net.2``'s bias from the start (-50: dead);
    ``kill_at``: ``net.2``'s bias set to -50 before that step (a layer that dies mid-run).

    Checked: healthy, loss 1.06 -> 0.32 in 200 steps. ``kill_at=100``: the loss is 0.43 over
    steps 90-99 and back at 1.03 at the end; ``net.2``'s bias stays at -50 (moved by 3e-3 by
    Adam's momentum). ``bias=-50``: dead from step 0, the loss stays ~1.05 (1.07 -> 1.03 in 80 steps)."""
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 3))
    if bias is not None:
        with torch.no_grad():
            net[2].bias.fill_(bias)

    def kill(lit: Lit) -> None:
        with torch.no_grad():
            lit.net[2].bias.fill_(-50.0)

    events = {kill_at: kill} if kill_at is not None else None
    return Lit(net, "adam", 3e-3, schedule="cosine", warmup=10, events=events), points(seed)


def deep_sigmoid_cnn(seed: int, depth: int = 12) -> tuple[Lit, TensorDataset]:
    """A plain CNN of ``depth`` 3x3 convs (8 channels, PyTorch's default init) each followed by a
    sigmoid, global pooling, a head; SGD 0.05 momentum 0.9. The sigmoid's slope (at most 1/4)
    shrinks the backward signal at every layer while the forward one stays ~0.5.

    Checked: at step 0 the conv weights' gradient RMS falls from 1.3e-2 at the last conv to
    6e-12 at the first (about 7x per layer), the head's is 0.12; the loss barely moves
    (1.39 -> 1.37 in 60 steps)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Conv2d(3 if i == 0 else 8, 8, 3, 1, 1), nn.Sigmoid()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return Lit(nn.Sequential(*layers), "sgd", 0.05), images(seed)


class LSTMTagger(nn.Module):
    """A two-layer LSTM tagger (dropout 0.2 between the layers): one label per token."""

    def __init__(self, vocab: int = 20, dim: int = 32, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, dropout=0.2, batch_first=True)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(x))
        return self.fc(out).transpose(1, 2)  # (batch, classes, time) for cross_entropy


def lstm_tagger(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`LSTMTagger` labelling each token by whether it is smaller than the one before;
    Adam 3e-3, warmup 10 then linear decay (run with ``gradient_clip_val=0.5``).

    Checked: loss 0.71 -> 0.06 in 200 steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 20, (512, 24), generator=g)
    y = torch.cat([torch.zeros(512, 1, dtype=torch.long), (x[:, 1:] < x[:, :-1]).long()], 1)
    return Lit(LSTMTagger(), "adam", 3e-3, schedule="linear", warmup=10), TensorDataset(x, y)


def roberta_mlm(seed: int) -> tuple[Lit, TensorDataset]:
    """RoBERTa for masked LM (``transformers``, 2 layers, 32 wide, tied decoder) on counting
    sequences with 15 % of the tokens masked (static masks; loss on the masked ones only);
    AdamW 2e-3 weight decay 0.01, warmup 20 then linear decay.

    Checked: loss 4.16 -> 3.49 in 200 steps."""
    hf_offline()
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2)
    x = counting(seed, length=24, low=4)
    g = torch.Generator().manual_seed(seed + 1)
    masked = torch.rand(x.shape, generator=g) < 0.15
    masked[:, 0] = True  # at least one per sequence
    inputs = torch.where(masked, torch.full_like(x, 3), x)  # 3: the mask token
    labels = torch.where(masked, x, torch.full_like(x, -100))
    lit = Lit(RobertaForMaskedLM(config), "adamw", 2e-3, task="seq2seq", schedule="linear", warmup=20,
              weight_decay=0.01)
    return lit, TensorDataset(inputs, labels)


def irnn(seed: int, lr: float = 0.5) -> tuple[Lit, TensorDataset]:
    """An IRNN (Le et al. 2015: a ReLU RNN whose recurrent matrix starts at the identity) on
    "token 1 more frequent than token 2" over 64 timesteps, SGD momentum 0.9 warming up over 50
    steps to ``lr`` then cosine (run with ``gradient_clip_val=1.0``: the clipping keeps the
    weights finite, so the gradients explode without a NaN).

    Checked (``lr=0.5``, total gradient norm before clipping at the logged steps, every 10):
    4e2, 3.5e2, 59 (the identity start), then 1.3 to 1.7 over steps 30-60, 63 at 70 and 57 at
    80, then 3e4, 1e4, 5e5, 2e8, 1e12, 1e5, 3e6, 8e4, 2e4, 2e3, 9e3 over steps 90-190: it stays
    exploded; the loss goes 0.67 at step 40 to 1.3e6 at step 120, and nothing is NaN in 200
    steps. (``lr=0.7`` has single spikes only, 3.9e3 at 70 and 2e13 at 100, each back to ~3
    at the next logged step: not used, its ground truth is unclear.) The run is chaotic: on
    seed 1 the loss is NaN from step 82 (clipping does not save it), on seed 2 the norm stays
    below ~10 but for one logged step: its run is checked on seed 0 only."""
    net = ReLURNN(radius=1.0)
    with torch.no_grad():
        net.rnn.weight_hh_l0.copy_(torch.eye(net.rnn.hidden_size))
    return Lit(net, "sgd", lr, schedule="cosine", warmup=50), sequences(seed, length=64)


def mlp_mse(seed: int, lr: float) -> tuple[Lit, TensorDataset]:
    """A tanh MLP ``Linear, Tanh, Linear, Tanh, Linear`` (64 wide) under a squared loss with SGD
    momentum 0.9 at ``lr``.

    Checked: ``lr=5``: the loss grows 0.33, 5.9, 3.2e3, ... and is inf at step 10, NaN after."""
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    return Lit(net, "sgd", lr, task="mse"), points(seed)


# -- the causes panel (issue 37): practices of no earlier panel, and faults whose cause is not
# the module flagged (a learning rate, a detached output, an input that vanished upstream)

def tiny_init(net: nn.Module, std: float = 0.01) -> nn.Module:
    """Weights from N(0, std), biases 0."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(0.0, std) if name.endswith("weight") else p.zero_()
    return net


def tiny_tanh_mlp(seed: int) -> tuple[Lit, TensorDataset]:
    """An 8-layer tanh MLP (64 wide) initialised with std 0.01: the backward signal shrinks
    ~0.08x per layer, so the first layers' gradients vanish; the last layers' weights get small
    gradients because their inputs are small (not zero by construction). SGD 0.1 momentum."""
    layers: list[nn.Module] = [nn.Linear(8, 64)]
    for _ in range(6):
        layers += [nn.Tanh(), nn.Linear(64, 64)]
    layers += [nn.Tanh(), nn.Linear(64, 3)]
    return Lit(tiny_init(nn.Sequential(*layers)), "sgd", 0.1), points(seed)


def tiny_tanh_cnn(seed: int) -> tuple[Lit, TensorDataset]:
    """8 tanh 3x3 convs (8 channels) initialised with std 0.01, global pooling, a head. SGD 0.1."""
    layers: list[nn.Module] = []
    for i in range(8):
        layers += [nn.Conv2d(3 if i == 0 else 8, 8, 3, 1, 1), nn.Tanh()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return Lit(tiny_init(nn.Sequential(*layers)), "sgd", 0.1), images(seed, size=8)


class EncoderHead(nn.Module):
    """``head(encoder(x))``; ``detach``: the encoder's output is detached (by mistake), so no
    gradient reaches the encoder."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 3)
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.head(h.detach() if self.detach else h)


def detached_encoder(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`EncoderHead` whose encoder output is detached: the encoder's parameters sit in the
    optimizer with ``.grad`` None at every step. Adam 3e-3."""
    return Lit(EncoderHead(detach=True), "adam", 3e-3), points(seed)


class ConvWithSide(nn.Module):
    """A CNN whose logits get a side branch ``net.side`` computed under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 1, 1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 4)
        self.side = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        with torch.no_grad():
            side = self.side(h)
        return self.head(h) + side


def no_grad_side_cnn(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`ConvWithSide`: the side branch's parameters get no gradient. SGD 0.05, cosine."""
    return Lit(ConvWithSide(), "sgd", 0.05, schedule="cosine", warmup=10), images(seed)


def lr_cut_resnet(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`ResNet` (frozen stem) under SGD momentum with a scheduler whose factor is 0 from
    step 120: every parameter stops at once."""
    return Lit(ResNet(), "sgd", 0.05, schedule="cosine", warmup=10, lr_zero_at=120), images(seed)


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.fc = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.emb(x))
        return self.fc(out.mean(1))


def lr_cut_gru(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`GRUClassifier`, AdamW with warmup + linear decay, every learning rate set to 0
    from step 100 by the scheduler."""
    return Lit(GRUClassifier(), "adamw", 3e-3, schedule="linear", warmup=10, lr_zero_at=100), sequences(seed)


class TinyTransformer(nn.Module):
    """Embedding + learned positions, 2 pre-norm encoder layers, mean pooling, a head."""

    def __init__(self, vocab: int = 50, dim: int = 32, length: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x) + self.pos).mean(1))


def group_cut_transformer(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`TinyTransformer`, AdamW, discriminative learning rates (head 3e-3, the rest 1e-3);
    the scheduler sets the head's group to 0 from step 60 while the rest goes on."""
    return Lit(TinyTransformer(), "adamw", 1e-3, group_lr={"net.head": 3e-3}, lr_zero_at=60,
               lr_zero_group="net.head"), sequences(seed)


def adafactor_transformer(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`TinyTransformer` under ``torch.optim.Adafactor`` (lr 1e-2), warmup 10 + linear."""
    return Lit(TinyTransformer(), "adafactor", 1e-2, schedule="linear", warmup=10), sequences(seed)


class WithEMA(nn.Module):
    """``body`` and an EMA copy of it (``torch.optim.swa_utils.AveragedModel``, decay 0.99),
    updated from the weights at each training forward; the copy's parameters require grad, sit
    in no optimizer and get no gradient (it is evaluated, not trained)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.body = body
        self.ema = AveragedModel(body, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema.update_parameters(self.body)
            return self.body(x)
        return self.ema(x)


def ema_layernorm_mlp(seed: int) -> tuple[Lit, TensorDataset]:
    """An MLP with LayerNorm and an EMA copy (:class:`WithEMA`); Adam 3e-3, warmup 10 + cosine."""
    body = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.GELU(), nn.Linear(64, 3))
    return Lit(WithEMA(body), "adam", 3e-3, schedule="cosine", warmup=10), points(seed)


def ema_gru(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`GRUClassifier` with an EMA copy (:class:`WithEMA`); Adam 3e-3, warmup + linear."""
    return Lit(WithEMA(GRUClassifier()), "adam", 3e-3, schedule="linear", warmup=10), sequences(seed)


def weight_norm_mlp(seed: int) -> tuple[Lit, TensorDataset]:
    """A tanh MLP whose Linear layers are weight-normalised
    (``torch.nn.utils.parametrizations.weight_norm``: ``original0`` the norm, ``original1`` the
    direction); Adam 3e-3, warmup 10 + cosine."""
    from torch.nn.utils.parametrizations import weight_norm

    net = nn.Sequential(weight_norm(nn.Linear(8, 64)), nn.Tanh(), weight_norm(nn.Linear(64, 64)), nn.Tanh(),
                        weight_norm(nn.Linear(64, 3)))
    return Lit(net, "adam", 3e-3, schedule="cosine", warmup=10), points(seed)


class StemCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
        for p in self.stem.parameters():
            p.requires_grad_(False)  # a frozen (pretrained) stem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def discriminative_frozen_stem(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`StemCNN`: frozen stem, body at lr 0.01, head in its own group at 0.05; SGD
    momentum, wd 5e-4, warmup 10 + cosine."""
    return Lit(StemCNN(), "sgd", 0.01, group_lr={"net.head": 0.05}, schedule="cosine", warmup=10,
               weight_decay=5e-4), images(seed)


def bf16_resnet(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`ResNet` under SGD momentum, warmup 10 + cosine (run with ``precision="bf16-mixed"``)."""
    return Lit(ResNet(), "sgd", 0.05, schedule="cosine", warmup=10), images(seed)


class Distill(nn.Module):
    """A student MLP and a frozen teacher (``requires_grad`` False, eval mode, in no optimizer):
    the student's logits, and a distillation loss (KL at temperature 2) as ``aux_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3))
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.teacher.eval()
        with torch.no_grad():
            soft = F.softmax(self.teacher(x) / 2, -1)
        logits = self.student(x)
        self.aux_loss = F.kl_div(F.log_softmax(logits / 2, -1), soft, reduction="batchmean") * 4
        return logits


def distill_frozen_teacher(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`Distill`; AdamW 3e-3, warmup 10 + cosine."""
    return Lit(Distill(), "adamw", 3e-3, schedule="cosine", warmup=10), points(seed)


class TwoTowers(nn.Module):
    """CLIP-style: an image tower (a small CNN) and a text tower (embedding bag + MLP) projected
    to 32 dims, normalised, scored against each other with a learned temperature."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 32))
        self.text_emb = nn.Embedding(vocab, 32)
        self.text = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.image(images), dim=-1)
        b = F.normalize(self.text(self.text_emb(tokens).mean(1)), dim=-1)
        return self.logit_scale.exp().clamp(max=100) * a @ b.T


def clip_towers(seed: int) -> tuple[Lit, TensorDataset]:
    """:class:`TwoTowers` on images and captions: a caption's tokens are drawn from 8 of 50
    according to the image's class and colour; AdamW 1e-3 wd 0.1, warmup 10 + cosine."""
    data = images(seed, n=512, size=8)
    g = torch.Generator().manual_seed(seed + 7)
    x, y = data.tensors
    tokens = y[:, None] * 8 + torch.randint(0, 8, (len(y), 12), generator=g)
    tokens[:, :4] = ((x.mean((2, 3)) > 0).long() @ torch.tensor([1, 2, 4]) + 40)[:, None]  # the colour, in words
    return Lit(TwoTowers(), "adamw", 1e-3, task="contrastive", schedule="cosine", warmup=10,
               weight_decay=0.1), TensorDataset(x, tokens)


class SparseBag(pl.LightningModule):
    """A bag of sparse embeddings (``nn.Embedding(sparse=True)``) under ``SparseAdam`` and an MLP
    under Adam, stepped by hand (manual optimization, two optimizers)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.emb = nn.Embedding(2000, 32, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        sparse, dense = self.optimizers()
        loss = F.cross_entropy(self.mlp(self.emb(x).mean(1)), y)
        self.losses.append(loss.item())
        sparse.zero_grad()
        dense.zero_grad()
        self.manual_backward(loss)
        sparse.step()
        dense.step()

    def configure_optimizers(self):  # noqa: ANN201
        return [torch.optim.SparseAdam(list(self.emb.parameters()), lr=1e-2),
                torch.optim.Adam(self.mlp.parameters(), lr=3e-3)]


def sparse_adam_manual(seed: int) -> tuple[SparseBag, TensorDataset]:
    """:class:`SparseBag` on Zipf-distributed tokens of a 2,000 vocabulary, the label whether the
    rare tokens (id >= 100) outnumber a few frequent ones."""
    g = torch.Generator().manual_seed(seed)
    x = zipf_tokens(g, (512, 16), 2000)
    y = ((x >= 100).sum(1) > (x < 3).sum(1)).long()
    return SparseBag(), TensorDataset(x, y)


# -- one fit, and the CLI on its log ---------------------------------------------------------

# -- fp16 under a gradient scaler (issue 43): skipped steps that are the scaler's business, and
# overflows that stay

class Fp16Net(nn.Module):
    """``head(act(blowup(act(body(x)))))``, an MLP whose middle layer is named ``blowup``."""

    def __init__(self, dim: int = 8, width: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.blowup = nn.Linear(width, width)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blowup(self.body(x)))


def weight_times(name: str, factor: float):  # noqa: ANN201
    """An event: multiply the weight of module ``name`` (of the LightningModule) by ``factor``:
    under fp16 autocast, a factor of 1e6 makes its output overflow from then on (a skipped step
    leaves the weight as it is)."""

    def event(lit: Lit) -> None:
        with torch.no_grad():
            lit.get_submodule(name).weight.mul_(factor)

    return event


def loss_times(factor: float):  # noqa: ANN201
    """An event: multiply the loss by ``factor`` from then on (1.0: back to normal)."""

    def event(lit: Lit) -> None:
        lit.loss_scale = factor

    return event


def fp16_mlp(seed: int, optimizer: str = "adam", lr: float = 3e-3, events: dict | None = None) -> tuple[Lit, TensorDataset]:
    """:class:`Fp16Net` on :func:`points` (run under ``init_scale``: fp16 autocast); ``events``
    as :class:`Lit`'s (made per call: a Lit consumes them)."""
    return Lit(Fp16Net(), optimizer, lr, events=events), points(seed)


def fp16_cnn(seed: int, optimizer: str = "sgd", lr: float = 0.05, events: dict | None = None) -> tuple[Lit, TensorDataset]:
    """A plain CNN ``Conv, ReLU, Conv, ReLU, pool, Linear`` on :func:`images` (8x8)."""
    net = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 1, 1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    return Lit(net, optimizer, lr, events=events), images(seed, size=8)


def fp16_transformer(seed: int, optimizer: str = "adamw", lr: float = 1e-3, events: dict | None = None) -> tuple[Lit, TensorDataset]:
    """:class:`TinyTransformer` on :func:`sequences`."""
    return Lit(TinyTransformer(), optimizer, lr, events=events), sequences(seed)


#: The runner's ``--compiled``: every fit's model compiled, its logged steps kept compiled
#: (``eager_logged_steps=False``): the report judges parameter gradients without module statistics.
COMPILED = {"on": False}


def fit(root: Path, make, seed: int = 0, steps: int = 30, every: int = 3, batch: int = 16,  # noqa: ANN001
        *, trainer: dict | None = None, resume_at: int | None = None, **hooks_kwargs) -> tuple[object, str, str, Lit]:
    """Fit ``make(seed)`` for ``steps`` steps with ``GradHooks(every_n_steps=every)``, the forward
    statistics on (``activations=True``, ``attention_logits=True``) unless ``hooks_kwargs`` says.

    Args:
        trainer: more ``pl.Trainer`` arguments (``gradient_clip_val``, ``accumulate_grad_batches``, ...);
            ``init_scale``: fp16 autocast on the CPU (``MixedPrecision("16-mixed", "cpu")``) under a
            new ``torch.amp.GradScaler("cpu", init_scale=...)``.
        resume_at: fit ``resume_at`` steps with ``ModelCheckpoint(save_last=True)`` into the log
            folder ``logs/version_0``, then a new model, a new Trainer and a new ``GradHooks`` fit to
            ``steps`` from ``last.ckpt`` into the same folder; the report returned is the second
            callback's and the model's ``losses`` are those of both fits.

    Returns:
        the report the callback printed, its text, the run's log folder and the model.
    """
    hooks_kwargs = {"activations": True, "attention_logits": True, **hooks_kwargs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on a shared 2-core machine: threads cost 10-100x
    try:
        if resume_at is None:
            return _fit(root, make, seed, steps, every, batch, trainer or {}, **hooks_kwargs)
        *_, first = _fit(root, make, seed, resume_at, every, batch, trainer or {}, checkpoint=True, **hooks_kwargs)
        ckpt = Path(root) / "logs" / "version_0" / "checkpoints" / "last.ckpt"
        assert ckpt.is_file(), f"no {ckpt} after the first fit"
        report, text, log_dir, model = _fit(root, make, seed, steps, every, batch, trainer or {}, checkpoint=True,
                                            ckpt_path=str(ckpt), **hooks_kwargs)
        model.losses[:0] = first.losses
        return report, text, log_dir, model
    finally:
        torch.set_num_threads(threads)


def _fit(root: Path, make, seed: int, steps: int, every: int, batch: int, trainer_kwargs: dict,  # noqa: ANN001, ANN202
         checkpoint: bool = False, ckpt_path: str | None = None, **hooks_kwargs):
    pl.seed_everything(seed, verbose=False)
    model, data = make(seed)
    if COMPILED["on"]:
        hooks_kwargs = {**hooks_kwargs, "eager_logged_steps": False}
    callback = GradHooks(every_n_steps=every, histograms=False, **hooks_kwargs)
    callbacks: list = [callback]
    if checkpoint:  # one folder for both fits of a resumed run, the checkpoint inside it
        logger = TensorBoardLogger(str(root), name="logs", version=0)
        callbacks.append(pl.callbacks.ModelCheckpoint(save_last=True, every_n_train_steps=max(1, steps // 2)))
    else:
        logger = TensorBoardLogger(str(root), name="logs")
    kwargs = dict(
        max_steps=steps, accelerator="cpu", devices=1, logger=logger,
        enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=every, callbacks=callbacks,
    )
    trainer_kwargs = dict(trainer_kwargs)
    if "init_scale" in trainer_kwargs:  # fp16 autocast on the CPU under a fresh gradient scaler
        from pytorch_lightning.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=trainer_kwargs.pop("init_scale"))
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))
    fitted = model
    if COMPILED["on"]:  # --compiled: forward compiled (Dynamo's eager backend), logged steps kept compiled
        fitted = torch.compile(model, backend="eager")
    with contextlib.suppress(Exception):  # a fit that dies of its damage still reports
        trainer.fit(fitted, loader, ckpt_path=ckpt_path)
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
    """The report the CLI prints for one run folder (without its ``== folder`` line and the noise
    scale's sentence, which ``test_noise.py`` compares with the one printed at the end of fit)."""
    code, out, err = cli("report", log_dir, *args)
    assert code in (0, 1), err
    return without_noise(out.split("\n", 1)[1]).rstrip("\n")


def without_noise(out: str) -> str:
    """What the report command printed, less the gradient noise scale's sentence."""
    noise = ("GradHooks: gradient noise scale ~ ", "GradHooks: no gradient noise scale estimate: ")
    return "".join(line for line in out.splitlines(keepends=True) if not line.startswith(noise))


if __name__ == "__main__" and "--half" in sys.argv:  # the bigger panel: tests/helpers/report_panel_runs.py
    sys.path.insert(0, str(Path(__file__).parent))
    import report_panel_runs

    sys.exit(report_panel_runs.main(sys.argv[1:]))

if __name__ == "__main__":  # a sweep: python tests/helpers/report_panel.py SEED...
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
