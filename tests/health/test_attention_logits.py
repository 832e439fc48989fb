"""health/attention_logits.py: attention logits past a level no healthy run reaches, still rising."""

from health_steps import drive, flagged

from lightning_gradhooks.health import HealthReport
from lightning_gradhooks.health.attention_logits import AttentionLogits
from lightning_gradhooks.health.thresholds import Thresholds


def logits(**maxima: float) -> dict:
    return {("attention_logit", name.replace("_", ".")): {"max": value} for name, value in maxima.items()}


def test_flagged_since_the_step_it_went_past_1000_while_it_keeps_rising():
    # The validation's causal LM at lr 0.1 without QK-norm: 1.3, 1952 at step 10, then 1e4-1e5.
    series = [6.0, 40.0, 1952.0, 6400.0, 28_000.0, 90_000.0]
    tracker = drive(AttentionLogits(Thresholds()), {5 * n: logits(blocks_0=v, blocks_1=7.0) for n, v in enumerate(series)})
    assert flagged(tracker) == [("attention_logits", "attention_logit blocks.0", 10)]


def test_healthy_levels_and_a_plateau_above_the_level_are_not_flagged():
    healthy = [6.0, 30.0, 45.0, 43.0, 44.0, 45.0]  # QK-norm at lr 0.1
    assert flagged(drive(AttentionLogits(Thresholds()), {n: logits(a=v) for n, v in enumerate(healthy)})) == []
    creeping = [13.0, 83.0, 91.5, 96.0, 103.0, 125.0, 110.0, 123.0]  # no QK-norm at lr 0.01, 400 steps
    assert flagged(drive(AttentionLogits(Thresholds()), {n: logits(a=v) for n, v in enumerate(creeping)})) == []
    plateau = [900.0, 1200.0, 1100.0, 1150.0, 1120.0, 1140.0]  # above, but never rising two logged steps in a row
    assert flagged(drive(AttentionLogits(Thresholds()), {n: logits(a=v) for n, v in enumerate(plateau)})) == []


def test_a_dip_while_above_the_level_keeps_the_step_it_went_past():
    series = [50.0, 500.0, 1290.0, 1250.0, 3000.0, 20000.0]
    tracker = drive(AttentionLogits(Thresholds()), {n: logits(a=v) for n, v in enumerate(series)})
    assert flagged(tracker) == [("attention_logits", "attention_logit a", 1)]  # left the healthy range at 1


def test_since_is_the_step_the_logits_left_the_healthy_range_and_the_row_says_both_steps():
    """The issue's example: past 100 at step 5, past 1,000 at step 20, flagged later at the level."""
    report = HealthReport()
    for step, value in [(0, 30.0), (5, 150.0), (10, 400.0), (15, 800.0), (20, 1500.0), (25, 5000.0), (30, 2e4)]:
        report.add_stats(step, {("attention_logit", "blocks.3.attn"): {"max": value}})
    [row] = report.rows()
    assert (row.flag, row.since) == ("attention_logits", 5)
    assert row.detail.startswith("the attention logits passed 100 at step 5 and 1000 at step 20 and kept rising")
    # Back in the healthy range, then out again: the onset is the later one.
    report = HealthReport()
    for step, value in [(0, 150.0), (5, 90.0), (10, 300.0), (15, 1200.0), (20, 3000.0)]:
        report.add_stats(step, {("attention_logit", "a"): {"max": value}})
    assert [(r.since, r.detail.split(" and kept")[0]) for r in report.rows()] == [
        (10, "the attention logits passed 100 at step 10 and 1000 at step 15")]


def test_nan_logits_are_not_read_and_the_level_is_a_threshold():
    series = [150.0, 200.0, float("nan"), 400.0]
    check = AttentionLogits(Thresholds(attention_logit_level=500.0))
    assert flagged(drive(check, {n: logits(a=v) for n, v in enumerate(series)})) == []
    # 150 (no step before it: not known to rise), 200, (NaN: not read), 400: two rising steps.
    low = Thresholds(attention_logit_level=100.0)
    tracker = drive(AttentionLogits(low), {n: logits(a=v) for n, v in enumerate(series)})
    assert flagged(tracker) == [("attention_logits", "attention_logit a", 0)]
    longer = AttentionLogits(Thresholds(attention_logit_level=100.0, attention_steps=3))
    assert flagged(drive(longer, {n: logits(a=v) for n, v in enumerate(series)})) == []


def test_the_state_survives_a_resume():
    first = AttentionLogits(Thresholds())
    drive(first, {0: logits(a=500.0), 1: logits(a=1500.0)})
    resumed = AttentionLogits(Thresholds())
    resumed.load_state_dict(first.state_dict())
    assert flagged(drive(resumed, {2: logits(a=4000.0)})) == [] and resumed.above == {"attention_logit a": 1}
    assert resumed.left == {"attention_logit a": 0}
    tracker = drive(resumed, {3: logits(a=9000.0), 4: logits(a=20000.0)})
    assert flagged(tracker) == [("attention_logits", "attention_logit a", 0)]


def test_the_row_names_the_step_and_the_remedies_and_an_explosion_after_it_says_so():
    report = HealthReport()
    for n, value in enumerate([10.0, 1952.0, 1e4, 1e5, 1e6, 1e7]):
        grads = {("grad_output", f"blocks.{i}"): {"mean": 0.0, "std": 1.0} for i in (2, 1, 0)}  # backward order
        if n >= 4:
            grads[("grad_output", "blocks.2")] = {"mean": 0.0, "std": 1e4}
        report.add_stats(10 * n, {**grads, ("attention_logit", "blocks.0.attn"): {"max": value}})
    rows = {r.flag: r for r in report.rows()}
    attention = rows["attention_logits"]
    assert (attention.module, attention.since) == ("blocks.0.attn", 10)  # from 10 straight past 1000: no step between
    assert attention.detail.startswith("the attention logits passed 1000 at step 10 and kept rising")
    assert "QK-norm, a lower learning rate or a longer warmup" in attention.detail
    exploding = rows["exploding"]
    assert (exploding.module, exploding.since) == ("blocks.2", 40)
    # blocks.0 ran before blocks.2 (later in backward order): upstream of it.
    assert exploding.detail.endswith("; after the attention logits of `blocks.0.attn` passed 1000 at step 10")
    assert "attention_logits on 1 module" in report.table()


def test_the_forward_thresholds_are_range_checked():
    import pytest

    with pytest.raises(ValueError, match="Thresholds.attention_logit_level` expected a number > 0, got 0.0"):
        Thresholds(attention_logit_level=0.0)
    with pytest.raises(ValueError, match="Thresholds.activation_factor` expected"):
        Thresholds(activation_factor=1.0)
    with pytest.raises(ValueError, match="Thresholds.attention_steps` expected"):
        Thresholds(attention_steps=0)
    assert Thresholds(activation_early_steps=2.0).activation_early_steps == 2
