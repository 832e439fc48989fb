"""The health report on real training (issue 23): no flag on healthy runs of real architectures,
the right flag on the right module at the right step on broken ones, and the printed report and
``python -m lightning_gradhooks report`` agree, line for line. Models: tests/report_panel.py."""

from __future__ import annotations

import math

import pytest
import torch

import report_panel as panel
from lightning_gradhooks.report import FLAGS

pytest.importorskip("transformers")


def agree(text: str, log_dir: str) -> None:
    """The CLI on the run's log prints what the callback printed."""
    assert panel.cli_table(log_dir) == text


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(panel.HEALTHY))
def test_healthy_runs_get_no_flag_printed_or_from_the_log(tmp_path, name, seed):
    report, text, log_dir, model = panel.fit(tmp_path, panel.HEALTHY[name], seed)
    assert report.rows() == [] and report.flags() == [], report.table(full=True)
    assert text == "GradHooks: no gradient problems seen in 10 logged steps."
    assert all(math.isfinite(loss) for loss in model.losses)
    assert sum(model.losses[-5:]) / 5 < model.losses[0]  # it trains
    code, out, err = panel.cli("report", log_dir, "--fail-on", ",".join(FLAGS))
    assert code == 0 and out.rstrip().endswith(text), err
    assert "warning" not in err


def test_dead_relu_layer_is_one_row_with_its_consequences_under_it(tmp_path):
    report, text, log_dir, _ = panel.fit(tmp_path, panel.dead_relu, steps=12)
    (row,) = report.rows()
    assert (row.flag, row.module, row.since) == ("dead", "net.2", 0)
    folded = {(f.flag, f.module) for f in row.consequences}
    assert ("dead", "net.0") in folded and ("stalled", "net.4") in folded  # upstream, and downstream of it
    assert "follows from it (upstream): dead: net.0; stalled:" in text
    agree(text, log_dir)


def test_deep_sigmoid_stack_is_vanishing_on_its_first_layers_and_never_exploding(tmp_path):
    report, text, log_dir, _ = panel.fit(tmp_path, panel.deep_sigmoid)
    rows = report.rows()
    # Stalled too, after it: updates of 1e-19-sized gradients are lost in float32 weights.
    assert rows[0].flag == "vanishing" and {r.flag for r in rows[1:]} <= {"stalled"}, text
    cause = rows[0]
    flagged = [cause.module] + [f.module for f in cause.consequences]
    layers = sorted(int(m.split(".")[1]) for m in flagged)
    assert layers[0] == 0 and cause.since == 0  # from the first layer, from the first step
    assert layers[-1] < 40 and "net.62" not in flagged  # the layers near the head are healthy
    assert not any(f.flag == "exploding" for f in report.flags())
    agree(text, log_dir)


def test_divergence_is_named_at_its_explosion_with_the_nonfinite_weights_under_it(tmp_path):
    report, text, log_dir, model = panel.fit(tmp_path, lambda seed: panel.resnet(seed, lr=2.0, task="mse"), steps=30)
    first_bad = next(i for i, loss in enumerate(model.losses) if not math.isfinite(loss))
    nonfinite = report.first_nonfinite
    # The first logged step (every 3) at or after the first step whose loss was not finite, or
    # earlier when the gradients or the update of a logged step already were.
    assert nonfinite.since <= 3 * math.ceil(first_bad / 3)
    # The weights went NaN through exploding updates: the explosion is the row, where it was
    # seen, and the non-finite weights follow from it.
    row = report.rows()[0]
    assert row.flag == "exploding" and row.since < nonfinite.since
    assert [(c.flag, c.since) for c in row.consequences] == [("nonfinite", nonfinite.since)]
    assert f"then nonfinite at logged step {nonfinite.since}: weights already non-finite" in text
    assert "nonfinite" in report.names() and text.startswith("GradHooks: nonfinite on 1 module, exploding on")
    assert len(text.splitlines()) <= 40
    agree(text, log_dir)


def test_nan_made_in_a_parameterless_module_is_named_there(tmp_path):
    with pytest.warns(UserWarning, match=r"non-finite values at step 9: born in the forward of `net.3`"):
        report, text, log_dir, _ = panel.fit(tmp_path, lambda seed: panel.log_mlp(seed, at=9), steps=12)
    row = report.rows()[0]
    assert (row.flag, row.module, row.since) == ("nonfinite", "net.3", 9)
    assert "last clean logged step 6" in row.detail
    agree(text, log_dir)


def test_nan_made_in_backward_only_is_named_in_backward_at_the_module_before_it(tmp_path):
    report, text, log_dir, model = panel.fit(tmp_path, panel.nan_backward_mlp, steps=3)
    assert math.isfinite(model.losses[0])
    row = report.rows()[0]
    assert (row.flag, row.module, row.since) == ("nonfinite", "net.2", 0)  # net.3 has no backward hook
    assert row.detail.startswith("born in backward: first seen in grad_output of `net.2`")
    agree(text, log_dir)


def test_loss_times_1e30_overflows_at_step_0_and_is_named_the_loss(tmp_path):
    report, text, log_dir, model = panel.fit(tmp_path, panel.damaged(panel.resnet, loss_scale=1e30), steps=6)
    assert math.isfinite(model.losses[0])  # the forward of step 0 is finite: only the gradients overflow
    row = report.rows()[0]
    assert (row.flag, row.module, row.since) == ("nonfinite", "net.fc", 0)
    assert "the loss" in row.detail and "overflows float32" in row.detail
    agree(text, log_dir)


def test_weights_made_nan_on_a_step_that_is_not_logged(tmp_path):
    # After the update of step 7; steps 0, 3, 6, 9 are logged.
    report, text, log_dir, _ = panel.fit(tmp_path, panel.damaged(panel.vit, nan_weights_at=7), steps=12)
    row = report.rows()[0]
    assert (row.flag, row.since) == ("nonfinite", 9)
    assert "weights already non-finite when the step began" in row.detail and "last clean logged step 6" in row.detail
    agree(text, log_dir)


def test_nan_in_the_batch_is_named_at_the_inputs_of_the_first_module(tmp_path):
    report, text, log_dir, _ = panel.fit(tmp_path, panel.damaged(panel.resnet, nan_input_at=6), steps=8)
    row = report.rows()[0]
    assert (row.flag, row.module, row.since) == ("nonfinite", "net.conv1", 6)  # conv1 is frozen: checked anyway
    assert "inputs of `net.conv1` already non-finite" in row.detail
    agree(text, log_dir)


def test_the_panel_models_are_what_they_claim(tmp_path):
    """The healthy panel holds what made the old definitions fire: zero-initialised biases, a
    cls_token of std 1e-6, frozen parameters, an LSTM read at its last step only, rows of a
    30,000-token embedding that no batch touches."""
    vit, _ = panel.vit(0)
    assert vit.net.cls_token.std() < 1e-5 and not vit.net.pos_embed.requires_grad
    resnet, _ = panel.resnet(0)
    assert not resnet.net.conv1.weight.requires_grad and torch.all(resnet.net.bn1.bias == 0)
    bag, data = panel.bag_of_words(0)
    touched = len(torch.unique(data.tensors[0][:16]))
    assert 1 - touched / 30000 > 0.99
