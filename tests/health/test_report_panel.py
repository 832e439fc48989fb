"""The health report on real training: no flag on healthy runs of real architectures,
the right flag on the right module at the right step on broken ones, and the printed report and
``python -m lightning_gradhooks report`` agree, line for line. Models: tests/helpers/report_panel.py."""

from __future__ import annotations

import math

import pytest
import torch

import report_panel as panel
from lightning_gradhooks.health import FLAGS

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
    assert code == 0 and panel.without_noise(out).rstrip().endswith(text), err
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


# -- the bigger panel (tests/helpers/report_panel_runs.py): its integrity only. Its outcomes
# are judged by `python tests/helpers/report_panel.py --half tune|heldout|all`.

def test_panel_halves_are_disjoint_varied_and_long_enough():
    import report_panel_runs as runs

    tune, heldout = runs.TUNE, runs.HELDOUT
    assert not set(tune) & set(heldout)
    assert len(tune) + len(heldout) >= 22 and abs(len(tune) - len(heldout)) <= 3
    for half in (tune, heldout):
        healthy = [r for r in half.values() if r.healthy]
        broken = [r for r in half.values() if not r.healthy]
        assert len({r.arch for r in healthy}) >= 4 and len(healthy) >= 4
        assert len({r.arch for r in broken}) >= 3 and len(broken) >= 3
        assert all(e.flag in runs.PROBLEMS for r in broken for e in r.expects)
    # HELDOUT is other architectures, not other seeds of the same runs.
    assert not {r.arch for r in tune.values()} & {r.arch for r in heldout.values()}
    every = list(tune.values()) + list(heldout.values())
    assert 3 * sum(r.steps >= 200 and r.schedule for r in every) >= len(every)
    assert any(r.resume_at for r in tune.values()) and any(r.resume_at for r in heldout.values())


def _grad_ratios(lit, data, names: list[str]) -> dict[str, float]:
    """``|grad of parameter|`` / ``|grad_output of its module|`` after one backward."""
    modules, outputs = dict(lit.named_modules()), {}
    handles = [modules[n.rpartition(".")[0]].register_full_backward_hook(
        lambda m, gi, go, n=n: outputs.__setitem__(n, go[0].norm().item())) for n in names]
    x, y = data.tensors[0][:16], data.tensors[1][:16]
    out = lit.net(x)
    torch.nn.functional.cross_entropy(getattr(out, "logits", out), y).backward()
    for handle in handles:
        handle.remove()
    params = dict(lit.named_parameters())
    return {n: params[n].grad.norm().item() / outputs[n] for n in names}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_zero_by_construction_parameters_get_round_off_gradients():
    """A bias before BatchNorm, a scalar shift before LayerNorm, an attention score's bias before a
    softmax over time, BERT's key bias: round-off (below 1e-5 of their module's output gradient,
    ~1e-7 seen), while the weights beside them get gradients of their module's scale."""
    torch.manual_seed(0)
    cases = [
        (panel.bias_resnet, ["net.stem.0.bias", "net.layer1.conv1.bias", "net.layer2.down.0.bias"], "net.stem.0.weight"),
        (panel.unet, ["net.enc1.0.bias", "net.enc2.0.bias", "net.dec.0.bias"], "net.enc1.0.weight"),
        (panel.scale_before_norm, ["net.1.shift"], "net.0.weight"),
        (panel.attention_pool, ["net.score.bias"], "net.score.weight"),
        (panel.bert_classifier, ["net.bert.encoder.layer.1.attention.self.key.bias"],
         "net.bert.encoder.layer.1.attention.self.value.bias"),
    ]
    for make, zeros, normal in cases:
        lit, data = make(0)
        lit.train()
        ratios = _grad_ratios(lit, data, zeros + [normal])
        assert all(ratios[n] < 1e-5 for n in zeros), (make.__name__, ratios)
        assert ratios[normal] > 1e-2, (make.__name__, ratios)
    # LayerNorm's eps keeps a scalar scale in front of it from being removed exactly: small, not round-off.
    lit, data = panel.scale_before_norm(0)
    assert 1e-7 < _grad_ratios(lit, data, ["net.1.scale"])["net.1.scale"] < 1e-4


