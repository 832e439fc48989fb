"""The gradient noise scale (noise.py) against per-example brute force (``torch.func``).

Brute force: every example's gradient with ``vmap(grad(...))``, hence the exact ``|G|²`` and
``tr(Σ)`` (of one batch, or of the whole data set when the weights do not move, lr 0). The
runs log every step of a real Lightning Trainer and the test reads the TensorBoard events back.
DDP and the sharded strategies on two CPU processes run ``tests/helpers/noise_sharded.py``, all the fits
in one pair of rank processes (see ``test_ddp.py`` for how).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from dataclasses import replace
from unittest import mock

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks, GradientMonitor
from lightning_gradhooks.shell import _trainer
from lightning_gradhooks.core.per_example import linear_form
from lightning_gradhooks.__main__ import main, read_folder
from lightning_gradhooks.core.noise import NoiseProbe
from lightning_gradhooks.summary.noise import NoiseScale, NoiseSummary, advice, noise_estimates
from lightning_gradhooks.summary.records import Key, Kind

from conftest import hook_snapshot, make_trainer, read_events
from launch import run_script

NOISE_TAG = "∇1 overview/noise_scale"


def per_example(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every example's gradient, by parameter name: (examples, parameter elements), float64."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def one(p, xi, yi):  # noqa: ANN001, ANN202
        return loss(functional_call(model, p, (xi[None],)), yi[None])

    parts = [vmap(grad(one), in_dims=(None, 0, 0))(params, x[i:i + 256], y[i:i + 256]) for i in range(0, len(x), 256)]
    return {k: torch.cat([p[k].reshape(p[k].shape[0], -1) for p in parts]).double() for k in params}


def flat(grads: dict[str, torch.Tensor], names=None) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([g for k, g in grads.items() if names is None or k in names], 1)


def truth(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:  # noqa: ANN001
    """``(|G|², tr(Σ))`` of the examples as a population: G their mean gradient, Σ their covariance."""
    g = flat(per_example(model, loss, x, y))
    mean = g.mean(0)
    return float(mean.square().sum()), float((g - mean).square().sum(1).mean())


def batch_truth(g: torch.Tensor) -> tuple[float, float]:
    """The unbiased estimates of one batch, from its per-example gradients (examples, elements)."""
    b, mean = len(g), g.mean(0)
    trace = float((g - mean).square().sum() / (b - 1))
    return float(mean.square().sum()) - trace / b, trace


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


class Block(nn.Module):
    """One transformer block (batch first) and a linear read-out of each position."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)).squeeze(-1)


def models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.5 * torch.randn(512, 1, generator=g)
    torch.manual_seed(0)
    found = {
        "linear": (nn.Linear(6, 1), x, y),
        "mlp": (nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)), x, y),
    }
    xs = torch.randn(512, 5, 16, generator=g)
    ys = xs.sum(-1) / 4 + 0.3 * torch.randn(512, 5, generator=g)
    found["block"] = (Block(), xs, ys)
    # Linear layers on 2-D inputs are reduced together by layout (widths, weight and bias counted):
    # layers without a bias or a trainable weight beside layers of the same widths with both
    mixed = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8),
                          nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    mixed[6].weight.requires_grad_(False)
    found["mixed"] = (mixed, x, y)
    return found


# -- the estimators --------------------------------------------------------------------------
def test_two_batch_estimates_invert_their_expectations():
    grad_sq, trace, b, big = 2.0, 300.0, 8, 64
    small_sq, big_sq = grad_sq + trace / b, grad_sq + trace / big  # E|G_b|² = |G|² + tr(Σ)/b
    assert noise_estimates(small_sq, big_sq, b, big) == pytest.approx((grad_sq, trace))
    with pytest.raises(ValueError, match="expected 0 < small < big, got small=8, big=8"):
        noise_estimates(1.0, 1.0, 8, 8)


