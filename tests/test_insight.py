"""zero_fraction, the gradient-health report and its CLI."""

from __future__ import annotations

import pytest
import torch

from lightning_gradhooks.stats import C_KERNELS, STATISTICS, pool_stats, reduce


def _zero_heavy(n: int, share: float, first_zero: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    t[torch.rand(n, generator=g) < share] = 0.0
    t[0] = 0.0 if first_zero else 1.5
    return t


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.skipif(not C_KERNELS, reason="not built")), False])
def test_zero_fraction_equals_reference_whatever_the_padding(kernels):
    # Sizes that pad their last row, a NaN that sends the C kernels' batch to torch ops, an
    # all-zero tensor.
    tensors = [_zero_heavy(n, s, fz, i) for i, (n, s, fz) in enumerate(
        [(5, 0.5, True), (1000, 0.3, True), (1024, 0.9, False), (40_000, 0.7, True), (3, 0.0, False)]
    )]
    tensors.append(torch.zeros(17))
    with_nan = _zero_heavy(300, 0.5, True, 9)
    with_nan[7] = float("nan")
    tensors.append(with_nan)
    rows = reduce(tensors, bins=8, kernels=kernels)
    index = STATISTICS.index("zero_fraction")
    for t, (row, _) in zip(tensors, rows):
        assert row[index] == pytest.approx((t == 0).double().mean().item(), abs=1e-12)
    pooled = pool_stats([row for row, _ in rows[:4]])
    whole = torch.cat(tensors[:4])
    assert pooled[index] == pytest.approx((whole == 0).double().mean().item(), abs=1e-12)


# -- the report on pathologies built on purpose, through real Lightning fits ----------------

import math  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytorch_lightning as pl  # noqa: E402
from torch import nn  # noqa: E402

from lightning_gradhooks import GradHooks  # noqa: E402
from lightning_gradhooks.report import HealthReport  # noqa: E402

from conftest import loader, make_trainer, read_events  # noqa: E402


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
    tags = [t for t in events.Tags()["scalars"] if t.startswith("param_update_ratio/")]
    assert len(tags) == (8 if case == "two_optimizers_manual" else 6)
    compared = 0
    for tag in tags:
        name = tag.split("/", 1)[1]
        for event in events.Scalars(tag):
            assert event.value == pytest.approx(reference.ratios[(event.step, name)], rel=1e-4)
            compared += 1
        norms = events.Scalars(f"param_norm/{name}")
        assert [e.step for e in norms] == [e.step for e in events.Scalars(tag)]
    assert compared >= len(tags) * 2
    assert not any(o._optimizer_step_pre_hooks or o._optimizer_step_post_hooks for o in trainer.optimizers)


def test_update_ratio_and_norm_are_chosen_through_statistics(tmp_path):
    trainer = make_trainer(tmp_path, [GradHooks(statistics=["norm"], histograms=False)], max_steps=2)
    trainer.fit(MLP(), loader())
    tags = read_events(trainer.logger.log_dir).Tags()["scalars"]
    assert not [t for t in tags if t.startswith(("param_update_ratio/", "param_norm/"))]
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
    assert stalled == {"param net.0.weight": 0, "param net.0.bias": 0}
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
    printed = run_cli("report", logdir)
    assert printed.returncode == 0, printed.stderr
    # The same report as the callback printed, line for line.
    assert printed.stdout.split("\n", 1)[1].rstrip("\n") == report.table()
    assert ["dead", "net.2", "0", "1"] == printed.stdout.splitlines()[3].split()[:4]
    everything = run_here("report", logdir, "--all")
    assert "param net.4.weight" not in printed.stdout and "param net.4.weight  stalled" in everything.stdout
    failing = run_cli("report", logdir, "--fail-on", "nonfinite,dead")  # the process's own exit status
    assert failing.returncode == 1 and "failing on: dead" in failing.stderr
    assert run_here("report", logdir, "--fail-on", "nonfinite").returncode == 0
    too_big = run_here("report", logdir, "--dead-zero-fraction", "1.5", "--fail-on", "dead")
    assert too_big.returncode == 2 and "Traceback" not in too_big.stderr
    assert "Thresholds.dead_zero_fraction expected a number in (0, 1], got 1.5" in too_big.stderr
    wrong = run_here("report", logdir, "--fail-on", "nan")
    assert wrong.returncode == 2 and "expected flags from nonfinite" in wrong.stderr
    missing = run_here("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "LOGDIR expected an existing folder" in missing.stderr
    assert "--fail-on" in run_here("report", "--help").stdout


# -- the gradient-flow picture and the custom-scalars layout ---------------------------------

from lightning_gradhooks.flow import HEIGHT, MAX_LINES, WIDTH  # noqa: E402


def _layout_charts(config) -> dict[str, dict[str, str]]:  # noqa: ANN001
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    return {cat.title: {c.title: list(c.multiline.tag) for c in cat.chart} for cat in layout.category}


def test_gradient_flow_image_and_custom_scalars_layout_are_in_the_event_file(tmp_path):
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = Net(mlp(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)))
    trainer, _ = fit_report(tmp_path, model, steps=6)
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = events.Images("gradient_flow")
    # The first logged step is drawn, later ones within the drawing budget, the last one at the end.
    steps = [i.step for i in images]
    assert steps[0] == 0 and steps[-1] == 4 and set(steps) <= {0, 2, 4}
    # Wide (TensorBoard's card box is ~370 x 200) and the same size whatever the model.
    assert {(i.width, i.height) for i in images} == {(WIDTH, HEIGHT)} and 1.5 <= WIDTH / HEIGHT <= 2
    (config,) = events.Tensors("custom_scalars__config__")
    charts = _layout_charts(config)
    tags = events.Tags()["scalars"]
    for category in charts.values():
        for title, regexes in category.items():
            lines = [t for t in tags if any(re.search(r, t) for r in regexes)]
            assert 1 <= len(lines) <= MAX_LINES, (title, lines)  # none empty, none crowded
    assert not any("nonfinite" in t and not t.startswith("^0_overview/") for c in charts.values() for r in c.values() for t in r)


