"""The report on cases beyond the validation panel's: parameters whose gradient is zero
by construction (a note, never a flag), small gradients that Adam still turns into normal steps,
an explosion seen one logged step before the weights went NaN, a head that no optimizer holds,
two optimizers stepping in one training step, a resumed run, and the opt-in NaN sentinel.
Every fit is a real Lightning fit; the CLI reads the same event files and must print the same."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import report_panel as panel
from lightning_gradhooks import GradHooks
from lightning_gradhooks.health import FLAGS, HealthReport, Thresholds


def classes(seed: int = 0, n: int = 512, features: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class Task(pl.LightningModule):
    """``net`` under cross entropy; ``optimizer(module)`` makes its optimizer."""

    def __init__(self, net: nn.Module, optimizer=lambda m: torch.optim.AdamW(m.parameters(), 1e-3)) -> None:  # noqa: ANN001
        super().__init__()
        self.net, self.make = net, optimizer
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return self.make(self)


def run(root, model, data, steps=30, every=3, version=None, ckpt=None, callbacks=(), **hooks):  # noqa: ANN001, ANN201
    """One fit with GradHooks (the forward statistics on, unless ``hooks`` says); returns (callback, log folder)."""
    pl.seed_everything(0, verbose=False)
    hooks = {"activations": True, "attention_logits": True, **hooks}
    callback = GradHooks(every_n_steps=every, histograms=False, **hooks)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(str(root), name="logs", version=version),
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=every, callbacks=[callback, *callbacks],
    )
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(model, loader, ckpt_path=ckpt)
    return callback, trainer.logger.log_dir


def printed_equals_cli(callback: GradHooks, log_dir: str) -> str:
    text = callback.gradient_log.report.table()
    assert panel.cli_table(log_dir) == text
    return text


# -- zero by construction: a note --------------------------------------------------------------

class Scale(nn.Module):
    """A learned scalar gain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def bias_before_norm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),  # the bias of net.0: removed by BN
                         nn.Linear(32, 32), Scale(), nn.LayerNorm(32), nn.ReLU(),  # the gain of net.4: removed by LN
                         nn.Linear(32, 3))  # (the bias of net.3 is not: LayerNorm removes only its mean)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_bias_before_a_normalisation_is_a_note_not_a_flag(tmp_path, optimizer):
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), 0.05, momentum=0.9),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), 1e-3)}[optimizer]
    model = Task(bias_before_norm(), make)
    callback, log_dir = run(tmp_path, model, classes(), steps=30)
    report = callback.gradient_log.report
    assert report.rows() == [] and report.names() == set(), report.table(full=True)
    assert [f.name for f in report.notes()] == ["param_grad net.4.gain", "param_grad net.0.bias"]
    text = printed_equals_cli(callback, log_dir)
    assert text.splitlines()[0] == "GradHooks: no gradient problems seen in 10 logged steps."
    assert "note: 2 parameters get no gradient by construction" in text and "net.0.bias" in text
    code, out, err = panel.cli("report", log_dir, "--fail-on", ",".join(FLAGS))
    assert code == 0, err


def test_an_exactly_zero_gradient_behind_a_dead_layer_is_no_note_but_stalled_under_it(tmp_path):
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    callback, log_dir = run(tmp_path, Task(net, lambda m: torch.optim.SGD(m.parameters(), 0.05)), classes(), steps=12)
    report = callback.gradient_log.report
    assert report.notes() == []
    (row,) = report.rows()
    assert (row.flag, row.module) == ("dead", "net.2")
    assert ("stalled", "net.4") in {(c.flag, c.module) for c in row.consequences}
    printed_equals_cli(callback, log_dir)


# -- vanishing: only where learning stops -------------------------------------------------------

def _step(report: HealthReport, step: int, small_grad: float, small_update: float) -> None:
    report.add_stats(step, _stats(small_grad, small_update))


def _stats(small_grad: float, small_update: float) -> dict:
    stats = {("param_grad", f"m{i}.weight"): {"mean": 0.0, "std": 1.0, "norm": 10.0} for i in range(10)}
    stats[("param_grad", "tiny.weight")] = {"mean": 0.0, "std": small_grad, "norm": 10.0 * small_grad}
    stats |= {("param", f"m{i}.weight"): {"update_ratio": 1e-3, "param_norm": 10.0} for i in range(10)}
    stats[("param", "tiny.weight")] = {"update_ratio": small_update, "param_norm": 10.0}
    return stats


@pytest.mark.parametrize(("update", "flagged"), [(1e-3, False), (1e-7, True)])
def test_a_small_gradient_is_vanishing_only_when_the_update_stalls_too(update, flagged):
    report = HealthReport()
    for step in range(5):
        _step(report, step, small_grad=1e-6, small_update=update)  # Adam: normal steps; SGD: tiny ones
    assert ("vanishing" in report.names()) is flagged
    without_updates = HealthReport()
    for step in range(5):
        without_updates.add_stats(step, {k: v for k, v in _stats(1e-6, 1e-3).items() if k[0] != "param"})
    assert "vanishing" in without_updates.names()  # no update measured: the gradient alone decides


# -- an explosion one logged step before NaN weights -------------------------------------------

class ReluRNN(nn.Module):
    def __init__(self, radius: float = 1.6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            w = torch.randn(32, 32)
            self.rnn.weight_hh_l0.copy_(w * radius / torch.linalg.eigvals(w).abs().max())
        self.fc = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.view(len(x), 2, 4).repeat(1, 20, 1))
        return self.fc(out[:, -1])


