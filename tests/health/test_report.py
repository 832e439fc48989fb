"""The gradient-health report (report.py) through real Lightning fits and on hand-made series;
the validation panel of real architectures is in test_report_panel.py, the command in
test_report_cli.py."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gradhooks import GradHooks
from lightning_gradhooks.health import HealthReport

from conftest import loader, make_trainer, read_events
from report_panel import without_noise


# -- the report on pathologies built on purpose, through real Lightning fits ----------------






class Net(pl.LightningModule):
    """``net`` on 8 features to 3 classes; ``groups(net)`` gives the optimizer's parameter groups."""

    def __init__(self, net: nn.Module, groups=None, nan_in: str | None = None, nan_from: int = 0) -> None:  # noqa: ANN001
        super().__init__()
        self.net, self.groups = net, groups
        self.nan_in, self.nan_from = nan_in, nan_from
        if nan_in is not None:
            net.get_submodule(nan_in).register_forward_hook(self._poison)

    def _poison(self, module, args, output):  # noqa: ANN001, ANN202
        if self.training and self.global_step >= self.nan_from:
            output = output.clone()
            output[0, 0] = float("nan")
            return output
        return None

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        groups = self.groups(self.net) if self.groups else self.net.parameters()
        return torch.optim.SGD(groups, lr=0.05)


def fit_report(tmp_path, model, steps=12, **kwargs):  # noqa: ANN001, ANN201
    pl.seed_everything(0, verbose=False)
    callback = GradHooks(every_n_steps=2, histograms=False, **kwargs)
    trainer = make_trainer(tmp_path, [callback], max_steps=steps)
    trainer.fit(model, loader(n=256))
    return trainer, callback.gradient_log.report


def mlp(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def flags_of(report: HealthReport, flag: str) -> dict[str, int]:
    """Flagged entries (``"grad_output net.0"``; for ``dead``, modules) and their first step."""
    return {f.name: f.since for f in report.flags() if f.flag == flag}


def test_healthy_model_gets_no_flag_and_the_report_reaches_the_text_tab(tmp_path, caplog):
    model = Net(mlp(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)))
    lightning_logger = logging.getLogger("pytorch_lightning")
    lightning_logger.addHandler(caplog.handler)
    try:
        trainer, report = fit_report(tmp_path, model)
    finally:
        lightning_logger.removeHandler(caplog.handler)
    assert report.flags() == []
    assert "GradHooks: no gradient problems seen in 6 logged steps." in caplog.text
    events = read_events(trainer.logger.log_dir)
    assert "gradhooks/health_report/text_summary" in events.Tags()["tensors"]


def test_deep_sigmoid_stack_is_flagged_vanishing_from_the_first_step(tmp_path):
    layers = []
    for _ in range(12):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    model = Net(mlp(nn.Linear(8, 16), *layers, nn.Linear(16, 3)))
    _, report = fit_report(tmp_path, model)
    vanishing = flags_of(report, "vanishing")
    assert vanishing.get("grad_output net.0") == 0
    assert "grad_output net.24" not in vanishing  # the head is healthy


def test_relu_layer_with_bias_minus_50_is_flagged_dead(tmp_path):
    net = mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    _, report = fit_report(tmp_path, Net(net))
    dead = flags_of(report, "dead")  # module level: output and parameter gradients all zero
    assert dead == {"net.2": 0, "net.0": 0}  # net.0: upstream, no gradient reaches it
    (row,) = report.rows()  # one row, its consequences under it
    assert (row.flag, row.module, row.since) == ("dead", "net.2", 0)
    assert {(f.flag, f.module) for f in row.consequences} == {
        ("dead", "net.0"), ("stalled", "net.0"), ("stalled", "net.2"), ("stalled", "net.4")
    }


def test_nan_injected_mid_network_is_flagged_at_its_first_step(tmp_path):
    net = mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    _, report = fit_report(tmp_path, Net(net, nan_in="2", nan_from=4))
    (first,) = [r for r in report.rows() if r.flag == "nonfinite"]
    assert first.since == 4
    assert first.module == "net.2"  # where it was born, not where backward first saw it
    assert first.detail.startswith("born in the forward of `net.2`; last clean logged step 2")


# -- update_ratio against an independent reference -------------------------------------------

from conftest import MLP, ManualGAN  # noqa: E402


