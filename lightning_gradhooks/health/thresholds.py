"""When the report raises a flag: :class:`Thresholds`, each field range-checked by
:mod:`lightning_gradhooks.core._checks`. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, fields

from lightning_gradhooks.core._checks import check_int, check_number


@dataclass(frozen=True)
class Thresholds:
    """When the report raises a flag; every field can be overridden, and each is range-checked.

    Attributes:
        vanishing_ratio: RMS below this share of the median RMS (same kind, same step) ...
        vanishing_steps: ... for this many logged steps in a row, while the parameters it
            reaches move by less than ...
        vanishing_update_ratio: ... this share of the model's median update ratio (a small
            gradient that an Adam-family optimizer still turns into normal steps is not a
            problem); where no update was measured, the gradient alone decides.
        round_off_factor: a parameter gradient whose norm is below this many float round-offs
            of the gradient its module receives (``grad_output``: ``eps`` of the gradients'
            precision times the square root of its element count over the parameter's),
            ``vanishing_steps`` logged steps in a row, is zero by construction (a bias followed
            by a normalisation layer): a note, never a flag; unless a smaller parameter of the
            same module gets a gradient above round-off (then the bigger one's is small because
            its input is: a weight behind a vanishing signal, not a redundant parameter).
        exploding_factor: RMS this many times the median of its own last values ...
        exploding_window: ... over this many logged steps (the baseline) ...
        exploding_steps: ... for this many logged steps in a row (also for update ratios).
        exploding_update_ratio: ``update_ratio`` (‖Δw‖/‖w_before‖) above this: a step ten
            times the size of the weights it moves (a random walk of a bias near zero reaches 1-4).
        floor_ratio: gradients (for ``exploding``) and parameters (for update ratios) whose RMS
            is below this share of the model's median at the step are at the floor: zero- and
            tiny-initialised parameters, noise far below the model's own scale; not read.
        dead_zero_fraction: ``zero_fraction`` at least this, of a module's output gradient and
            of its parameter gradients ...
        dead_steps: ... for this many logged steps in a row.
        stalled_update_ratio: ``update_ratio`` 0 or below this share of the model's median
            update ratio at the step (over parameters at their own scale, see ``floor_ratio``) ...
        stalled_steps: ... for this many logged steps in a row.
        scaler_skip_steps: a gradient scaler that skips every optimizer step for this many steps
            in a row, after it had found a working scale, has stopped training: ``nonfinite``
            (fewer: a note; a run from the start of training is a scale coming down from too high) ...
        scaler_min_scale: ... as has one whose scale falls below this while it skips (below 1 it
            shrinks gradients that fp16 could hold).
        attention_logit_level: a maximum attention logit above this, higher than at the logged
            step before ... (healthy runs of the validation stay below 130, and a healthy causal
            LM's creeps past Megatron's QK-clip threshold of 100 after a few hundred steps; the
            unstable ones pass 1,000 within ten steps and reach 1e4-1e5)
        attention_steps: ... for this many logged steps in a row.
        activation_factor: an output RMS this many times its early level (the median of its
            first ``activation_early_steps`` logged values at the model's scale, see
            ``floor_ratio``) ...
        activation_early_steps: (the early level's length) ...
        activation_steps: ... for this many logged steps in a row.
        spike_factor: (``GradHooks(spikes=True)``) an optimizer step whose total gradient norm
            is at least this many times the median of the last ``spike_window`` steps' ...
        spike_z: ... and at least this many robust standard deviations above it, on a log scale
            (1.4826 times the median absolute deviation of the window's log norms) is a spike
            (OLMo-core's rule, mean + 6 sigma over the last 128 steps, made robust to the spikes
            it looks for and to the multiplicative noise of gradient norms;
            :mod:`~lightning_gradhooks.health.spikes`) ...
        spike_window: the steps kept for it (and saved with the callback's state; the level is
            the median of the last 32 of them, the spread that of the last 64; at least 16 steps
            are needed first).
        attention_logit_healthy: the top of the range healthy attention logits stay in
            (Megatron's QK-clip threshold): an ``attention_logits`` flag's ``since`` is the step
            the logit went above it and stayed there.

    Raises:
        ValueError: a field out of its range (``Thresholds.<field> expected ..., got ...``).
    """

    vanishing_ratio: float = 1e-3
    vanishing_steps: int = 3
    vanishing_update_ratio: float = 1e-2
    round_off_factor: float = 64.0
    exploding_factor: float = 100.0
    exploding_window: int = 5
    exploding_steps: int = 2
    exploding_update_ratio: float = 10.0
    floor_ratio: float = 0.1
    dead_zero_fraction: float = 0.99
    dead_steps: int = 3
    stalled_update_ratio: float = 1e-4
    stalled_steps: int = 3
    scaler_skip_steps: int = 8
    scaler_min_scale: float = 1.0
    attention_logit_level: float = 1000.0
    attention_steps: int = 2
    activation_factor: float = 100.0
    activation_early_steps: int = 3
    activation_steps: int = 2
    spike_factor: float = 4.0
    spike_z: float = 4.0
    spike_window: int = 128
    attention_logit_healthy: float = 100.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value, argument = getattr(self, f.name), f"Thresholds.{f.name}"
            if f.type in (int, "int"):  # a whole float (from a config file) is a count too
                value = int(value) if isinstance(value, float) and value.is_integer() else value
                value = check_int(argument, value, 1)
            else:
                value = check_number(argument, value, *_RANGES[f.name])
            object.__setattr__(self, f.name, value)


# The accepted range of each number: (low, high or None, (low included, high included)).
_RANGES = {
    "vanishing_ratio": (0.0, 1.0, (False, False)),
    "vanishing_update_ratio": (0.0, 1.0, (True, True)),
    "round_off_factor": (0.0, None, (False, True)),
    "exploding_factor": (1.0, None, (False, True)),
    "exploding_update_ratio": (0.0, None, (False, True)),
    "floor_ratio": (0.0, 1.0, (True, False)),
    "dead_zero_fraction": (0.0, 1.0, (False, True)),
    "stalled_update_ratio": (0.0, 1.0, (True, False)),
    "scaler_min_scale": (0.0, None, (False, True)),
    "attention_logit_level": (0.0, None, (False, True)),
    "activation_factor": (1.0, None, (False, True)),
    "spike_factor": (1.0, None, (False, True)),
    "spike_z": (0.0, None, (False, True)),
    "attention_logit_healthy": (0.0, None, (False, True)),
}