def test_smoothing_takes_the_ratio_of_the_averages():
    scale = NoiseScale(decay=0.5)
    assert scale.value is None and scale.summary() is None
    assert scale.update(-1.0, 10.0) is None  # |G|² not positive yet: no estimate
    # weights 0.25 and 0.5 (the bias correction divides both averages alike)
    assert scale.update(3.0, 30.0) == pytest.approx((0.25 * 10 + 0.5 * 30) / (0.25 * -1 + 0.5 * 3))
    assert scale.update(math.nan, 1.0) == scale.value and scale.steps == 2  # skipped
    assert [(g, t) for _, g, t, _, _ in scale.history] == [(-1.0, 10.0), (3.0, 30.0)]  # raw, for the summary
    with pytest.raises(ValueError, match=r"`decay` expected a number in \[0, 1\), got 1"):
        NoiseScale(decay=1)


def summary_of(traces: list[float], batch: float = 64, coverage: float = 1.0, grad_sq: float = 1.0) -> NoiseSummary:
    """The summary of a run whose logged steps estimate ``|G|² = grad_sq`` and ``tr(Σ) = traces[i]``."""
    scale = NoiseScale()
    for step, trace in enumerate(traces):
        scale.update(grad_sq, trace, step=10 * step, batch=batch, coverage=coverage)
    restored = NoiseScale()
    restored.load_state_dict(scale.state_dict())  # a resumed run goes on from the same history
    assert restored.summary() == scale.summary()
    return scale.summary()


def test_the_summary_is_a_long_average_over_the_runs_second_half_with_an_interval():
    # the first half is not read; one noisy late step (40) does not flip the advice
    summary = summary_of([5.0] * 8 + [800.0, 900.0, 1000.0, 1100.0, 850.0, 40.0, 950.0, 900.0])
    assert summary.median == pytest.approx((800 + 900 + 1000 + 1100 + 850 + 40 + 950 + 900) / 8)
    assert (summary.values, summary.since) == (8, 80) and 600 < summary.low < summary.median < summary.high < 1050
    assert advice(summary) == (
        "GradHooks: gradient noise scale ~ 818 examples (over the run's second half: 8 logged steps since step 80; "
        f"80% interval {summary.low:,.0f} to {summary.high:,.0f}); your batch per optimizer step is 64: a larger "
        "batch (up to ~818) would cut the number of steps almost in proportion (scale the learning rate with it).")
    assert "near the critical batch size" in advice(summary_of([100.0] * 16))
    assert "a smaller one (down to ~10)" in advice(summary_of([10.0] * 16))
    # a ratio of sums: steps whose |G|² comes out negative (noise) pull the sum down, not to -inf
    assert summary_of([1.0] * 16, grad_sq=-0.5).median == math.inf


def test_numbers_under_ten_have_two_significant_digits_and_fitting_advice():
    # an encoder whose noise scale is below one example printed "~ 0 examples (80% interval 0 to 0)"
    tiny = summary_of([0.034, 0.031, 0.036, 0.033] * 4)
    said = advice(tiny)
    assert said.startswith("GradHooks: gradient noise scale ~ 0.034 examples (over the run's second half: 8 "
                           "logged steps since step 80; 80% interval 0.03")
    assert " to 0.03" in said and " 0 examples" not in said and "down to" not in said
    assert said.endswith("your batch per optimizer step is 64: the gradient noise is small against the gradient: "
                         "a batch of one or two examples would need about as many steps as this one, so each "
                         "example buys almost nothing but its share of the step; take a smaller batch and more "
                         "steps, or a larger learning rate.")
    assert "~ 3.4 examples" in advice(summary_of([3.4] * 16)) and "down to ~3.4" in advice(summary_of([3.4] * 16))
    assert "~ 1,234 examples" in advice(summary_of([1234.0] * 16, batch=64))
    assert "~ 12 examples" in advice(summary_of([12.0] * 16)) and "~ 9.0 examples" in advice(summary_of([9.04] * 16))


