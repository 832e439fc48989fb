"""The gradient-flow picture and the Custom Scalars layout (flow.py), in event files of real fits."""

from __future__ import annotations

import logging
import math
import sys
from array import array

import pytest
from torch import nn

from lightning_gradhooks.summary.statistics import STATISTICS

from conftest import read_events
from test_report import Net, fit_report, mlp


# -- the gradient-flow picture and the custom-scalars layout ---------------------------------

from lightning_gradhooks.log.flow import HEIGHT, MAX_LINES, WIDTH  # noqa: E402


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
    images = events.Images("∇1 overview/gradient_flow")
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
    assert not any("nonfinite" in t and not t.startswith("^∇1 overview/") for c in charts.values() for r in c.values() for t in r)


def _entry(kind, name, rms, count=4):  # noqa: ANN001, ANN202
    from lightning_gradhooks.summary.records import GradientEntry
    from lightning_gradhooks.summary.statistics import StatsRow

    # Elements of mean 0 and root mean square `rms`, none zero.
    stats = StatsRow(norm=rms * count**0.5, mean=0.0, std=rms * (count / (count - 1)) ** 0.5, absmax=rms, nonfinite=0.0,
                     zero_fraction=0.0, count=float(count), low=-rms, high=rms)
    return GradientEntry(kind, name, stats)


def float32(stats):  # noqa: ANN001, ANN201
    """The statistics rounded to float32, as the report judges them."""
    return dict(zip(stats, array("f", stats.values()).tolist()))


def test_the_picture_and_the_report_take_one_rms_of_the_same_module():
    import torch

    from lightning_gradhooks import GradientMonitor
    from lightning_gradhooks.log.flow import GradientFlow
    from lightning_gradhooks.summary.records import Key, Kind, rms, step_summary

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    into_relu = []  # the gradient the ReLU sends back: Linear 0's grad_output, zero where the ReLU is off
    model[1].register_full_backward_hook(lambda m, gi, go: into_relu.append(gi[0].clone()))
    monitor = GradientMonitor(model)
    with monitor.attach(), monitor.arm():
        model(torch.randn(32, 8)).square().mean().backward()
        record = monitor.collect()
    picture = GradientFlow()
    picture.add(0, record)
    summary = step_summary(record)  # what the report judges, as the log holds it (float32)
    assert {"0", "2"} <= set(picture.rms[0])
    for name in picture.rms[0]:
        assert picture.rms[0][name] == pytest.approx(rms(float32(summary[Key(Kind.GRAD_OUTPUT, name)])), rel=1e-5), name
    grad = into_relu[0]
    assert (grad == 0).double().mean() > 0.2  # the zeros would halve a plain norm / sqrt(count)
    assert picture.rms[0]["0"] == pytest.approx(grad[grad != 0].double().square().mean().sqrt().item(), rel=1e-5)


def test_gradient_flow_bars_are_the_heatmaps_last_column_on_its_colour_scale():
    import numpy as np

    from lightning_gradhooks.log.flow import GradientFlow, flow_data
    from lightning_gradhooks.summary.records import GradientRecord

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
    from lightning_gradhooks.log.flow import FONT_PX, LABEL_CHARS, GradientFlow
    from lightning_gradhooks.summary.records import GradientRecord

    picture = GradientFlow()
    names = [f"encoder.layers.{i}.linear" for i in range(500)]
    picture.add(0, GradientRecord([_entry("grad_output", n, 1.0 + i) for i, n in enumerate(reversed(names))]))
    heat = picture.figure().axes[0]
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert 5 <= len(labels) <= HEIGHT // FONT_PX and labels[0] == "…0.linear"
    assert all(len(t) <= LABEL_CHARS for t in labels)


def test_custom_scalars_charts_hold_a_block_each_and_at_most_max_lines():
    import re

    from lightning_gradhooks.log.flow import chart_groups, custom_scalars_layout
    from lightning_gradhooks.summary.records import GradientRecord

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
    assert list(layout) == ["∇1 overview", "∇2 grad_output_norm", "∇4 param_grad_norm", "∇5 param_update_ratio",
                            "∇7 grad_output_absmax", "∇7 grad_output_mean", "∇7 grad_output_std",
                            "∇7 grad_output_zero_fraction", "∇7 param_grad_absmax", "∇7 param_grad_mean",
                            "∇7 param_grad_std", "∇7 param_grad_zero_fraction"]  # as Time Series orders them
    tags = [f"∇2 grad_output_norm/{n}" for n in names] + ["∇2 grad_output_norm/blocks.3.attn.qkv/0", "∇7 grad_output_mean/head"]
    lines = {title: [t for t in tags if re.search(regex, t)] for title, (_, (regex,)) in layout["∇2 grad_output_norm"].items()}
    assert sorted(t for ts in lines.values() for t in ts) == sorted(tags[: len(names)])  # each once, exactly
    assert list(layout["∇5 param_update_ratio"]) == ["patch_embed.proj.weight … blocks.0.norm1.weight"]
    assert custom_scalars_layout(["norm"]) == {"∇1 overview": {
        "total_norm": ["Multiline", ["^∇1 overview/total_norm"]], "nonfinite_total": ["Multiline", ["^∇1 overview/nonfinite_total"]]}}


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
    assert events.Tags()["images"] == [] and "∇2 grad_output_norm/net.0" in events.Tags()["scalars"]
    assert report.steps == 2


def test_gradient_flow_is_drawn_within_its_time_budget(monkeypatch):
    from lightning_gradhooks.log import flow
    from lightning_gradhooks.summary.records import GradientRecord

    clock = [100.0]
    monkeypatch.setattr(flow.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(flow.GradientFlow, "_draw", lambda self: clock.__setitem__(0, clock[0] + 1.0))
    picture = flow.GradientFlow()
    drawn = []
    for step in range(0, 2000, 10):  # 200 logged steps
        picture.add(step, GradientRecord([_entry("grad_output", "net.0", 1.0)]))
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
    assert [i.step for i in events.Images("∇1 overview/gradient_flow")][-1] == 4


