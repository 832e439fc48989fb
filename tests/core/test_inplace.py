"""Models that modify hooked tensors in place: ResNet-style blocks, in-place activations."""

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gradhooks import GradHooks, GradientMonitor

from conftest import hook_snapshot, make_trainer, read_events


class Block(nn.Module):
    """conv-bn-relu(inplace)-conv-bn, ``out += identity``, relu(inplace): both in-place patterns."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.relu(out)


def batch() -> torch.Tensor:
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()


def test_resnet_block_falls_back_where_needed_and_matches_the_reference():
    torch.manual_seed(0)
    block = Block()
    twin = Block(inplace=False)
    twin.load_state_dict(block.state_dict())
    monitor = GradientMonitor(block, include=["conv1", "bn1", "relu", "conv2", "bn2"])
    with monitor.attach():
        with pytest.warns(UserWarning, match=r"in-place .*: bn1, bn2, relu$"), monitor.arm():
            block(batch()).sum().backward()
        monitor.arm()
        block(batch()).sum().backward()
        entries = monitor.collect().entries
    got = {(e.kind, e.name): e.stats._asdict() for e in entries}
    calls = {(e.kind, e.name): e.calls for e in entries}
    assert monitor.fallback == ["bn1", "bn2", "relu"]
    assert all("modified in place" in monitor.plan[name].reason for name in monitor.fallback)

    captured = {}
    for name in ("conv1", "bn1", "conv2", "bn2", "relu"):
        getattr(twin, name).register_forward_hook(
            lambda m, i, o, n=name: captured.setdefault(n, []).append(o)
        )
    loss = twin(batch()).sum()
    outputs = [o for outs in captured.values() for o in outs]
    grads = iter(torch.autograd.grad(loss, outputs))
    for name, outs in captured.items():
        # relu is called twice per forward: its entry pools both gradients.
        want = torch.cat([next(grads).double().flatten() for _ in outs])
        stats = got[("grad_output", name)]
        assert stats["norm"] == pytest.approx(want.norm().item(), rel=1e-5)
        assert stats["absmax"] == pytest.approx(want.abs().max().item(), rel=1e-5)
        assert stats["std"] == pytest.approx(want.std().item(), rel=1e-5)
        assert stats["mean"] == pytest.approx(want.mean().item(), rel=1e-5, abs=1e-7)
    assert calls["grad_output", "relu"] == 2 and calls["grad_output", "conv1"] == 1
    assert ("grad_input", "conv2") in got and ("grad_input", "bn1") not in got


def test_gradients_are_bitwise_unchanged_by_the_monitor():
    results = []
    for monitored in (False, True):
        torch.manual_seed(0)
        block = Block()
        monitor = GradientMonitor(block, include=["*"]) if monitored else None
        handle = monitor.attach() if monitored else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                if monitor:
                    monitor.arm()
                block(batch()).square().sum().backward()
                if monitor:
                    monitor.collect()
        if handle:
            handle.remove()
        results.append([p.grad.clone() for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class BlockNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        features = self.block(self.stem(x)).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(features), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_gradhooks_trains_a_resnet_block_with_defaults(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 2, (16,), generator=g)),
        batch_size=4,
    )
    model = BlockNet()
    before = hook_snapshot(model)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=4)
    with pytest.warns(UserWarning, match="in-place.*block.bn1, block.bn2"):
        trainer.fit(model, data)
    events = read_events(trainer.logger.log_dir)
    for module in ("stem", "block.conv1", "block.bn1", "block.conv2", "block.bn2", "head"):
        assert [e.step for e in events.Scalars(f"∇2 grad_output_norm/{module}")] == [0, 1, 2, 3]
    assert [e.step for e in events.Scalars("∇3 grad_input_norm/block.conv2")] == [1, 2, 3]
    assert hook_snapshot(model) == before
