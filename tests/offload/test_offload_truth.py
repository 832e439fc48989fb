"""Offload never changes what autograd computes or refuses.

torch skips its in-place version check whenever saved-tensor hooks are set: ``save_on_disk``
makes it itself, for tensors kept in memory and for tensors written to disk, before or after
their write, and between two backwards of a retained graph. Nothing autograd accepts is refused.
And a backward pass reads each written tensor once.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gradhooks import GradHooks
from lightning_gradhooks.offload import writer  # their I/O calls are patched below
from lightning_gradhooks.offload import save_on_disk

from conftest import ManualGAN, loader, make_trainer

KEPT, WRITTEN = 1 << 30, 1  # thresholds: every saved tensor stays in memory, or every one is written
INPLACE = "modified by an inplace operation"


def autograd_error(fn) -> str | None:  # noqa: ANN001
    """The message of the RuntimeError that ``fn`` raises, or None."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def sigmoid_then_modify(x: torch.Tensor, ctx: save_on_disk | None, before_backward=lambda: None):  # noqa: ANN001, ANN201
    """The issue's example: SigmoidBackward saves its output ``y``, which changes before backward."""
    if ctx is None:
        y = x.sigmoid()
        z = (y * 2).sum()
    else:
        with ctx:
            y = x.sigmoid()
            z = (y * 2).sum()
    before_backward()
    with torch.no_grad():
        y.add_(1)
    return z


@pytest.fixture(params=[KEPT, WRITTEN], ids=["kept", "written"])
def engine(request, tmp_path: Path):  # noqa: ANN001
    e = save_on_disk(threshold_bytes=request.param, directory=tmp_path)
    yield e
    e.close()


def test_the_issue_example_raises_like_autograd(engine: save_on_disk) -> None:
    x = torch.randn(16, 16, requires_grad=True)
    plain = autograd_error(lambda: sigmoid_then_modify(x, None).backward())
    assert plain is not None and INPLACE in plain
    message = autograd_error(lambda: sigmoid_then_modify(x, engine, engine.flush).backward())
    assert message is not None and INPLACE in message
    # At least as useful as autograd's: which tensor, its versions, and where to look.
    for part in ("torch.float32", "[16, 16]", "at version 0", "now at version 1", "in-place",
                 "torch.autograd.set_detect_anomaly(True)"):
        assert part in message, part
    assert x.grad is None


def test_modified_before_its_write_always_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = writer.pwrite_all
    monkeypatch.setattr(writer, "pwrite_all", lambda *a: gate.wait(10) and real(*a))  # a stalled disk
    e = save_on_disk(threshold_bytes=WRITTEN, directory=tmp_path)
    x = torch.randn(256, 256, requires_grad=True)
    with e:
        y = x.sigmoid()
        z = (y * 2).sum()
    assert e.stats().bytes_written == 0  # nothing written yet: the change lands before the write
    with torch.no_grad():
        y.mul_(3)
    gate.set()
    e.flush()
    assert e.stats().bytes_written > 0  # then written (with the new contents)
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()
    e.close()


def test_modified_around_its_write_raises_every_time(tmp_path: Path) -> None:
    """Not gated: the change races the writer. Before the fix, 1 run in 20 raised."""
    e = save_on_disk(threshold_bytes=WRITTEN, directory=tmp_path)
    x = torch.randn(128, 128, requires_grad=True)
    for _ in range(20):
        z = sigmoid_then_modify(x, e)
        with pytest.raises(RuntimeError, match=INPLACE):
            z.backward()
    e.close()


def test_modified_after_its_write_raises(engine: save_on_disk) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    z = sigmoid_then_modify(x, engine, engine.flush)  # written (or kept) before the change
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()


def test_modified_through_an_alias_after_the_tensor_died(engine: save_on_disk) -> None:
    """A ``detach()`` alias shares the version counter: autograd sees its changes, so do we."""
    x = torch.randn(256, 256, requires_grad=True)
    with engine:
        y = x.sigmoid()
        alias = y.detach()
        z = (y * 2).sum()
    del y
    engine.flush()
    alias.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()


def test_modified_between_two_backwards_of_a_retained_graph(engine: save_on_disk) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with engine:
        y = x.sigmoid()
        z = (y * 2).sum()
    engine.flush()
    z.backward(retain_graph=True)
    first = x.grad.clone()
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE):
        z.backward()
    assert torch.equal(x.grad, first)  # the refused backward accumulated nothing


def test_a_view_modified_after_write_raises(engine: save_on_disk) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with engine:
        y = x * 1.5
        z = y[:, :128].exp().sum()  # saves its result, a fresh tensor; and mul saves nothing of y
        w = (y[64:] * y[64:]).sum()  # saves views of y
    engine.flush()
    z.backward()  # y's change below does not touch exp's saved result
    with torch.no_grad():
        y[0, 0] = 0.0  # a write through y, the views' base
    with pytest.raises(RuntimeError, match=INPLACE):
        w.backward()


# ---------------------------------------------------------------------------- accepted, as by autograd


def cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(8 * 16 * 16, 4))


def train(ctx: save_on_disk | None, checkpoint: bool = False, steps: int = 3) -> list[torch.Tensor]:
    """A few SGD steps of a CNN with in-place ReLUs; returns the losses and final parameters."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=g)

        def forward() -> torch.Tensor:
            inp = x + 0  # saves nothing of x
            if checkpoint:
                h = torch.utils.checkpoint.checkpoint(model[:3], inp, use_reentrant=False)
                return model[3:](h).square().mean()
            return model(inp).square().mean()

        if ctx is None:
            loss = forward()
        else:
            with ctx:
                loss = forward()
        with torch.no_grad():
            x.mul_(0)  # an in-place change of a tensor that nobody saved
        opt.zero_grad()
        loss.backward()
        opt.step()  # optimizer steps between steps change every parameter in place
        out.append(loss.detach())
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_what_autograd_accepts_is_accepted_and_identical(engine: save_on_disk, checkpoint: bool) -> None:
    got = train(engine, checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(train(None, checkpoint), got, strict=True))


def test_inplace_relu_and_unsaved_inplace_changes_are_accepted(engine: save_on_disk) -> None:
    def run(ctx: save_on_disk | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.ReLU(inplace=True))
        x = torch.randn(32, 64)
        with ctx if ctx is not None else torch.enable_grad():
            h = model[0](x)
            unsaved = h * 2  # mul by a number saves nothing
            out = model[1:](h) + unsaved.exp()  # exp saves its result, not `unsaved`
            loss = out.sum()
        with torch.no_grad():
            unsaved.add_(1)  # nobody saved it
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(None), run(engine), strict=True))


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_compiled_model_is_accepted(engine: save_on_disk) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    x = torch.randn(16, 32)
    try:
        compiled = torch.compile(model, backend="eager")
        with engine:
            loss = compiled(x).sum()
    except Exception as exc:  # noqa: BLE001 - a torch without a working compiler here
        pytest.skip(f"torch.compile unavailable: {exc}")
    loss.backward()
    ref = nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


# ---------------------------------------------------------------------------- Lightning: a GAN stepping D early


class StaleGAN(ManualGAN):
    """Computes G's loss, steps D, then runs G's backward through D's changed weights: a bug that
    autograd refuses."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        fake = self.gen(torch.randn_like(x))
        loss_g = -self.disc(fake).mean()  # saves D's weights
        loss_d = self.disc(fake.detach()).mean() - self.disc(x).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()  # D changes in place...
        opt_g.zero_grad()
        self.manual_backward(loss_g)  # ...before G's backward needs its old weights
        opt_g.step()


@pytest.mark.parametrize("callback", ["none", "gradhooks", "offload"])
def test_gan_stepping_d_before_g_backward_raises_in_lightning(tmp_path: Path, callback: str) -> None:
    callbacks = {"none": [], "gradhooks": [GradHooks()],
                 "offload": [GradHooks(offload_threshold_bytes=1 << 20, offload_dir=str(tmp_path))]}[callback]
    pl.seed_everything(0, verbose=False)
    with pytest.raises(RuntimeError, match=INPLACE):
        make_trainer(tmp_path, callbacks, max_steps=2).fit(StaleGAN(), loader())


# ---------------------------------------------------------------------------- prefetch reads each record once


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions, batch norms, in-place ReLUs, a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.down is None else self.down(x)
        out = self.b2(self.c2(self.relu(self.b1(self.c1(x)))))
        return self.relu(out + shortcut)


def resnet18_like(width: int = 8) -> nn.Sequential:
    """ResNet-18's layout (torchvision is not installed), narrow."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, w in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for j in range(2):
            layers.append(Block(cin, w, 2 if j == 0 and i > 0 else 1))
            cin = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


@pytest.mark.parametrize("prefetch_bytes", [32 << 20, 64 << 10, 0])
def test_resnet_reads_each_record_once(tmp_path: Path, prefetch_bytes: int) -> None:
    model, x = resnet18_like(), torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    e = save_on_disk(threshold_bytes=1, directory=tmp_path, prefetch_bytes=prefetch_bytes)
    with e:
        loss = model(x).square().sum()
    e.flush()  # everything on disk: backward reads it all
    loss.backward()
    s = e.stats()
    assert s.tensors_offloaded > 100 and s.bytes_written > 0
    assert s.bytes_read == s.bytes_written  # each record read once, prefetched or not
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters(), strict=True))
    e.close()


def test_resnet_retained_graph_reads_twice_at_most(tmp_path: Path) -> None:
    model, x = resnet18_like(), torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    e = save_on_disk(threshold_bytes=1, directory=tmp_path)
    with e:
        loss = model(x).square().sum()
    e.flush()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    assert e.stats().bytes_read == e.stats().bytes_written
    model.zero_grad()
    loss.backward()  # the second backward reads everything again, once
    s = e.stats()
    assert s.bytes_read == 2 * s.bytes_written
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters(), strict=True))
    e.close()
