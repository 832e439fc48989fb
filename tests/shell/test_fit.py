"""_fit.py: what one fit of the shell owns (``Fit``), made and driven at a real Trainer's fit start."""

from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_gradhooks import GradHooks
from lightning_gradhooks.shell._fit import Fit

from conftest import MLP, hook_snapshot, loader


class HeadLeftOut(MLP):
    """The last layer is in no optimizer: it gets gradients and never moves."""

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.net[:4].parameters(), lr=0.1)


class Drive(pl.Callback):
    """Runs ``check(trainer, pl_module)`` at fit start; the fit then stops before its first step."""

    def __init__(self, check) -> None:  # noqa: ANN001
        self.check = check
        self.ran = False

    def on_fit_start(self, trainer, pl_module):  # noqa: ANN001
        self.check(trainer, pl_module)
        self.ran = True
        trainer.should_stop = True


def drive(model: pl.LightningModule, check, tmp_path: Path, **trainer_kwargs) -> None:  # noqa: ANN001
    driver = Drive(check)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[driver], **trainer_kwargs)
    trainer.fit(model, loader())
    assert driver.ran and trainer.global_step == 0


def test_the_interval_is_every_n_steps_or_the_trainers_and_one_rank_pools_nothing(tmp_path):
    intervals = []

    def check(trainer, pl_module):  # noqa: ANN001
        for every in (3, None):
            fit = Fit(GradHooks(every_n_steps=every, compile_statistics=False), trainer, pl_module)
            intervals.append((fit.interval, fit.pooled, fit.offload))
            fit.remove()

    drive(MLP(), check, tmp_path, log_every_n_steps=7)
    assert intervals == [(3, False, None), (7, False, None)]


def test_parameters_no_optimizer_holds_are_collected_with_the_first_optimizers(tmp_path):
    def check(trainer, pl_module):  # noqa: ANN001
        hooks = GradHooks(compile_statistics=False)
        fit = Fit(hooks, trainer, pl_module)
        fit.start(hooks, trainer, pl_module, restored=None)
        head = list(pl_module.net[4].parameters())
        assert [id(p) for p in fit.unowned] == [id(p) for p in head]
        (optimizer,) = trainer.optimizers
        assert [id(p) for p in fit.parameters_of(trainer, optimizer)] == [id(p) for p in pl_module.parameters()]
        fit.remove()

    drive(HeadLeftOut(), check, tmp_path)


def test_the_sentinel_drops_every_gradient_of_a_step_with_a_non_finite_one(tmp_path):
    def check(trainer, pl_module):  # noqa: ANN001
        hooks = GradHooks(catch_nonfinite=True, compile_statistics=False)
        fit = Fit(hooks, trainer, pl_module)
        fit.start(hooks, trainer, pl_module, restored=None)
        params = list(pl_module.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        assert fit.skip_nonfinite(params) is None and all(p.grad is not None for p in params)
        params[2].grad[0, 0] = float("inf")
        assert fit.skip_nonfinite(params) == ["net.2.weight"]
        assert all(p.grad is None for p in params)
        fit.remove()
        assert fit.sentinel is None

    drive(MLP(), check, tmp_path)


def test_remove_takes_out_every_hook_and_closes_the_offload_engine_once(tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()

    def check(trainer, pl_module):  # noqa: ANN001
        before = hook_snapshot(pl_module)
        hooks = GradHooks(offload_threshold_bytes=256, offload_dir=str(folder), compile_statistics=False)
        fit = Fit(hooks, trainer, pl_module)
        fit.start(hooks, trainer, pl_module, restored=None)
        fit.enter_offload()
        fit.enter_offload()  # already active: once
        assert fit.offload.active
        with fit.monitor.arm():
            x, y = next(iter(loader()))
            torch.nn.functional.cross_entropy(pl_module(x), y).backward()
        stats = fit.remove()
        assert stats is not None and stats.files_on_disk == 0 and stats.bytes_offloaded > 0
        assert fit.offload is None and fit.remove() is None  # a second remove: nothing left to do
        assert hook_snapshot(pl_module) == before

    drive(MLP(), check, tmp_path)
    assert list(folder.iterdir()) == []
