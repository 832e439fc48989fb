"""The gradient noise scale: how big a batch is worth it, measured on logged steps.

The *simple noise scale* of McCandlish et al. (2018, "An Empirical Model of Large-Batch
Training") is ``B_simple = tr(Σ) / |G|²``: ``G`` the true gradient (of the mean loss), ``Σ`` the
covariance of per-example gradients. It predicts the critical batch size: below it, a bigger
batch cuts the number of steps almost in proportion; above it, the gains shrink.

Both are estimated from the squared norms of the gradient of a small batch (``b`` examples) and
of a big one (``B``), which are unbiased: ``E|G_b|² = |G|² + tr(Σ)/b``, so (their appendix A)::

    |G|²  ≈ (B |G_B|² - b |G_b|²) / (B - b)
    tr(Σ) ≈ (|G_b|² - |G_B|²) / (1/b - 1/B)

:class:`NoiseProbe` finds the two batches in what the step already computes, with no extra
backward pass and at most one collective:

- gradient accumulation (``accumulation >= 2``) or data parallelism (``torch.distributed``
  with two or more ranks): the gradient of each micro-batch's backward on this rank
  (``b`` = the micro-batch; the mean of their squared norms, over the micro-batches) against
  the gradient the optimizer is about to step with (``B`` = micro-batch × accumulation × ranks).
  Each backward's gradient is read by one ``torch.autograd.graph.register_multi_grad_hook`` on
  the parameters, which sees each parameter's gradient of that backward before it is
  accumulated into ``.grad`` and before ``DistributedDataParallel`` all-reduces it. With
  several ranks, one ``all_reduce`` of one number averages the ranks' small-batch norms.
- neither: per-example gradient norms (``b`` = 1, ``B`` = the batch) from what forward hooks
  and tensor hooks on some layers see: ``nn.Linear`` (on a 2-D input ``‖∇W_i‖² = ‖x_i‖²‖δ_i‖²``,
  exact; on a 3-D or bigger input, where example ``i``'s gradient ``Σ_t δ_t x_tᵀ`` sums over
  positions, an unbiased random sketch ``E‖Σ_t δ_t (x_t·v)‖²`` over 4 Gaussian vectors ``v``,
  from a generator of its own, fresh for each example), ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.GroupNorm`` (exact: the
  per-example sums of ``δ·x̂`` and ``δ``). The estimate covers the parameters of those layers
  only (:attr:`NoiseSample.coverage`); other layers (convolutions, embeddings, attention's
  packed projections, batch norm, whose examples are coupled) are left out. A layer called
  more than once in a step, or whose parameter another module shares, is left out too.

Where none applies, the sample says why (:attr:`NoiseSample.reason`): a step of one example,
no per-example layer, gradients that are all zero, an unknown batch size.

Loss scaling: the small-batch gradient is normalised as a gradient of the mean loss over its
``b`` examples, assuming the step's loss is the mean over the whole batch (Lightning's
accumulation divides each micro-batch's loss by ``accumulation``; ``DistributedDataParallel``
averages the ranks). A constant factor common to every gradient (a sum instead of a mean, a
loss that is not divided by the accumulation) leaves ``B_simple`` unchanged; only the
magnitudes of ``|G|²`` and ``tr(Σ)`` then carry that factor squared. Under a mixed-precision
gradient scaler the hooks see scaled gradients: :meth:`NoiseSample.unscaled` divides them.

Single estimates are very noisy (``|G|²`` can even come out negative when noise dominates), so
:class:`NoiseScale` smooths ``|G|²`` and ``tr(Σ)`` separately, with bias-corrected exponential
moving averages, and gives the ratio of the smoothed values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from lightning_gradhooks._checks import check_int

#: Random vectors of the sketch of a per-example norm on a 3-D (sequence) input of a Linear.
SKETCH_VECTORS = 4
#: Per-example sources: exact types only (a subclass may compute more in its ``forward``).
SOURCE_TYPES = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


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
    def none(cls, reason: str, source: str = "", big: float = math.nan) -> NoiseSample:
        """A sample that holds no estimate, saying why."""
        return cls(math.nan, math.nan, math.nan, big, source, 0.0, reason)

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
        """What the compact summary holds for this step: the unsmoothed estimates and batches."""
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
    return "∞" if math.isinf(n) else f"{n:,.0f}"


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
                   f"{', '.join(t.__name__ for t in SOURCE_TYPES)} layers): the noise scale of those")
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
    return head + (f"the batch is above the critical batch size: a smaller one (down to ~{n}) would need about "
                   "as many steps and fewer examples.")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _squares(tensors: Iterable[Tensor | None]) -> Tensor | None:
    """The sum of squares of the tensors (float32 or wider), on the first one's device; None if none."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    return torch.nn.utils.get_total_norm(present, 2.0, foreach=None).float().square()


