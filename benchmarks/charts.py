"""How many charts and sections GradHooks gives, with the defaults and with every statistic.

Counts what TensorBoard would show for two logged steps of a plain loop (GradientMonitor and
GradientLog into a SummaryWriter, the same log the callback writes): scalar tags, histogram
tags, images, and the sections of ours (tags up to their first ``/`` that start with ``∇``).

    python benchmarks/charts.py
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from lightning_gradhooks import GradientLog, GradientMonitor
from lightning_gradhooks.log import LOGGED_STATISTICS

sys.path.insert(0, str(Path(__file__).parent))
from many_modules import ResNet18  # noqa: E402


class Block(nn.Module):
    """A ViT block, named as timm names it (norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.attn.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.norm2(x))))


class VitTiny(nn.Module):
    """ViT-Tiny/16 at 224 pixels: 12 blocks of width 192, as timm's ``vit_tiny_patch16_224``."""

    def __init__(self, dim: int = 192, depth: int = 12, classes: int = 1000) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 16, 16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 197, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, 3) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable]] = {
    "ResNet-18": (ResNet18, lambda: torch.randn(2, 3, 64, 64), lambda m, x: m(x).square().mean()),
    "ViT-Tiny": (VitTiny, lambda: torch.randn(2, 3, 224, 224), lambda m, x: m(x).square().mean()),
    "GPT-2, 3 layers": (gpt2, lambda: torch.randint(0, 1000, (2, 32)), lambda m, x: m(x, labels=x).loss),
}


def count(make: Callable[[], nn.Module], batch: Callable[[], torch.Tensor], loss: Callable, statistics) -> dict:  # noqa: ANN001
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as folder:
        writer = SummaryWriter(folder)
        monitor = GradientMonitor(model)
        log = GradientLog(writer, optimizers=[optimizer], statistics=statistics, echo=None)
        with monitor.attach():
            for step in range(2):
                monitor.arm()
                loss(model, batch()).backward()
                log.write(monitor.collect(), step)
                optimizer.step()
                optimizer.zero_grad()
        log.close()
        writer.close()
        events = EventAccumulator(folder, size_guidance={"scalars": 0, "histograms": 0, "images": 0})
        events.Reload()
        tags = events.Tags()
    charted = tags["scalars"] + tags["histograms"] + tags["images"]
    return {
        "scalars": len(tags["scalars"]),
        "histograms": len(tags["histograms"]),
        "sections": len({t.partition("/")[0] for t in charted if t.startswith("∇")}),
    }


def main() -> None:
    print(f"torch {torch.__version__}")
    print("| model | every statistic: sections, scalars, histograms | defaults: sections, scalars, histograms "
          "| default/every: scalars, all tags |")
    print("| --- | --- | --- | --- |")
    for name, (make, batch, loss) in MODELS.items():
        every = count(make, batch, loss, list(LOGGED_STATISTICS))
        default = count(make, batch, loss, None)
        print(f"| {name} | {every['sections']}, {every['scalars']}, {every['histograms']} "
              f"| {default['sections']}, {default['scalars']}, {default['histograms']} "
              f"| {default['scalars'] / every['scalars']:.0%}, "
              f"{(default['scalars'] + default['histograms']) / (every['scalars'] + every['histograms']):.0%} |")


if __name__ == "__main__":
    main()
