"""When the report raises a flag: :class:`Thresholds`, each field range-checked by
:mod:`lightning_gradhooks.summary.checks`. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from lightning_gradhooks.summary.checks import check_int, check_number


def _threshold(default: float, help: str, accepted: tuple[float, float | None, tuple[bool, bool]] | None = None) -> Any:
    """A field of :class:`Thresholds`: its default, the one sentence that describes it (the class's
    docstring, the report command's ``--help``), and the accepted range of a float (a count: 1 or
    more)."""
    return field(default=default, metadata={"help": help, "accepted": accepted})


@dataclass(frozen=True)
class Thresholds:
    """When the report raises a flag; every field can be overridden, and each is range-checked
    (the fields and what each means: below, generated from the fields).

    Raises:
        ValueError: a field out of its range (``Thresholds.<field> expected ..., got ...``).
    """

    vanishing_ratio: float = _threshold(
        1e-3, "Flag vanishing when a gradient's RMS is below this share of the median RMS of its kind at the same step.",
        (0.0, 1.0, (False, False)))
    vanishing_steps: int = _threshold(3, "Flag vanishing only after this many logged steps in a row.")
    vanishing_update_ratio: float = _threshold(
        1e-2, "Do not flag vanishing while the parameters it reaches still move by at least this share of the model's "
        "median update ratio (a small gradient that an Adam-family optimizer still turns into normal steps is not a "
        "problem); where no update was measured, the gradient alone decides.", (0.0, 1.0, (True, True)))
    round_off_factor: float = _threshold(
        64.0, "Note, not flag, a parameter whose gradient is below this many float round-offs of the gradient its "
        "module receives (eps of the gradients' precision times the square root of grad_output's element count over "
        "the parameter's), vanishing_steps logged steps in a row: zero by construction (a bias followed by a "
        "normalisation layer); unless a smaller parameter of the same module gets a gradient above round-off.",
        (0.0, None, (False, True)))
    exploding_factor: float = _threshold(
        100.0, "Flag exploding when a gradient's RMS is this many times the median of its own last values.",
        (1.0, None, (False, True)))
    exploding_window: int = _threshold(5, "Take that median over this many of its last logged values.")
    exploding_steps: int = _threshold(
        2, "Flag exploding only after this many logged steps in a row (update ratios too).")
    exploding_update_ratio: float = _threshold(
        10.0, "Flag exploding when an update ratio (the size of the step over the size of the weights) is above "
        "this (a random walk of a bias near zero reaches 1-4).", (0.0, None, (False, True)))
    floor_ratio: float = _threshold(
        0.1, "Ignore gradients and parameters whose RMS is below this share of the model's median at the step "
        "(zero- or tiny-initialised ones, noise far below the model's own scale).", (0.0, 1.0, (True, False)))
    dead_zero_fraction: float = _threshold(
        0.99, "Flag dead when at least this share of a module's output and parameter gradients is zero.",
        (0.0, 1.0, (False, True)))
    dead_steps: int = _threshold(3, "Flag dead only after this many logged steps in a row.")
    stalled_update_ratio: float = _threshold(
        1e-4, "Flag stalled when a parameter's update ratio is 0 or below this share of the model's median (over "
        "parameters at their own scale, see floor_ratio).", (0.0, 1.0, (True, False)))
    stalled_steps: int = _threshold(3, "Flag stalled only after this many logged steps in a row.")
    scaler_skip_steps: int = _threshold(
        8, "A gradient scaler that skips every step for this many steps in a row, after it had found a working "
        "scale, is nonfinite; fewer is a note.")
    scaler_min_scale: float = _threshold(
        1.0, "A gradient scaler whose scale falls below this while it skips steps is nonfinite (below 1 it shrinks "
        "gradients that fp16 could hold).", (0.0, None, (False, True)))
    attention_logit_level: float = _threshold(
        1000.0, "Flag attention_logits when a module's maximum attention logit is above this and still rising "
        "(healthy runs of the validation stay below 130; unstable ones pass 1,000 within ten steps).",
        (0.0, None, (False, True)))
    attention_steps: int = _threshold(2, "Flag attention_logits only after this many rising logged steps in a row.")
    activation_factor: float = _threshold(
        100.0, "Flag activation_growth when an output's RMS is this many times its early level.",
        (1.0, None, (False, True)))
    activation_early_steps: int = _threshold(
        3, "Take the early level as the median of this many first logged values of the output (at the model's "
        "scale, see floor_ratio).")
    activation_steps: int = _threshold(2, "Flag activation_growth only after this many logged steps in a row.")
    spike_factor: float = _threshold(
        5.0, "Name a spike (spikes=True) when an optimizer step's total gradient norm is at least this many times "
        "the median of the recent steps' (the last 32 of the window).", (1.0, None, (False, True)))
    spike_z: float = _threshold(
        4.0, "Name a spike only when its norm is also at least this many robust standard deviations above that "
        "median, on a log scale (1.4826 times the median absolute deviation of the last 64 log norms): OLMo-core's "
        "mean + 6 sigma rule, made robust to the spikes it looks for and to the multiplicative noise of gradient "
        "norms.", (0.0, None, (False, True)))
    spike_window: int = _threshold(
        128, "Keep this many steps' gradient norms for the spike rule (saved with the callback's state; at least 32 "
        "steps are needed first).")
    attention_logit_healthy: float = _threshold(
        100.0, "The top of the range healthy attention logits stay in (Megatron's QK-clip threshold): an "
        "attention_logits flag's since is the step the logits went above it and stayed there.",
        (0.0, None, (False, True)))

    def __post_init__(self) -> None:
        for f in fields(self):
            value, argument = getattr(self, f.name), f"Thresholds.{f.name}"
            accepted = f.metadata["accepted"]
            if accepted is None:  # a whole float (from a config file) is a count too
                value = int(value) if isinstance(value, float) and value.is_integer() else value
                value = check_int(argument, value, 1)
            else:
                value = check_number(argument, value, *accepted)
            object.__setattr__(self, f.name, value)


def help_of(name: str) -> str:
    """The one sentence that describes a field of :class:`Thresholds`."""
    return Thresholds.__dataclass_fields__[name].metadata["help"]


Thresholds.__doc__ += "\n    Attributes:\n" + "\n".join(
    f"        {f.name}: {f.metadata['help']} Default: {f.default}." for f in fields(Thresholds))
