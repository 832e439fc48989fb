"""The gradient noise scale's estimate, its smoothing and its advice, from squared gradient norms. No torch.

The probe that measures the squared norms on logged steps is
:class:`lightning_gradhooks.core.noise.NoiseProbe` (its docstring says how). Here: the unbiased
estimates of ``|G|²`` and ``tr(Σ)`` from a small and a big batch (McCandlish et al. 2018,
appendix A), one step's sample (:class:`NoiseSample`), their smoothing over logged steps
(:class:`NoiseScale`), the run's summary with its bootstrap interval (:class:`NoiseSummary`) and
the sentence a user can act on (:func:`advice`), which the report command prints from the event
files alone (:func:`sentence_of`).
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


__all__ = [
    "MIN_VALUES", "REASONS", "SOURCE_NAMES", "NoiseSample", "NoiseScale", "NoiseSummary", "advice", "noise_estimates",
    "sentence_of",
]

#: The ``torch.nn`` layers that give per-example gradient norms (the probe's sources).
SOURCE_NAMES = ("Linear", "LayerNorm", "RMSNorm", "GroupNorm")

#: Why a step gave no estimate: :attr:`NoiseSample.reason` is one of these, formatted with the
#: sample's ``big``; the compact summary stores its index, so the report command says it too.
REASONS = (
    "the micro-batch size is unknown (pass `batch_size` when arming)",
    "the gradients are not finite",
    "no backward pass reached the parameters on a rank",
    "no gradient accumulation, one process, and no layer that gives per-example gradient norms "
    f"({', '.join(SOURCE_NAMES)})",
    "no per-example layer ran exactly once in the step's forward and backward",
    "no per-example layer saw the batch of {big:,.0f} along its input's first dimension",
    "a step of one example has no spread of per-example gradients",
    "the gradients are all zero",
    "gradient accumulation with sharded parameters (each micro-batch's gradient is reduce-scattered "
    "before it can be read)",
    "a sharded parameter's gradient has a Partial placement (a sum not reduced yet)",
    "the per-example layers that ran differ between the ranks",
)


def noise_estimates(small_sq: float, big_sq: float, small: float, big: float) -> tuple[float, float]:
    """Unbiased estimates ``(|G|², tr(Σ))`` from the squared gradient norms of a batch of
    ``small`` examples and one of ``big`` examples (McCandlish et al. 2018, appendix A).

    Raises:
        ValueError: unless ``0 < small < big``.
    """
    if not 0 < small < big:
        raise ValueError(f"`small` and `big` expected 0 < small < big, got small={small}, big={big}")
    grad_sq = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1 / small - 1 / big)
    return grad_sq, trace


@dataclass
class NoiseSample:
    """The raw material of one logged step's noise-scale estimate.

    Attributes:
        small_sq: ``|G_b|²``, the squared norm of the small batch's gradient (of its mean loss),
            as the hooks saw it (times the loss scale squared, before :meth:`unscaled`).
        big_sq: ``|G_B|²``, the squared norm of the gradient the optimizer steps with.
        small: ``b``, examples in the small batch (1: per-example norms).
        big: ``B``, examples in the big batch: the batch per optimizer step.
        source: ``"accumulation"``, ``"data_parallel"`` (both: ``"accumulation+data_parallel"``)
            or ``"per_example"``.
        coverage: the share of the step's parameter elements the estimate covers (below 1 for
            per-example norms, which only some layers give).
        reason: why there is no estimate (the numbers are then NaN); None when there is one.
        nonfinite_ranks: under data parallelism, the ranks whose own gradient (each backward's,
            before the all-reduce) was not finite; ``()`` when all were, or when not known.
    """

    small_sq: float
    big_sq: float
    small: float
    big: float
    source: str
    coverage: float = 1.0
    reason: str | None = None
    nonfinite_ranks: tuple[int, ...] = ()

    @classmethod
    def none(cls, reason: int, source: str = "", big: float = math.nan) -> NoiseSample:
        """A sample that holds no estimate, saying why (an index into :data:`REASONS`)."""
        return cls(math.nan, math.nan, math.nan, big, source, 0.0, REASONS[reason].format(big=big))

    def unscaled(self, scale: float, parameters: bool = False) -> NoiseSample:
        """A copy with what the hooks saw divided by a mixed-precision loss scale; with
        ``parameters``, ``.grad`` too (read before any unscale: an optimizer that unscales in
        its own step)."""
        big_sq = self.big_sq / (scale * scale) if parameters else self.big_sq
        return replace(self, small_sq=self.small_sq / (scale * scale), big_sq=big_sq)

    def estimates(self) -> tuple[float, float]:
        """``(|G|², tr(Σ))`` of this step, unsmoothed (NaN without an estimate)."""
        if self.reason is not None:
            return math.nan, math.nan
        return noise_estimates(self.small_sq, self.big_sq, self.small, self.big)

    def stats(self) -> dict[str, float]:
        """What the compact summary holds for this step: the unsmoothed estimates and batches;
        without an estimate, why (its index in :data:`REASONS`, -1 for another) and the batch."""
        if self.reason is not None:
            known = [i for i, r in enumerate(REASONS) if r.format(big=self.big) == self.reason]
            return {"reason": float(known[0] if known else -1), "big_batch": float(self.big)}
        grad_sq, trace = self.estimates()
        return {"grad_sq": grad_sq, "trace": trace, "noise_scale": trace / grad_sq if grad_sq > 0 else math.nan,
                "small_batch": float(self.small), "big_batch": float(self.big), "coverage": float(self.coverage)}


class NoiseScale:
    """``B_simple`` smoothed over logged steps: bias-corrected exponential moving averages of
    ``|G|²`` and of ``tr(Σ)``, taken separately, and the ratio of the two averages.

    The ratio of averages, not the average of ratios: a single step's ``|G|²`` is a small
    difference of two large numbers and can be near zero or negative, where its ratio means
    nothing. Adam's bias correction makes the first steps the plain mean of the steps so far.

    It keeps every step's raw estimates for :meth:`summary`: the sentence at the end of fit
    reads the run's second half, not the latest smoothed value alone.

    Args:
        decay: each logged step's weight is ``1 - decay`` (0.9: about the last 10 logged steps).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"`decay` expected a number in [0, 1), got {decay!r}")
        self.decay = decay
        self._grad_sq = self._trace = 0.0
        self._weight = 0.0  # 1 - decay**n: the bias correction
        #: The steps taken in so far.
        self.steps = 0
        #: ``(step, |G|², tr(Σ), batch per step, coverage)``: every step's raw estimates taken in.
        self.history: list[tuple[int, float, float, float, float]] = []
        #: Whether a sample was taken in (:meth:`take`), and why the latest had no estimate.
        self.seen = False
        self.reason: str | None = None

    def take(self, sample: NoiseSample, step: int) -> float | None:
        """Take in one logged step's sample: its estimates, or why it has none (warned when the
        reason changes). Returns :attr:`value` after an estimate, None without one."""
        if sample.reason is not None and sample.reason != self.reason:
            warnings.warn(f"GradHooks: no gradient noise scale estimate: {sample.reason}.", stacklevel=4)
        return self.add_stats(step, sample.stats())

    def add_stats(self, step: int, stats: Mapping[str, float]) -> float | None:
        """Take in one logged step's compact summary (:meth:`NoiseSample.stats`), as read back
        from the event files: the same as :meth:`take`, without the warning."""
        self.seen = True
        if "reason" in stats:
            code = int(stats["reason"])
            self.reason = REASONS[code].format(big=stats["big_batch"]) if 0 <= code < len(REASONS) else "unknown"
            return None
        self.reason = None
        return self.update(stats["grad_sq"], stats["trace"], step, stats["big_batch"], stats["coverage"])

    def sentence(self) -> str | None:
        """The sentence printed at the end of fit (:func:`advice`); None before any sample."""
        if not self.seen:
            return None
        latest = self.history[-1][0] if self.history and self.reason is not None else None
        return advice(self.summary(), self.reason, latest)

    def update(self, grad_sq: float, trace: float, step: int = -1, batch: float = math.nan,
               coverage: float = 1.0) -> float | None:
        """Take in one step's estimates; returns :attr:`value`. Non-finite ones are skipped."""
        if math.isfinite(grad_sq) and math.isfinite(trace):
            d = self.decay
            self._grad_sq = d * self._grad_sq + (1 - d) * grad_sq
            self._trace = d * self._trace + (1 - d) * trace
            self._weight = d * self._weight + (1 - d)
            self.steps += 1
            self.history.append((step, float(grad_sq), float(trace), float(batch), float(coverage)))
        return self.value

    @property
    def grad_sq(self) -> float:
        """The smoothed ``|G|²`` (NaN before the first step)."""
        return self._grad_sq / self._weight if self._weight else math.nan

    @property
    def trace(self) -> float:
        """The smoothed ``tr(Σ)`` (NaN before the first step)."""
        return self._trace / self._weight if self._weight else math.nan

    @property
    def value(self) -> float | None:
        """``tr(Σ) / |G|²`` of the smoothed values, in examples; None before the first step and
        while the smoothed ``|G|²`` is not positive (the noise drowns the signal at this batch)."""
        if not self.steps or not self.grad_sq > 0 or not self.trace >= 0:
            return None
        return self.trace / self.grad_sq

    def summary(self) -> NoiseSummary | None:
        """The run's later part: ``tr(Σ) / |G|²`` of the sums of the raw estimates over the second
        half of the logged steps with one (a long average, whose ratio is far less biased than
        that of a short one), and a bootstrap interval of it; None before the first step."""
        if not self.history:
            return None
        later = self.history[len(self.history) // 2:]
        # Blocks of consecutive steps (at most BLOCKS) are resampled: neighbours may be correlated.
        size = -(-len(later) // BLOCKS)
        blocks = [(sum(h[1] for h in later[i:i + size]), sum(h[2] for h in later[i:i + size]))
                  for i in range(0, len(later), size)]
        rng = random.Random(0)  # the same interval for the same steps: printed and resumed alike
        draws = sorted(_ratio(rng.choices(blocks, k=len(blocks))) for _ in range(RESAMPLES))
        return NoiseSummary(_ratio(blocks), _quantile(draws, 0.1), _quantile(draws, 0.9), len(later),
                            later[-1][3], sum(h[4] for h in later) / len(later), later[0][0])

    def state_dict(self) -> dict:
        """Plain values for a checkpoint: the averages and the history."""
        return {"grad_sq": self._grad_sq, "trace": self._trace, "weight": self._weight, "steps": self.steps,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self._grad_sq, self._trace, self._weight = state["grad_sq"], state["trace"], state["weight"]
        self.steps, self.history = state["steps"], [tuple(h) for h in state["history"]]


def sentence_of(samples: Mapping[int, Mapping[str, float]]) -> str | None:
    """The sentence of the end of fit (:meth:`NoiseScale.sentence`) from the logged steps' compact
    summaries of the noise (:meth:`NoiseSample.stats`, by step, as the report command reads them);
    None where there is none."""
    scale = NoiseScale()
    for step in sorted(samples):
        scale.add_stats(step, samples[step])
    return scale.sentence()


def _ratio(blocks: Sequence[tuple[float, float]]) -> float:
    """``tr(Σ) / |G|²`` of summed estimates: ``inf`` where ``|G|²`` is not positive (the noise
    drowns the signal), 0 where ``tr(Σ)`` is negative."""
    grad_sq, trace = sum(g for g, _ in blocks), sum(t for _, t in blocks)
    return max(trace, 0.0) / grad_sq if grad_sq > 0 else math.inf


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly (``inf`` where a neighbour is)."""
    at = (len(ordered) - 1) * q
    low, high = ordered[math.floor(at)], ordered[math.ceil(at)]
    return high if math.isinf(high) else low + (high - low) * (at - math.floor(at))


#: Logged estimates the run's second half needs before its interval can back any advice.
MIN_VALUES = 8
#: The bootstrap of :meth:`NoiseScale.summary`: resamples, and blocks of consecutive steps.
RESAMPLES, BLOCKS = 200, 100


@dataclass(frozen=True)
class NoiseSummary:
    """The noise scale of a run's later part (:meth:`NoiseScale.summary`).

    Attributes:
        median: ``tr(Σ) / |G|²`` of the raw estimates summed over the second half of the logged
            steps with an estimate (``inf``: the noise drowns the signal there).
        low, high: the 10th and 90th percentiles of it over bootstrap resamples of those steps.
        values: how many logged steps that half holds.
        batch: the batch per optimizer step of the latest of them.
        coverage: the mean share of the parameters' elements the estimates cover.
        since: the first step of that half.
    """

    median: float
    low: float
    high: float
    values: int
    batch: float
    coverage: float
    since: int


def _regime(noise_scale: float, batch: float) -> str:
    """Which advice a noise scale gives for a batch: ``"larger"``, ``"near"`` or ``"smaller"``."""
    return "larger" if batch < noise_scale / 2 else "near" if batch <= 2 * noise_scale else "smaller"


def _examples(n: float) -> str:
    """A number of examples as a person reads it: two significant digits under 10 (``0.034``,
    ``3.4``), whole numbers with thousands separators above."""
    if math.isinf(n):
        return "∞"
    if n >= 9.95:
        return f"{n:,.0f}"
    if n <= 0:
        return "0"
    decimals = 1 - math.floor(math.log10(n))
    return f"{round(n, decimals):.{max(decimals, 0)}f}"


def advice(summary: NoiseSummary | None, reason: str | None = None, step: int | None = None) -> str:
    """One sentence the user can act on: the noise scale of the run's later part next to the
    batch per optimizer step; advice only where its whole interval gives the same.

    Args:
        summary: from :meth:`NoiseScale.summary`; None: there is no estimate (``reason`` says why).
        reason: why there is no estimate (at the latest logged steps).
        step: the latest step with an estimate, when the logged steps since gave none (it is named).
    """
    drowned = "|G|² summed over the run's second half is not positive (the noise drowns the signal at this batch size)"
    if summary is None or math.isinf(summary.median):
        why = reason if summary is None and reason else drowned
        return f"GradHooks: no gradient noise scale estimate: {why}."
    n, b = _examples(summary.median), f"{summary.batch:,.0f}"
    spread = (f"over the run's second half: {summary.values} logged steps since step {summary.since}; 80% "
              f"interval {_examples(summary.low)} to {_examples(summary.high)}")
    if summary.coverage < 0.995:
        share = f"{summary.coverage:.0%}" if summary.coverage >= 0.01 else "under 1%"
        spread += (f"; from per-example norms covering {share} of the parameters (the "
                   f"{', '.join(SOURCE_NAMES)} layers): the noise scale of those")
    at = "" if step is None else f"; the logged steps after step {step} gave no estimate"
    head = f"GradHooks: gradient noise scale ~ {n} examples ({spread}{at}); your batch per optimizer step is {b}: "
    regime = _regime(summary.median, summary.batch)
    if summary.values < MIN_VALUES:
        return head + (f"too few logged estimates ({summary.values} in the second half, {MIN_VALUES} needed) to "
                       "advise; log more steps (a smaller `every_n_steps`).")
    if {_regime(summary.low, summary.batch), _regime(summary.high, summary.batch)} != {regime}:
        return head + ("the estimate is uncertain: its interval spans different advice, so none is given; log "
                       "more steps for a steadier estimate.")
    if regime == "larger":
        return head + (f"a larger batch (up to ~{n}) would cut the number of steps almost in proportion "
                       "(scale the learning rate with it).")
    if regime == "near":
        return head + ("the batch is near the critical batch size: a larger one would save fewer steps than it "
                       "costs in examples.")
    if summary.median < 2:
        return head + ("the gradient noise is small against the gradient: a batch of one or two examples would "
                       "need about as many steps as this one, so each example buys almost nothing but its share "
                       "of the step; take a smaller batch and more steps, or a larger learning rate.")
    return head + (f"the batch is above the critical batch size: a smaller one (down to ~{n}) would need about "
                   "as many steps and fewer examples.")