def _entry(kind, name, rms, count=4):  # noqa: ANN001, ANN202
    from lightning_gradhooks.records import GradientEntry

    return GradientEntry(kind, name, dict.fromkeys(STATISTICS, 0.0) | {"norm": rms * count**0.5}, count=count)


def test_gradient_flow_bars_are_the_heatmaps_last_column_on_its_colour_scale():
    import numpy as np

    from lightning_gradhooks.flow import GradientFlow, flow_data
    from lightning_gradhooks.records import GradientRecord

    picture = GradientFlow()
    rms = {"net.0": 2e-3, "net.2": 1e-3, "net.4": 0.0}  # net.4 dead at the last step
    picture.add(0, GradientRecord([_entry("grad_output", n, 1e-2) for n in reversed(rms)]))
    picture.add(10, GradientRecord([_entry("grad_output", n, v) for n, v in reversed(rms.items())]))
    data = flow_data(picture.modules, picture.rms)
    assert picture.modules == ["net.0", "net.2", "net.4"]  # forward order
    np.testing.assert_allclose(data.grid[:2, 1], [math.log10(2e-3), -3.0])
    assert data.grid[2, 1] == -math.inf and np.isnan(flow_data(["net.9"], picture.rms).grid).all()
    np.testing.assert_array_equal(data.bars, data.grid[:, -1])
    # net.0 is 2x net.2: its bar is log10(2) longer, on the axis the colour bar gives.
    low, high = data.limits
    assert low < -3.0 and high == -2.0
    figure = picture.figure()
    heat, bars, strip = figure.axes
    assert heat.images[0].get_clim() == data.limits == bars.get_xlim() == strip.get_xlim()
    assert strip.get_xlabel() == "log10 RMS of grad_output"
    ends = [path.vertices[:, 0].max() for path in bars.collections[0].get_paths()]
    np.testing.assert_allclose(ends, [math.log10(2e-3), -3.0, low])
    image = picture.image()
    assert image.shape == (HEIGHT, WIDTH, 3) and picture.drawn == 10


def test_gradient_flow_labels_fit_with_hundreds_of_modules():
    from lightning_gradhooks.flow import FONT_PX, LABEL_CHARS, GradientFlow
    from lightning_gradhooks.records import GradientRecord

    picture = GradientFlow()
    names = [f"encoder.layers.{i}.linear" for i in range(500)]
    picture.add(0, GradientRecord([_entry("grad_output", n, 1.0 + i) for i, n in enumerate(reversed(names))]))
    heat = picture.figure().axes[0]
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert 5 <= len(labels) <= HEIGHT // FONT_PX and labels[0] == "…0.linear"
    assert all(len(t) <= LABEL_CHARS for t in labels)