class UpdateReference(pl.Callback):
    """A copy of the weights before each optimizer step; ‖after - before‖ / ‖before‖ at batch end."""

    def __init__(self) -> None:
        self.ratios: dict[tuple[int, str], float] = {}
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self.step = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        index = [getattr(o, "_optimizer", o) for o in trainer.optimizers].index(getattr(optimizer, "_optimizer", optimizer))
        prefix = f"optimizer_{index}/" if len(trainer.optimizers) > 1 else ""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for name, p in pl_module.named_parameters():
            if id(p) in ids:
                self._before[prefix + name] = (p, p.detach().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        for name, (p, old) in self._before.items():
            self.ratios[(self.step, name)] = ((p.detach() - old).norm() / old.norm()).item()
        self._before.clear()


@pytest.mark.parametrize(
    "case", ["sgd", "adam_accumulation", "two_optimizers_manual"]
)
def test_update_ratio_equals_a_copy_of_the_weights_before_the_step(tmp_path, case):
    pl.seed_everything(0, verbose=False)
    kwargs = {}
    if case == "sgd":
        model = MLP()
    elif case == "adam_accumulation":
        model = MLP()
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1e-3)
        kwargs["accumulate_grad_batches"] = 2
    else:
        model = ManualGAN()
    reference = UpdateReference()
    callback = GradHooks(every_n_steps=2, histograms=False, statistics=["norm", "update_ratio", "param_norm"])
    trainer = make_trainer(tmp_path, [callback, reference], max_steps=8, **kwargs)
    trainer.fit(model, loader(n=128))
    events = read_events(trainer.logger.log_dir)
    tags = [t for t in events.Tags()["scalars"] if t.startswith("∇5 param_update_ratio/")]
    assert len(tags) == (8 if case == "two_optimizers_manual" else 6)
    compared = 0
    for tag in tags:
        name = tag.split("/", 1)[1]
        for event in events.Scalars(tag):
            assert event.value == pytest.approx(reference.ratios[(event.step, name)], rel=1e-4)
            compared += 1
        norms = events.Scalars(f"∇7 param_norm/{name}")
        assert [e.step for e in norms] == [e.step for e in events.Scalars(tag)]
    assert compared >= len(tags) * 2
    assert not any(o._optimizer_step_pre_hooks or o._optimizer_step_post_hooks for o in trainer.optimizers)


def test_update_ratio_and_norm_are_chosen_through_statistics(tmp_path):
    trainer = make_trainer(tmp_path, [GradHooks(statistics=["norm"], histograms=False)], max_steps=2)
    trainer.fit(MLP(), loader())
    tags = read_events(trainer.logger.log_dir).Tags()["scalars"]
    assert not [t for t in tags if t.startswith(("∇5 param_update_ratio/", "∇7 param_norm/"))]
    with pytest.raises(ValueError, match="expected a list drawn from .*update_ratio"):
        GradHooks(statistics=["update_rate"])


def test_huge_learning_rate_is_flagged_exploding_and_a_frozen_lr_group_stalled(tmp_path):
    net = mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def groups(net):  # noqa: ANN001, ANN202
        return [
            {"params": net[0].parameters(), "lr": 0.0},  # frozen learning rate
            {"params": net[2].parameters(), "lr": 500.0},  # huge learning rate
            {"params": net[4].parameters()},
        ]

    _, report = fit_report(tmp_path, Net(net, groups=groups), steps=6)
    exploding, stalled = flags_of(report, "exploding"), flags_of(report, "stalled")
    assert exploding.get("param net.2.weight") == 0
    # The frozen group is one row: the group and its learning rate, read from the optimizer.
    assert stalled == {"param_group param_groups[0]": 0}
    row = next(r for r in report.rows() if r.flag == "stalled")
    assert (row.module, row.since) == ("net.0", 0) and row.detail.startswith(
        "learning rate 0 (`param_groups[0]['lr']`, its highest so far 0): the 2 parameters of the group do not move")
    assert not [n for n in exploding if "net.0" in n or "net.4" in n]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_gradhooks", *args], capture_output=True, text=True, timeout=120)