def test_orphan_heads_are_in_no_optimizer_and_lr0_groups_have_lr_0():
    import report_panel_runs as runs

    every = {**runs.TUNE, **runs.HELDOUT}
    for name, head in [("orphan_head_resnet", "net.fc."), ("orphan_head_bert", "net.classifier.")]:
        lit, _ = every[name].make(0)
        lit.schedule = None  # the schedule needs a trainer; the groups do not
        held = {id(p) for group in lit.configure_optimizers().param_groups for p in group["params"]}
        heads = [p for n, p in lit.named_parameters() if n.startswith(head)]
        assert heads and all(p.requires_grad and id(p) not in held for p in heads)
        assert sum(p.requires_grad and id(p) not in held for p in lit.parameters()) == len(heads)
    for name, block in [("gpt2_block_lr0", "net.transformer.h.1."), ("mobilenet_block_lr0", "net.blocks.2.")]:
        lit, _ = every[name].make(0)
        lit.schedule = None
        groups = lit.configure_optimizers().param_groups
        zero = {id(p) for g in groups if g["lr"] == 0 for p in g["params"]}
        assert zero == {id(p) for n, p in lit.named_parameters() if n.startswith(block)} and zero


def test_the_runner_judges_rows_it_does_not_know():
    """A ``note`` row, or a row with more attributes than today's, does not fail a healthy run or
    crash the runner; a broken run's flag is found on a row or among its consequences."""
    from types import SimpleNamespace as Row

    import report_panel_runs as runs

    healthy, broken = runs.TUNE["gpt2_cosine"], runs.TUNE["relu_rnn_explodes"]
    note = Row(flag="note", module="net.stem.0", since=0, detail="no gradient by construction", parameters=["b"])
    report = Row(rows=lambda: [note])
    assert runs.judge(healthy, report, [3.0, 2.0, 1.0]) == (True, "no flag")
    assert not runs.judge(healthy, report, [1.0, 2.0, 3.0])[0]  # a healthy run must train
    cause = Row(flag="exploding", module="net.rnn", since=0, detail="",
                consequences=[Row(flag="nonfinite", module="(model)", since=5)])
    assert runs.judge(broken, Row(rows=lambda: [cause]), [1.0, math.nan])[0]
    assert not runs.judge(broken, Row(rows=lambda: [note]), [1.0, math.nan])[0]


# -- outcomes of the bigger panel: the quick runs of both halves, here; every run of
# both halves, over more seeds: `PYTHONPATH=$PWD:$PWD/tests python tests/helpers/report_panel.py --half all --seeds 0 1`

QUICK = ["scale_before_layernorm", "dcgan_manual", "relu_rnn_explodes", "orphan_head_resnet", "dead_conv_layer",
         "nan_batch_unlogged_resnet", "unet_bias_bn", "gru_attention_pool", "dead_mlp_resumed", "orphan_head_bert",
         "mobilenet_block_lr0", "mlp_dies_mid_run", "tiny_init_tanh_mlp", "detached_encoder", "ema_layernorm_mlp",
         "no_grad_side_branch"]