@torch.no_grad()
def _pairs_total(sources: list[_Source]) -> Tensor | None:
    """``Σ_l Σ_i ‖x_i‖²‖δ_i‖² (weight) + ‖δ_i‖² (bias)`` over Linear layers on 2-D inputs, with a
    few ops per group of layers of one shape (500 layers of one width: about ten ops)."""
    groups: dict[tuple, list[_Source]] = {}
    for s in sources:
        x, d = s.pair
        groups.setdefault((x.shape, d.shape, x.dtype, d.dtype, x.device), []).append(s)
    total = None
    for members in groups.values():
        x = torch.stack([s.pair[0] for s in members]).float()  # (layers, B, in)
        d = torch.stack([s.pair[1] for s in members]).float()  # (layers, B, out)
        # one reduction pass each (vecdot would multiply, then sum)
        xs, ds = torch.linalg.vector_norm(x, dim=-1).square(), torch.linalg.vector_norm(d, dim=-1).square()
        flags = {(s.weight, s.bias) for s in members}
        if len(flags) == 1:  # the common case: every layer alike
            weight, bias = flags.pop()
            part = (ds * (xs * weight + bias)).sum()
        else:
            w = torch.tensor([[float(s.weight)] for s in members], device=x.device)
            b = torch.tensor([[float(s.bias)] for s in members], device=x.device)
            part = (ds * (xs * w + b)).sum()
        total = part if total is None else total + part.to(total.device)
    return total


