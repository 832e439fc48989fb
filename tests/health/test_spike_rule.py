"""The spike rule and rows (health/spikes.py), driven by hand-made norms: what is a spike, what
is not (heavy-tailed healthy noise, schedules, non-finite steps), which modules carry it, the
learning-rate change beside it, episodes, the judge's rows and its state."""

import math

import numpy as np
import pytest

from lightning_gradhooks.health import HealthReport, Thresholds
from lightning_gradhooks.health.spikes import MIN_STEPS, TOTAL, SpikeRows, SpikeRule, spike_summary

NAMES = ("enc.weight", "enc.bias", "head.weight")


def healthy(rng: np.random.Generator, steps: int, level: float = 1.0) -> list[np.ndarray]:
    """Norms of healthy steps: a level times log-normal noise (sigma 0.35: heavy-tailed, up to ~3x)."""
    return [level * np.exp(rng.normal(0.0, 0.35)) * np.array([1.0, 0.1, 0.5]) for _ in range(steps)]


def feed(rule: SpikeRule, norms: list[np.ndarray], first: int = 0, lrs=None) -> list:  # noqa: ANN001
    return [s for i, n in enumerate(norms) if (s := rule.add(first + i, NAMES, n, None if lrs is None else lrs(first + i)))]


def test_a_step_far_above_its_recent_level_is_a_spike_named_with_the_module_that_carries_it():
    rng = np.random.default_rng(0)
    rule = SpikeRule()
    assert feed(rule, healthy(rng, 60)) == []
    spike = rule.add(60, NAMES, np.array([1.0, 0.1, 12.0]))
    assert spike is not None and spike.step == 60 and spike.window == 32
    assert spike.norm / spike.median > 9
    assert spike.carriers[0][0] == "head" and spike.carriers[0][1] > 0.95 and spike.carriers[0][2] > 15
    assert spike.lr_change is None


@pytest.mark.parametrize("seed", range(5))
def test_healthy_noise_warmup_decay_and_restarts_are_no_spikes(seed):
    """Heavy-tailed noise around a level that falls 10x (decay), rises 5x over 30 steps (warmup)
    and jumps back 3x at restarts: the level moves, the log-spread absorbs the noise."""
    rng = np.random.default_rng(seed)
    rule = SpikeRule()
    level = [min(1.0, (s + 1) / 30) * 5 * (0.1 + 0.9 * (1 + math.cos(math.pi * (s % 100) / 100)) / 2) + 0.5
             for s in range(400)]
    norms = [n * lv for n, lv in zip(healthy(rng, 400), level)]
    assert feed(rule, norms) == []


def test_too_few_steps_judge_nothing_and_non_finite_steps_are_not_spikes_nor_in_the_window():
    rule = SpikeRule()
    ones = [np.ones(3)] * (MIN_STEPS - 1)
    assert feed(rule, ones) == [] and rule.add(MIN_STEPS, NAMES, np.full(3, 100.0)) is None  # the 16th step is judged by 15
    rule = SpikeRule()
    feed(rule, [np.ones(3)] * MIN_STEPS)
    assert rule.add(20, NAMES, np.array([1.0, math.inf, 1.0])) is None
    assert rule.add(21, NAMES, np.array([math.nan, 1.0, 1.0])) is None
    assert len(rule.norms) == MIN_STEPS
    assert rule.add(22, NAMES, np.full(3, 5.0)) is not None  # 5x a level with no spread


def test_a_spike_right_after_a_learning_rate_jump_says_so_a_smooth_schedule_does_not():
    rng = np.random.default_rng(1)
    rule = SpikeRule()
    feed(rule, healthy(rng, 40), lrs=lambda s: [1e-3 * 0.97 ** s])  # a decay of 3 % a step: no jump
    rule.add(40, NAMES, np.ones(3), [1e-3 * 0.97 ** 40])
    spike = rule.add(41, NAMES, np.full(3, 30.0), [1e-3 * 0.97 ** 40])
    assert spike is not None and spike.lr_change is None
    rule.add(42, NAMES, np.ones(3), [0.05])  # x50 at step 42
    spike = rule.add(43, NAMES, np.full(3, 40.0), [0.05])
    assert spike is not None and spike.lr_change == (42, pytest.approx(1e-3 * 0.97 ** 40), 0.05)
    rule.add(44, NAMES, np.ones(3), [0.05])
    assert rule.add(46, NAMES, np.full(3, 40.0), [0.05]).lr_change[0] == 42  # 4 steps after it: said
    for step in (47, 48):
        rule.add(step, NAMES, np.ones(3), [0.05])
    assert rule.add(49, NAMES, np.full(3, 40.0), [0.05]).lr_change is None  # 7 steps after it: not said