def test_an_explosion_right_before_nan_weights_is_named_where_it_was_seen(tmp_path):
    model = Task(ReluRNN(), lambda m: torch.optim.SGD(m.parameters(), 0.05))
    callback, log_dir = run(tmp_path, model, classes(), steps=12, every=5)
    report = callback.gradient_log.report
    first = report.first_nonfinite
    assert first.since == 5 and "weights already non-finite" in first.detail
    assert "last finite logged step 0, already exploding there" in first.detail  # not "clean"
    row = report.rows()[0]
    assert (row.flag, row.since) == ("exploding", 0) and row.module in ("net.rnn", "net.fc")
    assert [(c.flag, c.since) for c in row.consequences] == [("nonfinite", 5)]
    text = printed_equals_cli(callback, log_dir)
    assert text.startswith("GradHooks: nonfinite on 1 module, exploding on")


# -- a head that no optimizer holds ---------------------------------------------------------------

def test_a_head_left_out_of_the_optimizer_is_stalled_at_once_with_that_reason(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    model = Task(net, lambda m: torch.optim.AdamW(m.net[:4].parameters(), 1e-3))  # net.4 forgotten
    before = net[4].weight.detach().clone()
    callback, log_dir = run(tmp_path, model, classes(), steps=9)
    assert torch.equal(net[4].weight, before)
    (row,) = callback.gradient_log.report.rows()
    assert (row.flag, row.module, row.since) == ("stalled", "net.4", 0)
    assert row.detail == "in no optimizer: it gets gradients, but nothing steps it: net.4.weight, net.4.bias"
    printed_equals_cli(callback, log_dir)


# -- two optimizers in one training step: one logged step ---------------------------------------

def test_two_optimizers_count_one_logged_step_printed_and_from_the_log(tmp_path):
    from conftest import ManualGAN

    callback, log_dir = run(tmp_path, ManualGAN(), TensorDataset(torch.randn(256, 8), torch.zeros(256)), steps=30)
    report = callback.gradient_log.report
    # Two optimizer steps a training step: global steps 0, 6, ..., 24 are logged, two records each.
    assert report.steps == 5
    text = printed_equals_cli(callback, log_dir)
    # The critic's last bias gets exactly no gradient (it cancels between real and fake): a note.
    assert text == ("GradHooks: no gradient problems seen in 5 logged steps.\nnote: 1 parameter gets no gradient by "
                    "construction (float round-off next to the gradient its module receives: a bias followed by a "
                    "normalisation layer, a shift or scale that a later operation removes); never trained, removable: "
                    "optimizer_1/disc.2.bias")


# -- a resumed run: the report and the picture go on ----------------------------------------------

def dead_net() -> Task:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    return Task(net, lambda m: torch.optim.SGD(m.parameters(), 0.05))


@pytest.mark.parametrize("resume_at", ["last", "older"])
def test_a_resumed_run_reports_the_whole_run_as_the_cli_does(tmp_path, resume_at):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10, save_top_k=-1,
                                  filename="{step}")
    first, log_dir = run(tmp_path, dead_net(), classes(), steps=30, every=5, version=0, callbacks=[checkpoints])
    assert first.gradient_log.report.steps == 6
    path = tmp_path / "ckpt" / ("last.ckpt" if resume_at == "last" else "step=20.ckpt")  # older: steps 20, 25 again
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt2", save_last=True)
    second, log_dir = run(tmp_path, dead_net(), classes(), steps=60, every=5, version=0, ckpt=str(path),
                          callbacks=[checkpoints])
    report = second.gradient_log.report
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("dead", "net.2", 0)
    assert report.steps == 12
    text = printed_equals_cli(second, log_dir)
    assert "in 12 logged steps" in text
    assert second.gradient_log._flow.steps == list(range(0, 60, 5))  # the picture resumed too


# -- the sentinel ------------------------------------------------------------------------------

def test_the_sentinel_skips_a_nan_step_that_is_not_logged_and_names_it(tmp_path):
    model, data = panel.log_mlp(0, at=8)
    with pytest.warns(UserWarning, match=r"non-finite values at step 8: caught before the optimizer step"):
        callback, log_dir = run(tmp_path, model, data, steps=14, every=5, catch_nonfinite=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # although every step from 8 on made NaN
    first = callback.gradient_log.report.first_nonfinite
    assert first.since == 8  # not a logged step: 0, 5, 10
    assert "which was skipped (the weights are still finite)" in first.detail
    assert "at step 9, logged in full after it: born in the forward of `net.3`" in first.detail
    printed_equals_cli(callback, log_dir)
    assert callback._fit is None  # the sentinel is let go with the fit


def test_without_the_sentinel_the_weights_go_nan_and_the_report_can_only_say_so(tmp_path):
    callback, log_dir = run(tmp_path, *panel.log_mlp(0, at=8), steps=14, every=5)
    first = callback.gradient_log.report.first_nonfinite
    assert first.since == 10 and first.detail.startswith("weights already non-finite")


def test_catch_nonfinite_is_checked_at_construction():
    with pytest.raises(ValueError, match="catch_nonfinite"):
        GradHooks(catch_nonfinite="yes")


def test_new_thresholds_are_range_checked():
    with pytest.raises(ValueError, match=r"`Thresholds.round_off_factor` expected a number > 0, got 0"):
        Thresholds(round_off_factor=0)
    with pytest.raises(ValueError, match=r"Thresholds.vanishing_update_ratio"):
        Thresholds(vanishing_update_ratio=-1)
    assert math.isclose(Thresholds().round_off_factor, 64.0)