def test_advice_only_where_the_interval_allows_it():
    straddling = summary_of([60, 90, 150, 400, 90, 150, 300, 60] * 2)  # around 2 x 64, noisily
    assert straddling.low < 128 < straddling.high
    assert advice(straddling).endswith("your batch per optimizer step is 64: the estimate is uncertain: its "
                                       "interval spans different advice, so none is given; log more steps for a "
                                       "steadier estimate.")
    assert "too few logged estimates (7 in the second half, 8 needed) to advise" in advice(summary_of([900] * 14))
    assert advice(summary_of([1.0] * 16, grad_sq=-1.0)) == (
        "GradHooks: no gradient noise scale estimate: |G|² summed over the run's second half is not positive (the "
        "noise drowns the signal at this batch size).")
    partial = advice(summary_of([900.0] * 16, coverage=0.354))
    assert "from per-example norms covering 35% of the parameters (the Linear, LayerNorm, RMSNorm, GroupNorm " \
           "layers): the noise scale of those" in partial
    assert "covering under 1% of the parameters" in advice(summary_of([900.0] * 16, coverage=0.004))
    assert "; the logged steps after step 150 gave no estimate)" in advice(summary_of([900.0] * 16), step=150)
    assert advice(None, "the gradients are all zero") == \
        "GradHooks: no gradient noise scale estimate: the gradients are all zero."


@pytest.mark.parametrize("name", ["linear", "mlp", "mixed", "block"])
def test_per_example_norms_against_brute_force(name):
    model, x, y = models()[name]
    probe = NoiseProbe(model)
    covered = {n for n, _ in model.named_parameters() if n.rpartition(".")[0] in probe.sources}
    ours, exact, whole = [], [], []
    for step in range(8):
        xb, yb = x[step * 32:(step + 1) * 32], y[step * 32:(step + 1) * 32]
        model.zero_grad()
        probe.arm()
        mse(model(xb), yb).backward()
        sample = probe.collect()
        assert sample.source == "per_example" and (sample.small, sample.big) == (1, 32)
        assert probe.hooks == 0 and not any(m._forward_hooks for m in model.modules())
        ours.append(sample.estimates())
        grads = per_example(model, mse, xb, yb)
        exact.append(batch_truth(flat(grads, covered)))
        whole.append(batch_truth(flat(grads)))
    if name == "block":  # attention's packed projections give no per-example norms
        assert probe.sources == ["block.linear1", "block.linear2", "block.norm1", "block.norm2", "head"]
        assert 0.3 < sample.coverage < 0.8
    else:  # every parameter covered
        assert sample.coverage == 1.0
    assert ours == [pytest.approx(e, rel=1e-4) for e in exact]  # exact: short sequences take the Gram form
    # the stacks of the Linear layers' inputs and output gradients reuse buffers, freed at remove()
    assert probe.scratch_bytes == (0 if name == "block" else 32 * 4 * sum(
        m.in_features + m.out_features for m in model.modules() if isinstance(m, nn.Linear)))
    probe.remove()
    assert probe.scratch_bytes == 0

    def ratio(rows):  # noqa: ANN001, ANN202
        return sum(t for _, t in rows) / sum(g for g, _ in rows)

    assert ratio(ours) == pytest.approx(ratio(whole), rel=0.25)


@pytest.mark.parametrize(("form", "features_in", "features_out", "positions"),
                         [("gram", 16, 32, 5), ("direct", 6, 1, 5), ("sketch", 64, 64, 64)])