@pytest.mark.parametrize("name", QUICK)
def test_the_report_meets_each_quick_panel_runs_expected_outcome_printed_and_from_the_log(tmp_path, name):
    import report_panel_runs as runs

    run = {**runs.TUNE, **runs.HELDOUT}[name]
    report, text, log_dir, model = panel.fit(tmp_path, run.make, 0, steps=run.steps, every=run.every, batch=run.batch,
                                             trainer=run.trainer, resume_at=run.resume_at)
    ok, why = runs.judge(run, report, list(model.losses))
    assert ok, f"{why}\n{text}"
    assert len(text.splitlines()) <= 40
    agree(text, log_dir)
    if run.healthy:
        code, out, err = panel.cli("report", log_dir, "--fail-on", ",".join(FLAGS))
        assert code == 0, out  # notes never fail


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_causes_runs_are_what_they_claim():
    """The tiny-init MLP's last weights get gradients far below their module's while their biases
    do not (small inputs, not zero by construction); the detached encoder and the no_grad branch
    get no .grad at all; the scheduler cuts the learning rate to 0 at the step named."""
    lit, data = panel.tiny_tanh_mlp(0)
    ratios = _grad_ratios(lit, data, ["net.10.weight", "net.12.weight", "net.12.bias"])
    assert ratios["net.10.weight"] < 1e-3 and ratios["net.12.weight"] < 1e-5 and ratios["net.12.bias"] > 1e-1
    for make, cut in [(panel.detached_encoder, "net.encoder."), (panel.no_grad_side_cnn, "net.side.")]:
        lit, data = make(0)
        out = lit.net(data.tensors[0][:16])
        torch.nn.functional.cross_entropy(out, data.tensors[1][:16]).backward()
        assert {n for n, p in lit.named_parameters() if p.grad is None} == {
            n for n, _ in lit.named_parameters() if n.startswith(cut)}
    lit, _ = panel.lr_cut_resnet(0)
    lit.total_steps = 200
    scheduler = lit.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.lr_lambdas[0](119) > 0 and scheduler.lr_lambdas[0](120) == 0.0


# -- the forward flags (tests/helpers/forward_panel.py: both halves, longer, by its runner) --

def test_attention_logits_that_blow_up_without_qk_norm_are_named_with_their_remedies(tmp_path):
    import forward_panel

    report, text, log_dir, model = panel.fit(tmp_path, lambda seed: forward_panel.causal_lm(seed, 1e-1), steps=30,
                                             every=5)
    rows = [r for r in report.rows() if r.flag == "attention_logits"]
    assert {r.module for r in rows} <= {"net.blocks.0.attn", "net.blocks.1.attn"} and rows, text
    assert min(r.since for r in rows) <= 10 and all(r.value > 1000 for r in rows)
    assert "known remedies: QK-norm, a lower learning rate or a longer warmup" in text
    agree(text, log_dir)
    # The same model and learning rate with QK-norm: clean (its logits stay near 30).
    report, text, log_dir, _ = panel.fit(tmp_path / "qk", lambda seed: forward_panel.causal_lm(seed, 1e-1, qk_norm=True),
                                         steps=30, every=5)
    assert report.rows() == [], text


def test_activations_that_compound_block_after_block_are_one_row_and_the_explosion_after_it_says_so(tmp_path):
    import forward_panel

    report, text, log_dir, _ = panel.fit(tmp_path, lambda seed: forward_panel.residual_mlp(seed, 1e-1, warmup=100),
                                         steps=120, every=10)
    rows = [r for r in report.rows() if r.flag == "activation_growth"]
    growth = min(rows, key=lambda r: r.since)  # (a block upstream of it may follow later: a row of its own)
    assert all(r.module.startswith("net.blocks.") for r in rows) and 60 <= growth.since <= 100, text
    assert "follows from it (downstream): activation_growth:" in text
    after = [r for r in report.rows() if r.flag == "exploding" and "after the output RMS of `net." in r.detail]
    assert after and all(r.since >= growth.since for r in after), text
    agree(text, log_dir)


def test_without_output_statistics_the_activation_check_says_nothing(tmp_path):
    import forward_panel

    report, text, _, _ = panel.fit(tmp_path, lambda seed: forward_panel.residual_mlp(seed, 1e-1, warmup=100),
                                   steps=120, every=10, activations=False)
    assert "activation_growth" not in report.names() and "exploding" in report.names(), text
    assert "after the output RMS" not in text
