"""GradHooks with disk offload: every training step offloaded, nothing else, nothing left behind."""

import os

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradhooks import GradHooks
from lightning_gradhooks.offload import DiskOffloadError

from conftest import MLP, FailingBackward, GradRecorder, ManualGAN, hook_snapshot, loader, make_trainer

THRESHOLD = 256  # bytes: the MLP's activations (8 x 16 floats = 512 bytes) go to disk


def saved_tensors_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class OffloadProbe(pl.Callback):
    """Records the engine's counters after each backward and whether hooks are on in eval loops."""

    def __init__(self, gradhooks: GradHooks) -> None:
        self.gradhooks = gradhooks
        self.written: list[int] = []
        self.in_validation: list[bool] = []
        self.folder = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        engine = self.gradhooks._offload
        self.folder = engine.directory
        self.written.append(engine.stats().bytes_offloaded)

    def on_validation_batch_start(self, *args):  # noqa: ANN002
        self.in_validation.append(saved_tensors_hooks_active())


def files_under(path) -> list[str]:  # noqa: ANN001
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def test_offloaded_training_is_bitwise_identical_and_leaves_nothing(tmp_path):
    runs = []
    for threshold in (None, THRESHOLD):
        pl.seed_everything(0, verbose=False)
        model = MLP()
        callback = GradHooks(every_n_steps=2, offload_threshold_bytes=threshold,
                             offload_dir=str(tmp_path / "off") if threshold else None)
        probe, grads = OffloadProbe(callback), GradRecorder()
        callbacks = [callback, grads] + ([probe] if threshold else [])
        make_trainer(tmp_path, callbacks, val_check_interval=3).fit(model, loader(), loader(16))
        runs.append((torch.stack(model.losses), grads.grads))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for sa, sb in zip(grads_a, grads_b) for a, b in zip(sa, sb))
    # Every step handed its activations to the engine; validation ran without the hooks.
    assert len(probe.written) == 6 and all(b > a for a, b in zip([0] + probe.written, probe.written))
    assert probe.in_validation and not any(probe.in_validation)
    assert probe.folder.startswith(str(tmp_path / "off"))
    assert not os.path.exists(probe.folder) and files_under(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()


def test_exception_in_training_step_leaves_no_files_and_no_hooks(tmp_path):
    model = MLP(fail_at=3)
    before = hook_snapshot(model)
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=str(tmp_path / "off"))
    with pytest.raises(RuntimeError, match="boom in training_step"):
        make_trainer(tmp_path, [callback]).fit(model, loader())
    assert files_under(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()
    assert hook_snapshot(model) == before


class FailsInBackward(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return FailingBackward.apply(out) if self.global_step == 2 else out


def test_exception_in_backward_leaves_no_files(tmp_path):
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=str(tmp_path / "off"))
    with pytest.raises(RuntimeError, match="boom in backward"):
        make_trainer(tmp_path, [callback]).fit(FailsInBackward(), loader())
    assert files_under(tmp_path / "off") == []
    assert not saved_tensors_hooks_active()


def test_manual_optimization_runs_offloaded(tmp_path):
    model = ManualGAN(probe=saved_tensors_hooks_active)
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=str(tmp_path / "off"))
    make_trainer(tmp_path, [callback], max_steps=6).fit(model, loader())
    assert model.saved_inside and all(model.saved_inside)
    assert files_under(tmp_path / "off") == []


def test_unwritable_offload_dir_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    model = MLP(fail_at=0)  # would raise "boom" if a step ran
    callback = GradHooks(offload_threshold_bytes=THRESHOLD, offload_dir=str(blocker / "sub"))
    with pytest.raises(DiskOffloadError, match="a_file"):
        make_trainer(tmp_path, [callback]).fit(model, loader())
    assert model.losses == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload_threshold_bytes=0), "`offload_threshold_bytes` expected a positive int or None, got 0"),
        (dict(offload_threshold_bytes="1M"), "`offload_threshold_bytes` expected a positive int or None, got '1M'"),
        (dict(offload_threshold_bytes=1, offload_dir=3), "`offload_dir` expected a str or None, got 3"),
        (dict(offload_dir="/tmp"), "`offload_dir` expected `offload_threshold_bytes` to be set too"),
    ],
)
def test_invalid_offload_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradHooks(**kwargs)