def test_a_linear_over_a_sequence_takes_its_cheapest_form(form, features_in, features_out, positions):
    # each example's ‖Σ_t δ_t x_tᵀ‖²: exactly (its weight gradient, or the Gram form), or by the sketch
    assert linear_form(positions, features_in, features_out) == form
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Linear(features_in, features_out)
    x = torch.randn(256, positions, features_in, generator=g)
    y = x[..., :1].sum(-1) + torch.randn(256, positions, generator=g)

    def loss(out, target):  # noqa: ANN001, ANN202
        return mse(out.mean(-1), target)

    probe, ours, exact = NoiseProbe(model), [], []
    for step in range(8):
        xb, yb = x[step * 32:(step + 1) * 32], y[step * 32:(step + 1) * 32]
        model.zero_grad()
        probe.arm()
        loss(model(xb), yb).backward()
        ours.append(probe.collect().estimates())
        exact.append(batch_truth(flat(per_example(model, loss, xb, yb))))
    if form == "sketch":  # unbiased: the ratio of the sums within 10 %
        assert sum(t for _, t in ours) / sum(g for g, _ in ours) == pytest.approx(
            sum(t for _, t in exact) / sum(g for g, _ in exact), rel=0.1)
    else:
        assert ours == [pytest.approx(e, rel=1e-4) for e in exact]


def test_with_normalisation_layers_a_linear_over_a_long_sequence_is_left_to_them():
    # Gray et al. (2024): the normalisation layers' per-example norms give the estimate. A Linear
    # over a sequence whose exact forms cost more than the sketch is left out (the sketch stays for
    # models without such layers), an exact one that costs no more is kept; the coverage says so.
    assert linear_form(12, 16, 32, sketch=False) is None and linear_form(12, 16, 32) == "sketch"
    assert linear_form(5, 16, 32, sketch=False) == "gram" and linear_form(12, 32, 1, sketch=False) == "direct"
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 12, 16, generator=g)
    y = x[..., 0] + torch.randn(64, 12, generator=g)

    def loss(out, target):  # noqa: ANN001, ANN202
        return mse(out.squeeze(-1), target)

    probe, covered = NoiseProbe(model), {"1.weight", "1.bias", "3.weight", "3.bias"}
    for step in range(2):
        xb, yb = x[step * 32:(step + 1) * 32], y[step * 32:(step + 1) * 32]
        model.zero_grad()
        probe.arm()
        loss(model(xb), yb).backward()
        sample = probe.collect()
        assert sample.estimates() == pytest.approx(batch_truth(flat(per_example(model, loss, xb, yb), covered)),
                                                   rel=1e-4)
    assert sample.coverage == pytest.approx(sum(p.numel() for n, p in model.named_parameters() if n in covered)
                                            / sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("include", [None, ["0", "1"]])
def test_a_logged_step_puts_one_set_of_hooks_in_each_module(include):
    # The monitor's forward hook and grad_output hook feed the probe's per-example layers; the
    # probe hooks only the layers the monitor leaves out, and measures the same as on its own.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 1))
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    alone = NoiseProbe(model)
    alone.arm()
    mse(model(x), y).backward()
    expected = alone.collect()
    model.zero_grad()
    monitor = GradientMonitor(model, include=include, attention_logits=False)  # (attention's hooks: test_forward_stats)
    own = 0 if include is None else 1  # the probe's own hooks: layer 3 with include, else none
    counts = []
    with monitor.attach():
        for step in range(2):  # the first logged step reads grad_output only, the next views too
            with monitor.arm(batch_size=32):
                counts.append([len(m._forward_hooks) for m in model])
                assert monitor.noise.hooks == own
                mse(model(x), y).backward()
                sample = monitor.collect().noise
            model.zero_grad()
            # the same numbers, whoever's hooks fed the probe; |G_B|² summed from the monitor's own
            # statistics of the parameter gradients where it has them all (float32 round-off)
            assert sample == replace(expected, big_sq=sample.big_sq)
            assert sample.big_sq == pytest.approx(expected.big_sq, rel=1e-6)
        monitor.arm_noise()  # a rank that logs nothing this step: the probe hooks its layers itself
        assert monitor.noise.hooks == 3 and [len(m._forward_hooks) for m in model] == [1, 1, 0, 1]
        mse(model(x), y).backward()
        monitor.collect_noise()
    assert counts == [[1, 1, 0, 1]] * 2
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model)
    assert monitor.noise.hooks == 0


