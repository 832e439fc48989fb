"""health/step.py and tracker.py: a step judged in arrays gives the numbers and runs that entry by entry gives."""

import math
import random
from dataclasses import asdict

import numpy as np

from health_steps import step

from lightning_gradhooks.health.flags import Flag, Subject
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind, rms

# Every branch of rms and size: missing statistics, a single element (std NaN), all zero,
# partly zero, no norm, a non-finite norm (math.hypot), zero_fraction NaN.
ODD = [
    {"mean": 0.5, "std": 1.0, "norm": 2.0, "zero_fraction": 0.75},
    {"mean": 0.5, "norm": 2.0},
    {"std": 1.0, "norm": 2.0},
    {"mean": 3.0, "std": math.nan, "norm": 3.0},
    {"mean": 0.0, "std": 0.0, "norm": 0.0},
    {"mean": 0.0, "std": 0.0, "norm": 0.0, "zero_fraction": 1.0},
    {"mean": 0.1, "std": 0.2},
    {"mean": 0.1, "std": 0.2, "norm": math.inf, "zero_fraction": 0.5},
    {"mean": 0.1, "std": 0.2, "norm": 1.0, "zero_fraction": math.nan},
    {"mean": -0.1, "std": math.inf, "norm": 1.0},
    {},
]


def size(stats):
    """The element count of a gradient, one entry at a time (the reference for the arrays)."""
    mean, std, norm = stats.get("mean"), stats.get("std"), stats.get("norm")
    if None in (mean, std, norm) or not all(map(math.isfinite, (mean, norm))):
        return None
    std = std if math.isfinite(std) else 0.0
    if mean * mean + std * std == 0:
        return None
    return (norm * norm + std * std) / (mean * mean + std * std)


def _entries(stats):
    return {("grad_output", f"m{i}"): s for i, s in enumerate(stats)}


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and (a == b or math.isnan(a) and math.isnan(b)))


def test_the_rms_of_a_whole_step_is_rms_of_each_entry_to_the_bit():
    rng = random.Random(0)
    drawn = [{"mean": rng.uniform(-1, 1) * 10 ** rng.randint(-30, 3), "std": rng.random() * 10 ** rng.randint(-30, 3),
              "norm": rng.random() * 10 ** rng.randint(-30, 5), "zero_fraction": rng.choice([0.0, rng.random()])}
             for _ in range(500)]
    made = step(0, _entries(ODD + drawn))
    with np.errstate(all="ignore"):  # a step is read inside the judge's errstate
        values = made.values
    assert len(values) == len(ODD) + len(drawn) - 1  # (an infinite norm: non-finite, not judged)
    for key, value in values.items():
        expected = rms(made.entries[key])
        assert _same(value, expected), (made.entries[key], value, expected)


def test_the_columns_and_the_sizes_learnt_are_those_of_the_entries():
    made = step(0, {("param_grad", f"m{i}.weight"): s for i, s in enumerate(ODD)})
    assert made.column("norm")[1] == 2.0 and math.isnan(made.column("norm")[2 + 4])
    assert made.column("std", -1.0)[1] == -1.0
    for i, s in enumerate(ODD):
        expected = size(s)
        assert made.shape.sizes.get(f"m{i}.weight") == expected or (expected is not None and math.isnan(expected))


def test_non_finite_entries_are_found_as_entry_by_entry():
    made = step(0, {("grad_output", "a"): {"norm": 1.0, "nonfinite": 2.0}, ("grad_output", "b"): {"norm": 1e30},
                    ("param", "c.w"): {"param_norm": math.inf}, ("param", "d.w"): {"update_ratio": math.nan},
                    ("param", "e.w"): {"norm": 1e30, "update_ratio": 1.0}, ("output", "f"): {"nonfinite": 1.0}})
    assert [(key.name, why) for key, why in made.bad.items()] == [
        ("a", "2 NaN/Inf"), ("b", "norm 1e+30 overflows float32"), ("c.w", "weights non-finite after the step"),
        ("d.w", "update ratio NaN")]
    assert made.finite.tolist() == [False, False, False, False, True, True]


def test_many_runs_at_once_are_the_runs_one_at_a_time():
    rng = random.Random(1)
    subjects = [Subject("param_grad", f"m{i}.weight", f"m{i}") for i in range(40)]
    labels = [s.label for s in subjects]
    one, many = Tracker(), Tracker()
    for number in range(30):
        chosen = subjects[: rng.randint(20, 40)]  # some steps lack some subjects
        bad = sorted(rng.sample(range(len(chosen)), rng.randint(0, len(chosen))))
        needed = rng.choice([1, 3])
        for i, subject in enumerate(chosen):
            one.run("vanishing", subject, number, i in bad, needed, float(i), score=float(number))
        many.run_many("vanishing", chosen, labels[: len(chosen)], number, bad, needed, [float(i) for i in bad], float(number))
        assert one.running("vanishing") == many.running("vanishing")
        if number % 7 == 0:  # read halfway: the flags raised again are made as they are read
            assert one.flags == many.flags
    assert one.state_dict() == many.state_dict()
    assert list(one.flags) == list(many.flags)


def test_a_flag_loaded_without_its_run_keeps_its_step_and_worst_score():
    tracker = Tracker()
    tracker.load_state_dict({"runs": [], "notes": [], "nonfinite": None,
                             "flags": [asdict(Flag("vanishing", "grad_output", "a", 3, 1.0, "a", 2.0))]})
    for number in (10, 11, 12):
        tracker.run("vanishing", Subject("grad_output", "a", "a"), number, True, 3, 5.0, score=1.0)
    flag = tracker.flags[("vanishing", "grad_output a")]
    assert (flag.since, flag.last, flag.score) == (3, 5.0, 2.0)
