"""Loggers other than TensorBoard: W&B gets histograms and the report, and what each is told."""

import warnings

import pytest
import pytorch_lightning as pl

from lightning_gradhooks import GradHooks

from conftest import MLP, loader, make_trainer


def test_wandb_logger_gets_scalars_histograms_and_the_report(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from pytorch_lightning.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="gradhooks-test")
    logged: list[dict] = []
    run = logger.experiment
    real_log = run.log

    def spy(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - what W&B is handed
        logged.append(dict(data))
        return real_log(data, *args, **kwargs)

    monkeypatch.setattr(run, "log", spy)
    pl.seed_everything(0, verbose=False)
    with pytest.warns(UserWarning, match="no TensorBoardLogger.*W&B gets the scalars, histograms and the report"):
        trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=2)], logger=logger, max_steps=4)
        trainer.fit(MLP(), loader())
    run_dir = run.dir
    wandb.finish()
    ours = [d for d in logged if any(k.startswith(("grad_output", "param_grad", "∇1 overview")) for k in d)]
    assert [d["trainer/global_step"] for d in ours if "∇2 grad_output_norm/net.0" in d] == [0, 2]
    histograms = {k for d in ours for k, v in d.items() if isinstance(v, wandb.Histogram)}
    assert {"∇6 histograms/grad_output/net.0", "∇6 histograms/param_grad/net.0.weight"} <= histograms
    first = next(d for d in ours if "∇6 histograms/grad_output/net.4" in d)["∇6 histograms/grad_output/net.4"]
    assert len(first.bins) == len(first.histogram) + 1 and sum(first.histogram) > 0
    reports = [d["gradhooks/health_report"] for d in logged if "gradhooks/health_report" in d]
    assert len(reports) == 1 and isinstance(reports[0], wandb.Html)
    assert "logged steps" in reports[0].html
    # W&B wrote the report to the run's media folder.
    from pathlib import Path

    assert list(Path(run_dir).glob("media/html/gradhooks/health_report_*.html"))


def test_fast_dev_run_is_silent_about_loggers(tmp_path):
    trainer = make_trainer(tmp_path, [GradHooks()], fast_dev_run=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(MLP(), loader())
    assert not [w for w in caught if "GradHooks" in str(w.message)]


def test_without_a_logger_the_warning_says_what_is_lost(tmp_path):
    with pytest.warns(UserWarning, match="no statistics, histograms or gradient-flow picture .* report is still printed"):
        make_trainer(tmp_path, [GradHooks()], logger=False, max_steps=2).fit(MLP(), loader())


def test_a_run_with_no_logged_step_says_so(tmp_path, capsys):
    from lightning_gradhooks import GradientLog

    GradientLog().close()  # nothing written: no report to give
    assert "no step was logged" in capsys.readouterr().out
    assert "0 logged steps" not in capsys.readouterr().out