class _Source:
    """One per-example source layer: its forward hook, its output's tensor hook and the sum of
    its examples' squared gradient norms (a device tensor) on the armed step."""

    def __init__(self, probe: NoiseProbe, module: nn.Module) -> None:
        self.probe, self.module = probe, module
        self.weight = module.weight is not None and module.weight.requires_grad
        bias = getattr(module, "bias", None)
        self.bias = bias is not None and bias.requires_grad
        self.parameters = [p for p, on in ((module.weight, self.weight), (bias, self.bias)) if on]
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.grads = 0
        self.examples = 0
        self.total: Tensor | None = None
        # a Linear on a 2-D input keeps its input and output gradient (small: a row per example)
        # for the probe to reduce every such layer at once in `collect`: a few ops in all
        self.pair: tuple[Tensor, Tensor] | None = None

    def forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        self.calls += 1
        if self.calls == 1:
            self.probe._touched.append(self)
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if self.calls > 1 or x is None or x.dim() < 2 or x.shape[0] < 1:
            return  # called twice: its examples' gradients are sums over calls; left out
        self.examples = x.shape[0]
        if type(module) is nn.Linear and x.dim() == 2:
            saved = ("pair",)  # no op here; reduced with the others at collect
        else:
            saved = self._saved(x.detach())
        armed = self.probe._armings
        # The tensor hook goes with the graph; a backward after disarming finds it stale.
        output.register_hook(lambda grad: self._backward(grad, saved, x) if self.probe._armings == armed else None)

    def _saved(self, x: Tensor) -> tuple:
        """What the backward needs of the input, as small as it can be."""
        m = self.module
        if type(m) is nn.Linear:
            x = x.flatten(1, -2).float()  # (B, positions, in)
            return ("sketch", torch.bmm(x, self.probe._vectors(x.shape[0], x.shape[-1], x.device)))  # (B, positions, k)
        if type(m) is nn.LayerNorm:
            return ("normed", F.layer_norm(x.float(), m.normalized_shape, eps=m.eps), len(m.normalized_shape))
        if type(m) is nn.RMSNorm:
            return ("normed", F.rms_norm(x.float(), m.normalized_shape, eps=m.eps), len(m.normalized_shape))
        # GroupNorm: (B, C, *) normalised per example and group; per-channel weight and bias
        return ("channels", F.group_norm(x.float(), m.num_groups, eps=m.eps))

    def _backward(self, grad: Tensor, saved: tuple, x: Tensor) -> None:
        self.grads += 1
        if saved[0] == "pair":
            self.pair = (x, grad)
            return
        how, d = saved[0], grad.detach().float()
        b = d.shape[0]
        if how == "sketch":  # E‖Σ_t δ_t (x_t·v)‖² = ‖Σ_t δ_t x_tᵀ‖²; bias: ‖Σ_t δ_t‖², exact
            d = d.flatten(1, -2)  # (B, positions, out)
            total = d.new_zeros(())
            if self.weight:
                total = torch.einsum("bto,btk->bok", d, saved[1]).square().sum() / SKETCH_VECTORS
            if self.bias:
                total = total + d.sum(1).square().sum()
        elif how == "normed":  # weight: Σ over positions of δ·x̂, per example; bias: Σ δ
            shape = (b, -1, math.prod(d.shape[d.dim() - saved[2]:]))
            total = d.new_zeros(())
            if self.weight:
                total = (d * saved[1]).reshape(shape).sum(1).square().sum()
            if self.bias:
                total = total + d.reshape(shape).sum(1).square().sum()
        else:  # channels (GroupNorm): sums over the positions of each channel
            shape = (b, d.shape[1], -1)
            total = d.new_zeros(())
            if self.weight:
                total = (d * saved[1]).reshape(shape).sum(2).square().sum()
            if self.bias:
                total = total + d.reshape(shape).sum(2).square().sum()
        self.total = total