def test_a_loss_scale_is_divided_out():
    model, x, y = models()["mlp"]
    monitor = GradientMonitor(model)
    samples = []
    with monitor.attach():
        for scale in (1.0, 1024.0):
            model.zero_grad()
            with monitor.arm():
                (mse(model(x[:32]), y[:32]) * scale).backward()
                for p in model.parameters():  # what GradScaler.unscale_ does before the step
                    p.grad /= scale
                samples.append(monitor.collect().unscaled(scale).noise)
    assert samples[1].estimates() == pytest.approx(samples[0].estimates(), rel=1e-5)


# -- real runs, weights that do not move -----------------------------------------------------
class Fit(pl.LightningModule):
    """Wraps a model with the mean-squared loss and SGD at learning rate 0."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return mse(self.model(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.0)


def logged(tmp_path) -> tuple[list[float], list[dict[str, float]]]:  # noqa: ANN001
    """The charted noise scale, and the summary's raw estimates, of every logged step."""
    folder = next((tmp_path / "logs").glob("version_*"))
    events = read_events(str(folder))
    charted = [e.value for e in events.Scalars(NOISE_TAG)] if NOISE_TAG in events.Tags()["scalars"] else []
    steps = read_folder(folder).steps
    key = Key(Kind.NOISE, "gradient")
    return charted, [s[key] for _, s in sorted(steps.items()) if key in s]


def trace_over_grad_sq(model, x, y) -> float:  # noqa: ANN001
    grad_sq, trace = truth(model, mse, x, y)
    return trace / grad_sq


def check_against_truth(tmp_path, model, x, y, batch_per_step, rel=0.25) -> tuple[list[float], list[dict]]:  # noqa: ANN001
    grad_sq, trace = truth(model, mse, x, y)
    charted, raw = logged(tmp_path)
    assert raw and all(r["big_batch"] == batch_per_step for r in raw)
    estimate = sum(r["trace"] for r in raw) / sum(r["grad_sq"] for r in raw)
    assert estimate == pytest.approx(trace / grad_sq, rel=rel)
    assert sum(charted) / len(charted) == pytest.approx(trace / grad_sq, rel=rel)
    return charted, raw