def test_custom_scalars_charts_hold_a_block_each_and_at_most_max_lines():
    import re

    from lightning_gradhooks.flow import chart_groups, custom_scalars_layout
    from lightning_gradhooks.records import GradientRecord

    blocks = [f"blocks.{b}.{m}" for b in range(12) for m in ("norm1", "attn.qkv", "attn.proj", "attn", "norm2", "mlp.fc1", "mlp.act", "mlp.fc2", "mlp")]
    names = ["patch_embed.proj", "pos_drop", *blocks, "norm", "head"]
    groups = chart_groups(names)
    assert [n for _, g in groups for n in g] == names and max(len(g) for _, g in groups) <= MAX_LINES
    assert ("blocks.3", [n for n in blocks if n.startswith("blocks.3.")]) in groups
    assert [t for t, _ in chart_groups([f"net.{i}" for i in range(30)])] == ["net.0 … net.9", "net.10 … net.19", "net.20 … net.29"]
    record = GradientRecord(
        [_entry("grad_output", n, 1.0) for n in reversed(names)] + [_entry("param_grad", f"{n}.weight", 1.0) for n in names[:3]]
    )
    layout = custom_scalars_layout(list(STATISTICS) + ["update_ratio"], record, kinds=("grad_output", "param_grad"))
    assert "grad_output_nonfinite" not in layout and "0_overview" in layout and "grad_input_norm" not in layout
    tags = [f"grad_output_norm/{n}" for n in names] + ["grad_output_norm/blocks.3.attn.qkv/0", "grad_output_mean/head"]
    lines = {title: [t for t in tags if re.search(regex, t)] for title, (_, (regex,)) in layout["grad_output_norm"].items()}
    assert sorted(t for ts in lines.values() for t in ts) == sorted(tags[: len(names)])  # each once, exactly
    assert list(layout["param_update_ratio"]) == ["patch_embed.proj.weight … blocks.0.norm1.weight"]
    assert custom_scalars_layout(["norm"]) == {"0_overview": {"total_norm": ["Multiline", ["^0_overview/total_norm"]]}}


def test_without_matplotlib_one_info_line_and_nothing_else_changes(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    lightning_logger = logging.getLogger("pytorch_lightning")
    lightning_logger.addHandler(caplog.handler)
    try:
        trainer, report = fit_report(tmp_path, Net(mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))), steps=4)
    finally:
        lightning_logger.removeHandler(caplog.handler)
    assert caplog.text.count("lightning-gradhooks[plots]") == 1
    events = read_events(trainer.logger.log_dir)
    assert events.Tags()["images"] == [] and "grad_output_norm/net.0" in events.Tags()["scalars"]
    assert report.steps == 2


def test_gradient_flow_is_drawn_within_its_time_budget(monkeypatch):
    from lightning_gradhooks import flow
    from lightning_gradhooks.records import GradientEntry, GradientRecord

    clock = [100.0]
    monkeypatch.setattr(flow.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(flow.GradientFlow, "_draw", lambda self: clock.__setitem__(0, clock[0] + 1.0))
    picture = flow.GradientFlow()
    stats = dict.fromkeys(STATISTICS, 0.0) | {"norm": 2.0}
    drawn = []
    for step in range(0, 2000, 10):  # 200 logged steps
        picture.add(step, GradientRecord([GradientEntry("grad_output", "net.0", stats, count=4)]))
        if picture.due():
            picture.image()
            drawn.append(step)
        clock[0] += 1.0  # one second of training per logged step; a drawing takes one second
    # The first step is drawn; afterwards drawings stay within DRAW_BUDGET of the elapsed time.
    assert drawn[0] == 0 and 3 <= len(drawn) <= 6  # at 0, ~50 s, ~100 s, ...
    assert picture.draw_seconds <= flow.DRAW_BUDGET * (clock[0] - 100.0) + 1.0
    assert not picture.due()  # the latest step was drawn or is not due yet


def test_gradient_flow_of_the_last_logged_step_is_drawn_when_fit_fails(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    model = Failing(mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    with pytest.raises(RuntimeError, match="boom"):
        fit_report(tmp_path, model, steps=8)
    log_dir = next(p.parent for p in tmp_path.rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    events.Reload()
    assert [i.step for i in events.Images("gradient_flow")][-1] == 4


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
    report = HealthReport()
    grads = {("param_grad", "w"): {"norm": 2.0, "mean": 0.0, "std": 1.0}, ("param_grad", "b"): {"norm": 1.0, "mean": 0.5, "std": 0.5}}
    report.add_stats(0, grads)
    # b was all zero before the step: an infinite ratio with finite weights after it is no overflow.
    report.add_stats(0, {("param", "b"): {"update_ratio": math.inf, "param_norm": 0.1}}, new_step=False)
    assert report.flags() == []
    report.add_stats(0, {("param", "w"): {"update_ratio": math.inf, "param_norm": math.inf}}, new_step=False)
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("nonfinite", "(model)", 0)
    assert row.detail == "the optimizer step: weights non-finite after the step of `w`; no clean logged step before it"