class NoiseProbe:
    """Measures the raw material of the gradient noise scale on armed steps (see the module's
    docstring for where the two batches come from).

    Nothing of it runs until :meth:`arm`; :meth:`collect` and :meth:`disarm` remove every hook
    it put in (``removable handles`` of torch's public hook APIs), so a step that is not armed
    runs exactly as without it. :class:`~lightning_gradhooks.GradientMonitor` makes one
    (``noise_scale=True``, the default) and arms, collects and removes it with itself.

    Args:
        model: the module whose trainable parameters the gradients are of.
        skip: ids of modules that get no hook (modules in code compiled by ``torch.compile``,
            where a module hook would break the graph): they are no per-example source.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> probe = NoiseProbe(model)
        >>> probe.arm()
        >>> model(torch.randn(32, 4)).square().mean().backward()
        >>> sample = probe.collect()
        >>> sample.source, sample.small, sample.big
        ('per_example', 1, 32)
    """

    def __init__(self, model: nn.Module, skip: Collection[int] = ()) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"`model` expected a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        owners: dict[int, int] = {}
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        self._sources = [
            _Source(self, m) for m in model.modules()
            if type(m) in SOURCE_TYPES and id(m) not in skip and getattr(m, "weight", None) is not None
            and all(owners[id(p)] == 1 for p in m._parameters.values() if p is not None)
        ]
        self._sources = [s for s in self._sources if s.parameters]
        self._handles: list[RemovableHandle] = []
        self._touched: list[_Source] = []  # the sources that ran since arming: reset by disarm
        # The trainable parameters, looked up once (a deep model's `parameters()` takes ms).
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        self._armed = False
        self._armings = 0  # tells a hook of an earlier armed step from one of this step
        self._batch: int | None = None
        self._accumulation = 1
        self._small: Tensor | None = None  # the sum of each backward's squared gradient norm
        self._backwards = 0  # ... over this many backward passes (micro-batches)
        self._generator: dict[torch.device, torch.Generator] = {}
        #: The ``all_reduce`` calls made so far (one per collected step with several ranks).
        self.collectives = 0

    @property
    def sources(self) -> list[str]:
        """The per-example source layers, by qualified name."""
        names = {id(m): n for n, m in self._model.named_modules()}
        return [names[id(s.module)] for s in self._sources]

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def hooks(self) -> int:
        """How many hooks of the probe are in the model now (0 when not armed)."""
        return len(self._handles)

    def _vectors(self, examples: int, features: int, device: torch.device) -> Tensor:
        """Gaussian vectors of the sketch, ``(examples, features, SKETCH_VECTORS)``: fresh ones for
        each example and layer, so that their errors average out over the batch; from a generator
        of the probe's own (the user's random stream is left alone)."""
        generator = self._generator.get(device)
        if generator is None:
            generator = self._generator[device] = torch.Generator(device=device).manual_seed(0)
        return torch.randn(examples, features, SKETCH_VECTORS, generator=generator, device=device)

    def arm(self, batch_size: int | None = None, accumulation: int = 1) -> None:
        """Put the hooks in for the coming step; what an armed probe measured is dropped.

        Args:
            batch_size: examples in each micro-batch on this rank (needed with accumulation or
                several ranks; the per-example layers see it themselves).
            accumulation: micro-batches (backward passes) accumulated into the step's gradient.
        """
        check_int("batch_size", batch_size, allow_none=True)
        check_int("accumulation", accumulation)
        self.disarm()
        self._armed = True
        self._armings += 1
        self._batch, self._accumulation = batch_size, accumulation
        self._small, self._backwards = None, 0
        if accumulation > 1 or _world() > 1:
            params = self._parameters
            if params:
                self._handles.append(register_multi_grad_hook(params, self._each_backward, mode="all"))
            return
        for source in self._sources:
            self._handles.append(source.module.register_forward_hook(source.forward))

    def _each_backward(self, grads: Sequence[Tensor | None]) -> None:
        """The squared norm of one backward's gradient (one micro-batch's, on this rank), summed
        over the micro-batches: each is a small-batch sample, and their mean is less noisy."""
        squares = _squares(g.detach() for g in grads if g is not None)
        if squares is None:
            return
        self._small = squares if self._small is None else self._small + squares
        self._backwards += 1

    def disarm(self) -> None:
        """Take every hook out and drop what was measured."""
        self._armed = False
        self._armings += 1
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._small, self._backwards = None, 0
        touched, self._touched = self._touched, []
        for source in touched:
            source.reset()

    remove = disarm

    def collect(self, parameters: Iterable[Tensor] | None = None) -> NoiseSample | None:
        """The step's :class:`NoiseSample`, and disarm; None when not armed.

        Call it where the optimizer is about to step (after any gradient clipping's unscale,
        before ``zero_grad``), on every rank of a data-parallel job (one ``all_reduce``).

        Args:
            parameters: the parameters of the optimizer about to step; default: all of the
                model's trainable parameters.
        """
        if not self._armed:
            return None
        try:
            params = self._parameters if parameters is None else [p for p in parameters if p.requires_grad]
            if not params:  # a backward that no optimizer step followed (the end of an epoch)
                return None
            if any(type(p) is not nn.Parameter and type(p) is not Tensor for p in params):
                return NoiseSample.none("sharded parameters (DTensor) are not supported")
            world, k = _world(), self._accumulation
            if k > 1 or world > 1:
                return self._two_batches(params, world, k)
            return self._per_example(params)
        finally:
            self.disarm()

    def _two_batches(self, params: list[Tensor], world: int, k: int) -> NoiseSample:
        source = "+".join(s for s, on in (("accumulation", k > 1), ("data_parallel", world > 1)) if on)
        if self._batch is None:  # before the collective: every rank decides alike
            return NoiseSample.none("the micro-batch size is unknown (pass `batch_size` when arming)", source)
        first = None if self._small is None else self._small / self._backwards  # the mean over micro-batches
        device = first.device if first is not None else next((p.device for p in params), torch.device("cpu"))
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        # Each rank's |G_b|² in a slot of its own (and whether a backward reached its parameters),
        # so that a NaN of one rank says which rank it is and leaves the others' slots finite.
        slots = torch.zeros(2, world, dtype=dtype, device=device)
        rank = dist.get_rank() if world > 1 else 0
        if first is not None:
            slots[0, rank], slots[1, rank] = first.to(dtype), 1.0
        if world > 1:  # the one collective
            dist.all_reduce(slots)
            self.collectives += 1
        values, reached = slots.tolist()
        b = self._batch
        big = b * k * world
        bad = tuple(r for r, v in enumerate(values) if not math.isfinite(v))
        if bad:  # before the collective: these ranks' own gradients were not finite
            return replace(NoiseSample.none("the gradients are not finite", source, big), nonfinite_ranks=bad)
        if not all(reached):
            return NoiseSample.none("no backward pass reached the parameters on a rank", source, big)
        small_sq = sum(values) / world * k * k  # the micro-batch's loss was divided by k
        big_sq = _squares(p.grad for p in params)
        big_sq = 0.0 if big_sq is None else float(big_sq)
        return self._checked(NoiseSample(small_sq, big_sq, b, big, source))

    def _per_example(self, params: list[Tensor]) -> NoiseSample:
        if not self._sources:
            return NoiseSample.none("no gradient accumulation, one process, and no layer that gives per-example "
                                    f"gradient norms ({', '.join(t.__name__ for t in SOURCE_TYPES)})",
                                    "per_example")
        wanted = {id(p) for p in params}
        used = [s for s in self._sources if s.calls == 1 and s.grads == 1 and (s.total is not None or s.pair)
                and all(id(p) in wanted for p in s.parameters)]
        batches = {s.examples for s in used}
        if not used:
            return NoiseSample.none("no per-example layer ran exactly once in the step's forward and backward",
                                    "per_example")
        batch = self._batch or max(batches)
        used = [s for s in used if s.examples == batch]
        if not used:
            return NoiseSample.none(f"no per-example layer saw the batch of {batch} along its input's first dimension",
                                    "per_example", batch)
        if batch < 2:
            return NoiseSample.none("a step of one example has no spread of per-example gradients", "per_example",
                                    batch)
        covered = [p for s in used for p in s.parameters]
        total = _pairs_total([s for s in used if s.pair is not None])
        totals = [s.total for s in used if s.total is not None] + ([total] if total is not None else [])
        total = float(sum(t.to(totals[0].device) for t in totals[1:]) + totals[0])
        big_sq = _squares(p.grad for p in covered)
        big_sq = 0.0 if big_sq is None else float(big_sq)
        all_elements = sum(p.numel() for p in params)
        coverage = sum(p.numel() for p in covered) / all_elements if all_elements else 0.0
        # Example i's share of .grad is c_i; its gradient of the mean loss is B c_i, so the mean
        # over examples of |G_1|² is B Σ|c_i|².
        return self._checked(NoiseSample(batch * total, big_sq, 1, batch, "per_example", coverage))

    @staticmethod
    def _checked(sample: NoiseSample) -> NoiseSample:
        if not (math.isfinite(sample.small_sq) and math.isfinite(sample.big_sq)):
            return NoiseSample.none("the gradients are not finite", sample.source, sample.big)
        if sample.small_sq == 0 and sample.big_sq == 0:
            return NoiseSample.none("the gradients are all zero", sample.source, sample.big)
        return sample
