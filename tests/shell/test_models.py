"""GradHooks on the models people train: defaults and offload, bitwise gradients, nothing left.

Each model trains a few steps three times: without the callback, with ``GradHooks()`` defaults
(every step logged) and with disk offload on. The callback must not change a single gradient
bit, must log the expected modules at every step, must not repeat a warning, and must leave no
hook behind.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks

from conftest import GradRecorder, hook_snapshot, make_trainer, pooled_calls, read_events

STEPS = 3


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Residual(8), Residual(8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(self.stem(x)).mean(dim=(2, 3)))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, a head tied to the embedding, dict output."""

    def __init__(self, vocab: int = 32, dim: int = 16, length: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(length, dim))  # makes the GPT module itself monitored
        self.blocks = nn.ModuleList(GPTBlock(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"logits": logits, "loss": loss}


class GPTBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)  # returns (out, None)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1])


class FrozenBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Checkpointed(nn.Module):
    """MLP blocks under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)) for _ in range(2)
        )
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def classify(net: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(net(x), y)


def language_model(net: nn.Module, batch: tuple) -> torch.Tensor:
    tokens, targets = batch
    return net(tokens, targets)["loss"]


def data(kind: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = 4 * STEPS
    if kind == "image":
        x = torch.randn(n, 3, 8, 8, generator=g)
    elif kind == "tokens":
        tokens = torch.randint(0, 32, (n, 9), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    elif kind == "sequence":
        x = torch.randn(n, 5, 4, generator=g)
    else:
        x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (n,), generator=g)), batch_size=4)


class Lit(pl.LightningModule):
    def __init__(self, net: nn.Module, loss) -> None:  # noqa: ANN001
        super().__init__()
        self.net = net
        self.loss = loss

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return self.loss(self.net, batch)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


# model, loss, data, modules whose grad_output must be logged at every step, modules that must not
MODELS = {
    "resnet": (ResNet, classify, "image", ["net.stem.0", "net.stem.1", "net.layer1.0.conv1", "net.layer1.1.bn2", "net.fc"], []),
    "gpt": (
        GPT,
        language_model,
        "tokens",
        ["net/logits", "net.tok", "net.blocks.0.attn/0", "net.blocks.1.mlp.0", "net.norm", "net.head"],
        [],
    ),
    "lstm": (Recurrent, classify, "sequence", ["net.lstm/0", "net.head"], []),
    "frozen": (FrozenBackbone, classify, "vectors", ["net.head"], ["net.backbone.0", "net.backbone.2"]),
    "checkpointed": (
        Checkpointed, classify, "vectors", ["net.stem", "net.blocks.0.0", "net.blocks.1.2", "net.head"], []
    ),
}


class Offloaded(pl.Callback):
    """How many bytes the GradHooks offload engine took, read before it closes."""

    def __init__(self, gradhooks: GradHooks) -> None:
        self.gradhooks, self.bytes = gradhooks, 0

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        self.bytes = self.gradhooks.offload.stats().bytes_offloaded


def train(tmp_path, name: str, callback: GradHooks | None):  # noqa: ANN001, ANN201
    build, loss, kind, _, _ = MODELS[name]
    pl.seed_everything(0, verbose=False)
    model = Lit(build(), loss)
    before = hook_snapshot(model)
    grads = GradRecorder()
    callbacks = [grads] + ([callback] if callback else [])
    if callback and callback.offload_threshold_bytes:
        callbacks.append(Offloaded(callback))
    trainer = make_trainer(tmp_path, callbacks, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data(kind))
    assert hook_snapshot(model) == before
    return trainer, grads.grads, [str(w.message) for w in caught]


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_with_defaults_and_with_offload(tmp_path, name, caplog):
    _, _, _, expected, absent = MODELS[name]
    _, reference, _ = train(tmp_path / "plain", name, None)
    for offload in (None, 256):
        folder = tmp_path / f"offload{offload}"
        folder.mkdir()
        callback = GradHooks(offload_threshold_bytes=offload, offload_dir=str(folder) if offload else None)
        lightning_logger = logging.getLogger("pytorch_lightning")  # it does not propagate to the root
        lightning_logger.addHandler(caplog.handler)
        try:
            trainer, grads, messages = train(tmp_path / str(offload), name, callback)
        finally:
            lightning_logger.removeHandler(caplog.handler)
        # Not one gradient bit changes.
        assert len(grads) == len(reference) == STEPS
        assert all(torch.equal(a, b) for step_a, step_b in zip(grads, reference) for a, b in zip(step_a, step_b))
        events = read_events(trainer.logger.log_dir)
        tags = events.Tags()["scalars"]
        for module in expected:
            assert [e.step for e in events.Scalars(f"∇2 grad_output_norm/{module}")] == list(range(STEPS)), module
        for module in absent:
            assert f"∇2 grad_output_norm/{module}" not in tags
        # No warning (PyTorch's, Lightning's or ours) repeats from step to step.
        repeated = {m for m in messages if messages.count(m) > 1}
        assert not repeated
        if offload:
            offloaded = next(c for c in trainer.callbacks if isinstance(c, Offloaded)).bytes
            assert offloaded > 0  # activations really went to disk
            assert callback.offload is None and not list(folder.iterdir())
    if name == "frozen":
        assert "2 frozen modules (no trainable parameter) are not monitored: net.backbone.0, net.backbone.2" in caplog.text
    if name == "checkpointed":
        # The recomputation in backward is not counted as a second call.
        assert all(set(pooled_calls(trainer.logger.log_dir, m).values()) == {1} for m in expected), expected
    if name == "gpt":
        # The tied head weight is reported once, under its first name.
        assert "∇4 param_grad_norm/net.tok.weight" in tags and "∇4 param_grad_norm/net.head.weight" not in tags


def test_checkpointed_blocks_report_what_the_plain_model_reports():
    from lightning_gradhooks import GradientMonitor

    class Plain(Checkpointed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    records = []
    for cls in (Checkpointed, Plain):
        torch.manual_seed(0)
        net = cls()
        monitor = GradientMonitor(net, include=["*"])
        with monitor.attach():
            for _ in range(2):  # the first backward after attach settles the hooks
                monitor.arm()
                net(x).square().sum().backward()
                records.append({(e.kind, e.name): (e.stats._asdict(), e.calls) for e in monitor.collect().entries})
    checkpointed, plain = records[1], records[3]
    assert checkpointed.keys() == plain.keys() and ("grad_input", "blocks.0.2") in plain
    for key, (stats, calls) in plain.items():
        assert checkpointed[key][1] == calls == 1, key
        assert checkpointed[key][0] == pytest.approx(stats, rel=1e-6, abs=1e-9), key
