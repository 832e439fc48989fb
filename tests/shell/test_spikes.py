"""GradHooks(spikes=True) in real Lightning fits: a bad batch between logged steps named at its
step with the modules carrying it, the next step logged in full (event files), the per-step
chart, the report command, no host read per step, a resume, and the argument's checks."""

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import read_events
from lightning_gradhooks import GradHooks
from lightning_gradhooks.__main__ import main as cli, read_folder
from lightning_gradhooks.summary.records import Kind


class Digits(pl.LightningModule):
    """The digits MLP of examples/train_digits.py (64 inputs, 10 classes), Adam; the labels of the batches at ``bad``
    global steps shifted by one class (the issue's new user's bad batch; its inputs times ``scale`` too)."""

    def __init__(self, bad: tuple[int, ...] = (), scale: float = 1.0) -> None:
        super().__init__()
        self.bad, self.scale = bad, scale
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        if self.global_step in self.bad:
            x, y = x * self.scale, (y + 1) % 10
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def digits(batch_size: int = 32) -> DataLoader:
    """scikit-learn's bundled digits (no download), as examples/train_digits.py reads them."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))


def fit(root: Path, model: pl.LightningModule, steps: int, hooks: GradHooks, **trainer) -> pl.Trainer:  # noqa: ANN003
    pl.seed_everything(0, verbose=False)
    fit_kwargs = trainer.pop("fit", {})
    t = pl.Trainer(max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(root, name="logs", version=0),
                   callbacks=[hooks, *trainer.pop("callbacks", [])], enable_checkpointing=trainer.pop("checkpoint", False),
                   enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50, **trainer)
    t.fit(model, digits(), **fit_kwargs)
    return t


def test_a_bad_batch_between_logged_steps_is_named_at_its_step_and_the_next_step_logged_in_full(tmp_path, capsys):
    hooks = GradHooks(every_n_steps=40, spikes=True)
    trainer = fit(tmp_path, Digits(bad=(97,)), 110, hooks)
    [row] = hooks.gradient_log.report.rows()
    assert (row.flag, row.since) == ("spike", 97)
    assert row.value > 4 and "carried by `net." in row.detail and "step 98 logged in full" in row.detail
    assert row.module.startswith("net.")
    # The event files: every step's norm charted; step 98 logged with every statistic, its
    # forward pass and histograms, off the cadence (0, 40, 80).
    log_dir = trainer.logger.log_dir
    events = read_events(log_dir)
    charted = [e.step for e in events.Scalars("∇1 overview/step_norm")]
    assert charted == list(range(110))
    assert 98 in [e.step for e in events.Scalars("∇1 overview/total_norm")]
    histogram_steps = {e.step for tag in events.Tags()["histograms"] for e in events.Histograms(tag)}
    assert histogram_steps == {0, 98}
    steps = read_folder(Path(log_dir)).steps
    assert sorted(steps) == [0, 40, 80, 97, 98]
    assert {key.kind for key in steps[97]} == {Kind.SPIKE}  # the spike's own summary: no logged step
    kinds = {key.kind for key in steps[98]}
    assert {Kind.PARAM_GRAD, Kind.GRAD_OUTPUT, Kind.OUTPUT, Kind.PARAM} <= kinds
    # The report command names it the same way.
    assert cli(["report", str(log_dir), "--fail-on", "spike"]) == 1
    out = capsys.readouterr().out
    assert row.detail in out


def test_a_healthy_fit_names_no_spike_and_no_step_reads_the_host_more_than_without(tmp_path):
    """`.item()` is `aten._local_scalar_dense`: Lightning's own are the same with and without
    spikes; ours add none (the norms are read one step late, from a copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Reads.count += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    counts = []
    for spikes in (False, True):
        Reads.count = 0
        hooks = GradHooks(every_n_steps=100, spikes=spikes, histograms=False, noise_scale=False)
        with Reads():
            fit(tmp_path / str(spikes), Digits(), 40, hooks)
        counts.append(Reads.count)
        assert hooks.gradient_log.report.rows() == []
    assert counts[1] == counts[0]


def test_a_nan_caught_by_the_sentinel_is_its_row_not_a_spike(tmp_path):
    class NanAt(Digits):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.global_step == 40 else loss

    hooks = GradHooks(every_n_steps=50, spikes=True, catch_nonfinite=True)
    with pytest.warns(UserWarning, match="non-finite values at step 40"):
        fit(tmp_path, NanAt(), 60, hooks)
    rows = hooks.gradient_log.report.rows()
    assert [(r.flag, r.since) for r in rows] == [("nonfinite", 40)]
    assert "caught before the optimizer step" in rows[0].detail


def test_the_spike_rules_window_is_saved_with_the_callback_and_resumed(tmp_path):
    """A bad batch 5 steps after a resume: judged against the window of the first fit (a fresh
    rule would need 16 steps first)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=80)
    first = GradHooks(every_n_steps=50, spikes=True)
    fit(tmp_path, Digits(bad=(85,), scale=4.0), 80, first, callbacks=[checkpoint], checkpoint=True)
    assert len(first.state_dict()["spikes"]["0"]["norms"]) == 80
    second = GradHooks(every_n_steps=50, spikes=True)
    fit(tmp_path, Digits(bad=(85,), scale=4.0), 90, second, fit={"ckpt_path": str(tmp_path / "ckpt" / "last.ckpt")})
    assert [(r.flag, r.since) for r in second.gradient_log.report.rows()] == [("spike", 85)]
    assert len(second.state_dict()["spikes"]["0"]["norms"]) == 90


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_spikes_must_be_a_bool(value):
    with pytest.raises(ValueError, match="`spikes` expected a bool"):
        GradHooks(spikes=value)