def run_here(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (a new interpreter costs seconds on a loaded machine)."""
    from report_panel import cli

    code, out, err = cli(*args)
    return subprocess.CompletedProcess(args, code, out, err)


def test_report_command_reads_a_real_log_folder_and_honours_fail_on(tmp_path):
    net = mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        net[2].bias.fill_(-50.0)
    _, report = fit_report(tmp_path, Net(net))
    logdir = str(tmp_path / "logs")
    printed = run_here("report", logdir)
    assert printed.returncode == 0, printed.stderr
    # The same report as the callback printed, line for line.
    assert without_noise(printed.stdout.split("\n", 1)[1]).rstrip("\n") == report.table()
    assert ["dead", "net.2", "0", "1"] == printed.stdout.splitlines()[3].split()[:4]
    everything = run_here("report", logdir, "--all")
    assert "param net.4.weight" not in printed.stdout and "param net.4.weight  stalled" in everything.stdout
    failing = run_cli("report", logdir, "--fail-on", "nonfinite,dead")  # the process's own exit status
    assert failing.returncode == 1 and "failing on: dead" in failing.stderr
    assert run_here("report", logdir, "--fail-on", "nonfinite").returncode == 0
    too_big = run_here("report", logdir, "--dead-zero-fraction", "1.5", "--fail-on", "dead")
    assert too_big.returncode == 2 and "Traceback" not in too_big.stderr
    assert "`Thresholds.dead_zero_fraction` expected a number in (0, 1], got 1.5" in too_big.stderr
    wrong = run_here("report", logdir, "--fail-on", "nan")
    assert wrong.returncode == 2 and "expected flags from nonfinite" in wrong.stderr
    missing = run_here("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "LOGDIR expected an existing folder" in missing.stderr
    assert "--fail-on" in run_here("report", "--help").stdout


# -- the definitions on hand-made series: what a single step, noise and overflow do -----------

def _steps(report: HealthReport, series: dict[str, list[float]], kind: str = "grad_output") -> None:
    """Feed one RMS per step per name (mean 0, std = the value), over 20 steady companions."""
    for step in range(len(next(iter(series.values())))):
        stats = {(kind, f"steady{i}"): {"mean": 0.0, "std": 1.0 + 0.01 * i} for i in range(20)}
        stats |= {(kind, name): {"mean": 0.0, "std": values[step]} for name, values in series.items()}
        report.add_stats(step * 5, stats)


def test_a_single_step_spike_and_noise_near_zero_are_not_exploding_two_steps_are():
    report = HealthReport()
    _steps(report, {
        "spike": [1.0, 1.1, 0.9, 150.0, 1.0, 1.0],  # one logged step up, back at the next
        "noise": [0.1, 0.08, 7.8e-5, 0.214, 0.09, 0.1],  # a dip near zero, then its usual size
        "grows": [1.0, 1.0, 1.0, 200.0, 300.0, 400.0],  # up and staying up
    })
    assert {f.name: f.since for f in report.flags()} == {"grad_output grows": 15}


def test_tiny_values_growing_inside_a_vanishing_stack_are_not_exploding():
    report = HealthReport()
    _steps(report, {"deep": [1e-26, 1e-24, 1e-22, 1e-20, 1e-18, 1e-16]})
    assert {(f.flag, f.name) for f in report.flags()} == {("vanishing", "grad_output deep")}


def test_an_update_that_overflows_at_step_0_is_nonfinite_at_step_0_and_a_zero_weight_is_not():
    grads = {("param_grad", "w"): {"norm": 2.0, "mean": 0.0, "std": 1.0}, ("param_grad", "b"): {"norm": 1.0, "mean": 0.5, "std": 0.5}}
    # b was all zero before the step: an infinite ratio with finite weights after it is no overflow.
    zero_b = {("param", "b"): {"update_ratio": math.inf, "param_norm": 0.1}}
    report = HealthReport()
    report.add_stats(0, grads)
    report.add_stats(0, zero_b)
    assert report.flags() == []
    report = HealthReport()
    for stats in (grads, zero_b, {("param", "w"): {"update_ratio": math.inf, "param_norm": math.inf}}):
        report.add_stats(0, stats)
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("nonfinite", "(model)", 0)
    assert row.detail == "the optimizer step: weights non-finite after the step of `w`; no clean logged step before it"


def test_a_flag_carries_its_kind_and_entry_and_a_read_judges_the_pending_step_in_place(monkeypatch):
    import copy

    from lightning_gradhooks.summary.records import Key, Kind

    report = HealthReport()
    for step in range(0, 50, 10):
        report.add_stats(step, {Key(Kind.GRAD_OUTPUT, f"m{i}/0", 1): {"mean": 0.0, "std": 1.0 if i else 1e-9}
                                for i in range(4)})
    monkeypatch.setattr(copy, "deepcopy", lambda *a, **k: pytest.fail("a read made a deep copy"))
    (flag,) = report.flags()
    assert (flag.flag, flag.kind, flag.entry, flag.module) == ("vanishing", "grad_output", "optimizer_1/m0/0", "optimizer_1/m0")
    assert flag.name == "grad_output optimizer_1/m0/0"
    # The read judged step 40: what comes for it later is ignored, as for any judged step.
    report.add_stats(40, {("grad_output", "late"): {"mean": 0.0, "std": 1.0}})
    assert report.steps == 5 and "late" not in report.table(full=True)


def test_a_nan_brought_by_the_all_reduce_names_the_rank_it_came_from():
    """The noise probe's ("ranks", "gradient") entry: which ranks' own gradients were bad before
    the all-reduce. Finite hooks on this rank and a bad param_grad: another rank (DDP run:
    tests/shell/test_ddp.py). Statistics pooled over the ranks (`sync_dist`) that are bad on the
    hooks: born in backward, on that rank."""
    from lightning_gradhooks.summary.records import Key
    from lightning_gradhooks.health import nonfinite_origin

    nan = {"nonfinite": 4.0, "norm": math.nan}
    finite = {"nonfinite": 0.0, "norm": 1.0}
    local = {Key("grad_output", "net.2"): finite, Key("param_grad", "net.0.weight"): nan,
             Key("ranks", "gradient"): {"nonfinite_ranks": 2.0, "first_rank": 1.0, "own": 0.0}}
    module, detail, _ = nonfinite_origin(local)
    assert module == "net.0" and detail.startswith(
        "another rank: the gradients of rank 1 and 1 other were already non-finite before the all-reduce")
    pooled = {Key("grad_output", "net.4"): finite, Key("grad_output", "net.2"): nan,
              Key("param_grad", "net.0.weight"): nan,
              Key("ranks", "gradient"): {"nonfinite_ranks": 1.0, "first_rank": 1.0, "own": 0.0}}
    assert nonfinite_origin(pooled)[1] == ("born in backward: first seen in grad_output of `net.2` (4 NaN/Inf) "
                                           "(on rank 1, before the all-reduce)")
    alone = {key: s for key, s in local.items() if key.kind != "ranks"}
    assert "rank" not in nonfinite_origin(alone)[1]  # one process, or no probe: as before


def test_round_off_is_that_of_the_precision_the_gradients_were_computed_in():
    """A bias gradient at 1e-4 of its module's: far above float32 round-off (no note), at
    bfloat16 round-off (a note) when the step's summary says the hooks saw bfloat16 gradients."""
    from lightning_gradhooks import GradientLog
    from lightning_gradhooks.summary.records import Key

    def fill(report: HealthReport, eps: float | None) -> None:
        for step in range(3):
            stats = {Key("grad_output", "m"): {"norm": 1.0, "mean": 0.0, "std": 1 / 32, "zero_fraction": 0.0},
                     Key("param_grad", "m.weight"): {"norm": 0.5, "mean": 0.0, "std": 0.5 / 32, "zero_fraction": 0.0},
                     Key("param_grad", "m.bias"): {"norm": 1e-4, "mean": 0.0, "std": 1e-4 / 32 ** 0.5,
                                                   "zero_fraction": 0.0}}
            if eps is not None:
                stats[Key("precision", "gradient")] = {"eps": eps}
            report.add_stats(step, stats)

    for eps, noted in [(None, []), (torch.finfo(torch.bfloat16).eps, ["param_grad m.bias"])]:
        report = HealthReport()
        fill(report, eps)
        assert [f.name for f in report.notes()] == noted
    with pytest.raises(ValueError, match=r"`precision` expected a floating-point torch.dtype or None, got 'bf16'"):
        GradientLog(precision="bf16")


def test_a_learning_rate_cut_to_zero_is_one_row_naming_the_group_since_the_cut():
    """Every parameter of a group stops at once: one row, the group and its learning rate, since
    the first logged step at 0; the tail of a cosine schedule (1e-4 of the peak) is no cut, and a
    parameter whose .grad is None but that something else moves (an EMA copy) is no problem."""
    from lightning_gradhooks.summary.records import Key

    def fill(lrs: list[float]) -> HealthReport:
        report = HealthReport()
        for i, lr in enumerate(lrs):
            stats = {Key("param", f"net.{m}.weight"): {"update_ratio": 1e-3 if lr else 0.0, "param_norm": 1.0,
                                                         "group": 0.0, "lr": lr} for m in range(4)}
            stats[Key("param", "ema.weight")] = {"update_ratio": 0.0, "param_norm": 1.0 + i, "group": 0.0, "lr": lr,
                                                 "no_gradient": 1.0}
            report.add_stats(10 * i, stats)
        return report

    report = fill([0.1, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0])
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("stalled", "(model)", 30)
    assert row.detail == ("learning rate 0 (`param_groups[0]['lr']`, its highest so far 0.1): the 5 parameters of the "
                          "group do not move") and not row.consequences
    assert fill([0.1, 0.1, 0.05, 1e-5, 1e-5, 1e-5]).rows() == []  # 1e-4 of the peak: a schedule's tail