@pytest.mark.parametrize("accumulation", [1, 4])
def test_lightning_runs_against_brute_force(tmp_path, accumulation, monkeypatch):
    model, x, y = models()["mlp"]
    micro = 32 if accumulation == 1 else 8
    messages = []
    hooks = GradHooks(every_n_steps=1, histograms=False)
    trainer = make_trainer(tmp_path, [hooks], max_steps=48, accumulate_grad_batches=accumulation)
    monkeypatch.setattr(_trainer, "echo", lambda trainer, callback: messages.append)  # what the user reads at the end
    loader = DataLoader(TensorDataset(x, y), batch_size=micro, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    trainer.fit(Fit(model), loader)
    charted, raw = check_against_truth(tmp_path, model, x, y, 32)
    assert raw[0]["small_batch"] == (1 if accumulation == 1 else 8)
    summary = hooks.gradient_log.noise_scale.summary()
    assert summary.values == 24 and summary.low <= summary.median <= summary.high
    assert summary.median == pytest.approx(trace_over_grad_sq(model, x, y), rel=0.25)
    said = messages[-1]
    assert said.startswith("GradHooks: gradient noise scale ~ ")
    assert said.partition(" examples (over the run's second half: 24 logged steps since step 24; 80% interval")[1]
    printed = float(said.split("~ ")[1].split()[0].replace(",", ""))  # two significant digits under 10
    assert printed == pytest.approx(summary.median, rel=0.05)
    assert command_says(tmp_path) == said  # the report command prints the same sentence


def test_plain_loop_with_accumulation_against_brute_force():
    # each micro-batch's gradient read by a hook on the parameters, the mean of their squared norms
    model, x, y = models()["mlp"]
    grad_sq, trace = truth(model, mse, x, y)
    monitor, smoothed, raw = GradientMonitor(model), NoiseScale(), []
    g = torch.Generator().manual_seed(2)
    order = torch.cat([torch.randperm(len(x), generator=g) for _ in range(3)])  # three epochs
    with monitor.attach():
        for step in range(48):
            rows = order[step * 32:(step + 1) * 32]
            with monitor.arm(batch_size=8, accumulation=4):
                for part in rows.view(4, 8):
                    (mse(model(x[part]), y[part]) / 4).backward()
                sample = monitor.collect().noise
            model.zero_grad()
            assert (sample.source, sample.small, sample.big) == ("accumulation", 8, 32)
            raw.append(sample.estimates())
            smoothed.update(*raw[-1])
    assert not any(p._backward_hooks for p in model.parameters())  # the hook on the parameters is gone
    assert sum(t for _, t in raw) / sum(g for g, _ in raw) == pytest.approx(trace / grad_sq, rel=0.25)


SHARDED = [("fsdp2", "mlp"), ("tp", "mlp"), ("tp", "linear")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The two-rank fits (DDP, then the sharded ones), one after the other in one pair of rank
    processes (a pair costs seconds to start): ``ranks / "MODE-NAME"`` holds each one's output."""
    out = tmp_path_factory.mktemp("noise_ranks")
    run_script(out, "noise_sharded.py", ",".join(f"{mode}:{name}" for mode, name in [("ddp", "mlp"), *SHARDED]))
    return out


def test_ddp_on_two_cpu_processes_against_brute_force(ranks):
    tmp_path = ranks / "ddp-mlp"
    model, x, y = models()["mlp"]
    facts = json.loads((tmp_path / "facts.json").read_text())
    charted, raw = check_against_truth(tmp_path, model, x, y, 32)  # 2 ranks x 16
    assert raw[0]["small_batch"] == 16
    assert facts["all_reduces"] == facts["logged_steps"]  # one collective per logged step


@pytest.mark.parametrize(("mode", "name"), SHARDED)
def test_sharded_on_two_cpu_processes_against_brute_force(ranks, mode, name):
    # FSDP2: each rank's per-example norms of its own 16 examples; tensor parallelism: each rank's
    # piece of every example's gradient (the bias of a row-wise Linear counted once); with the
    # pieces' |G_B|² in the same all_reduce, the only collective the probe makes
    tmp_path = ranks / f"{mode}-{name}"
    model, x, y = models()[name]
    facts = json.loads((tmp_path / "facts.json").read_text())
    charted, raw = check_against_truth(tmp_path, model, x, y, 32, rel=0.4)
    assert all(r["small_batch"] == 1 and r["coverage"] == 1.0 for r in raw)
    assert facts["all_reduces"] == facts["logged_steps"] == 16  # one collective per logged step


def test_nothing_of_ours_between_logged_steps(tmp_path):
    model, x, y = models()["mlp"]
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            seen.append((trainer.global_step, hooks.monitor.noise.hooks, hook_snapshot(pl_module)))

    hooks = GradHooks(every_n_steps=3, histograms=False)
    make_trainer(tmp_path, [Watch(), hooks], max_steps=6).fit(Fit(model), DataLoader(TensorDataset(x, y), batch_size=16))
    for step, count, snapshot in seen:  # Watch runs first: hooks of the step before are gone
        assert count == 0 and all(not any(v[:4]) for v in snapshot.values()), step
    assert len(logged(tmp_path)[1]) == 2


def test_noise_scale_false_turns_it_off(tmp_path):
    model, x, y = models()["mlp"]
    hooks = GradHooks(every_n_steps=1, histograms=False, noise_scale=False)
    make_trainer(tmp_path, [hooks], max_steps=2).fit(Fit(model), DataLoader(TensorDataset(x, y), batch_size=16))
    assert logged(tmp_path) == ([], [])
    assert GradientMonitor(model, noise_scale=False).noise is None
    with pytest.raises(ValueError, match=r"`noise_scale` expected a bool \(True or False\), got 'yes'"):
        GradHooks(noise_scale="yes")


# -- no estimate, said plainly ---------------------------------------------------------------
def fit_and_warnings(tmp_path, model: nn.Module, x, y, batch_size: int, **kwargs) -> tuple[list[str], list[str]]:  # noqa: ANN001
    messages = []
    hooks = GradHooks(every_n_steps=1, histograms=False)
    trainer = make_trainer(tmp_path, [hooks], max_steps=3, **kwargs)
    with warnings.catch_warnings(record=True) as caught, \
            mock.patch.object(_trainer, "echo", lambda trainer, callback: messages.append):
        warnings.simplefilter("always")
        trainer.fit(Fit(model), DataLoader(TensorDataset(x, y), batch_size=batch_size))
    said = [str(w.message) for w in caught if "noise scale" in str(w.message)]
    charted, raw = logged(tmp_path)
    assert charted == [] and raw and all(set(r) == {"reason", "big_batch"} for r in raw)  # why, for the command
    assert command_says(tmp_path) == messages[-1]
    return said, messages


def command_says(tmp_path) -> str:  # noqa: ANN001
    """The last line the report command prints for the run: its noise-scale sentence."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(tmp_path / "logs")]) == 0
    return out.getvalue().splitlines()[-1]


def test_a_batch_of_one_example(tmp_path):
    model, x, y = models()["mlp"]
    said, messages = fit_and_warnings(tmp_path, model, x, y, batch_size=1)
    reason = "a step of one example has no spread of per-example gradients"
    assert said == [f"GradHooks: no gradient noise scale estimate: {reason}."]  # once
    assert messages[-1] == f"GradHooks: no gradient noise scale estimate: {reason}."


def test_no_per_example_source_without_accumulation(tmp_path):
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(1, 1, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x[:, None]).mean(-1)

    _, x, y = models()["linear"]
    said, messages = fit_and_warnings(tmp_path, Conv(), x, y, batch_size=16)
    assert said == ["GradHooks: no gradient noise scale estimate: no gradient accumulation, one process, and no "
                    "layer that gives per-example gradient norms (Linear, LayerNorm, RMSNorm, GroupNorm)."]
    assert messages[-1] == said[0]  # and again at the end of fit


def test_all_zero_gradients(tmp_path):
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    for p in model.parameters():
        nn.init.zeros_(p)  # with targets of zero, every gradient is zero
    _, x, y = models()["linear"]
    said, messages = fit_and_warnings(tmp_path, model, x, y * 0, batch_size=16, accumulate_grad_batches=2)
    assert said == ["GradHooks: no gradient noise scale estimate: the gradients are all zero."]
    assert messages[-1] == said[0]


@pytest.mark.parametrize(("features_in", "features_out", "positions"),
                         [(16, 32, 5), (6, 1, 5), (64, 64, 64), (16, 32, None)])
def test_per_example_norms_under_fp16_autocast(features_in, features_out, positions):
    # Under autocast the forward's products would be float16 and meet a float32 gradient in the
    # backward: the probe works in float32 whatever the autocast state, as without autocast (2-D
    # inputs: float16 inputs and output gradients stacked into float32 buffers).
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(features_in, features_out), nn.Tanh(), nn.Linear(features_out, 3))
    x = torch.randn(32, *(() if positions is None else (positions,)), features_in, generator=g)
    estimates = []
    for autocast in (False, True):
        probe = NoiseProbe(model)
        model.zero_grad()
        probe.arm()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()
        estimates.append(probe.collect())
    exact, autocast = estimates
    assert autocast.reason == exact.reason
    # the raw norms the estimates come from: float16 forward products round them a little
    assert math.isfinite(autocast.small_sq) and math.isfinite(autocast.big_sq)
    assert (autocast.small_sq, autocast.big_sq) == pytest.approx((exact.small_sq, exact.big_sq), rel=0.05)