def test_the_rules_state_resumes_where_it_stopped():
    rng = np.random.default_rng(2)
    norms = healthy(rng, 50) + [np.array([1.0, 0.1, 20.0])]
    whole = SpikeRule()
    expected = feed(whole, norms, lrs=lambda s: [0.1])
    first = SpikeRule()
    feed(first, norms[:40], lrs=lambda s: [0.1])
    resumed = SpikeRule(Thresholds())
    resumed.load_state_dict(first.state_dict())
    assert feed(resumed, norms[40:], first=40, lrs=lambda s: [0.1]) == expected and len(expected) == 1
    fresh = SpikeRule()
    assert feed(fresh, norms[40:], first=40) == []  # without the window: too few steps to judge 50


def test_the_judge_reports_spikes_as_rows_not_logged_steps_and_groups_an_episode():
    rule = SpikeRule()
    feed(rule, [np.ones(3)] * 40)
    report = HealthReport()
    for step in (0, 10, 20, 30, 40, 50):
        report.add_stats(step, {("grad_output", "enc"): {"mean": 0.0, "std": 1.0}})
    for step in (41, 42, 44):  # one episode: at most two steps apart
        report.add_stats(step, spike_summary(rule.add(step, NAMES, np.array([1.0, 1.0, 30.0]))))
    report.add_stats(47, spike_summary(rule.add(47, NAMES, np.array([50.0, 1.0, 1.0]))))
    assert report.steps == 6
    rows = report.rows()
    assert [(r.flag, r.module, r.since) for r in rows] == [("spike", "head", 41), ("spike", "enc", 47)]
    assert "2 more spike steps to step 44" in rows[0].detail and "step 42 logged in full" not in rows[0].detail
    assert "carried by `head`" in rows[0].detail
    assert report.names() == {"spike"}
    table = report.table()
    assert table.startswith("GradHooks: spike at 2 steps in 6 logged steps")
    resumed = HealthReport()
    resumed.load_state_dict(report.state_dict())
    assert resumed.table() == table


def test_the_row_names_the_step_logged_in_full_after_the_spike():
    rows = SpikeRows()
    rows.take(137, {("spike", TOTAL): {"norm": 9.0, "median": 1.0, "ratio": 9.0, "window": 128.0},
                    ("spike", "net.0"): {"share": 0.8, "ratio": 11.0}})
    [row] = rows.rows([100, 138, 150])
    assert (row.module, row.since, row.value) == ("net.0", 137, 9.0)
    assert "x9 the median (1) of the 128 steps before it" in row.detail and "step 138 logged in full" in row.detail
    assert "step 150" not in rows.rows([100, 150])[0].detail


def test_two_optimizers_spiking_at_one_step_get_a_row_each_named_by_optimizer():
    report = HealthReport()
    for optimizer, module in ((0, "gen.0"), (1, "disc.2")):
        rule = SpikeRule(optimizer=optimizer)
        feed(rule, [np.ones(3)] * 40)
        spike = rule.add(40, (f"{module}.weight", f"{module}.bias", "other.weight"), np.array([40.0, 1.0, 1.0]))
        report.add_stats(40, spike_summary(spike))
    rows = report.rows()
    assert [(r.module, r.since) for r in rows] == [("optimizer_0/gen.0", 40), ("optimizer_1/disc.2", 40)]
    resumed = HealthReport()
    resumed.load_state_dict(report.state_dict())
    assert resumed.table() == report.table()


@pytest.mark.parametrize("field, value", [("spike_factor", 1.0), ("spike_z", 0.0), ("spike_window", 0),
                                          ("attention_logit_healthy", -1.0)])
def test_bad_spike_thresholds_are_refused(field, value):
    with pytest.raises(ValueError, match=f"Thresholds.{field}` expected"):
        Thresholds(**{field: value})
