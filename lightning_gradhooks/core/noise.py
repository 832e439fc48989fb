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
  ``T`` positions, the cheapest of three per layer, by multiply-adds: that gradient itself
  (``T·in·out``), the Gram form ``Σ_{t,s} (δ_t·δ_s)(x_t·x_s)`` (``T²·(in+out)``), both exact, or an
  unbiased random sketch ``E‖Σ_t δ_t (x_t·v)‖²`` over 4 Gaussian vectors ``v``
  (``8·T·(in+out)``, from a generator of the layer's own, fresh for each example), so that the
  cost never grows with ``T·width²``), ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.GroupNorm``
  (exact: the per-example sums of ``δ·x̂`` and ``δ``). In a model with normalisation layers, a
  Linear over a sequence whose exact forms cost more than the sketch is left out: the
  normalisation layers' per-example norms predict the whole model's noise scale (Gray et al.
  2024, "Normalization layer per-example gradients are sufficient to predict gradient noise
  scale in transformers"), at a few element-wise passes over their inputs. The estimate covers
  the parameters of the layers used only (:attr:`NoiseSample.coverage`); other layers
  (convolutions, embeddings, attention's packed projections, batch norm, whose examples are
  coupled) are left out. A layer called
  more than once in a step, or whose parameter another module shares, is left out too.
  On a monitor's logged step, the monitor's own forward and ``grad_output`` hooks feed these
  layers (:meth:`NoiseProbe.saw`): one set of hooks per module; the probe hooks only the layers
  the monitor leaves out, and ``|G_B|²`` is summed from the monitor's statistics of the
  parameter gradients (:func:`gradient_squares`).

Sharded parameters (FSDP2's ``fully_shard``, tensor parallelism: ``DTensor`` parameters): each
rank's per-example norms, from the local tensors its layers see before the reduce-scatter (its
own examples under FSDP2; its piece of every example's gradient under tensor parallelism, where a
replicated bias counts on the rank at mesh coordinate 0 only), against the reduced gradient's
pieces; the probe's one ``all_reduce`` sums both over the ranks. Gradient accumulation under
sharding gives no estimate (each micro-batch's gradient is reduce-scattered before it is read).

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


import functools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.summary.checks import check_int
from lightning_gradhooks.core.per_example import SOURCE_TYPES, Seen, Source, pairs_total
from lightning_gradhooks.summary.noise import NoiseSample
from lightning_gradhooks.summary.records import GradientRecord, Kind
from lightning_gradhooks.core.stats import Scratch

def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _squares(tensors: Iterable[Tensor | None]) -> Tensor | None:
    """The sum of squares of the tensors, in float32, on the first one's device; None if none.
    One ``_foreach_norm`` for all of them: no Python per tensor (``get_total_norm`` loops over
    them in Python on the CPU: 1000 gradients, 9 against 4 ms)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    device = present[0].device
    norms = torch._foreach_norm(present, 2, dtype=torch.float32)
    if any(t.device != device for t in present):
        norms = [n.to(device) for n in norms]
    return torch.stack(norms).square().sum()


def gradient_squares(record: GradientRecord) -> dict[int, float]:
    """The squared norms of the parameter gradients a monitor's record holds (its ``norm``
    statistic; ``inf`` where a gradient is not finite), by ``id`` of the parameter: what
    :meth:`NoiseProbe.collect` takes as ``squares``. Sharded parameters' pieces are left out."""
    # the kind bound once: an enum member read from its class costs 0.2 µs in Python 3.11, per entry
    params, sharded, param_grad = record.parameters, set(record.sharded), Kind.PARAM_GRAD
    return {id(params[e.name]): math.inf if e.stats.nonfinite else e.stats.norm * e.stats.norm
            for e in record.entries if e.kind is param_grad and e.name in params and e.name not in sharded}


def _known_squares(params: list[Tensor], squares: Mapping[int, float] | None) -> float:
    """``Σ |∇p|²`` over ``params``: from ``squares`` (by ``id``) where it has every one whose
    gradient is there, else from the gradients (0 where none has one)."""
    if squares is not None:  # the parameters it lacks (none, commonly: no `.grad` read) have no gradient
        values = [squares.get(id(p)) for p in params]
        if all(p.grad is None for p, value in zip(params, values) if value is None):
            return math.fsum([value for value in values if value is not None])
    total = _squares(p.grad for p in params if p.grad is not None)
    return 0.0 if total is None else float(total)


class NoiseProbe:
    """Measures the raw material of the gradient noise scale on armed steps (see the module's
    docstring for where the two batches come from).

    Nothing of it runs until :meth:`arm`; :meth:`collect` and :meth:`disarm` remove every hook
    it put in (``removable handles`` of torch's public hook APIs), so a step that is not armed
    runs exactly as without it. :class:`~lightning_gradhooks.GradientMonitor` makes one
    (``noise_scale=True``, the default) and arms, collects and removes it with itself; its
    hooks feed the per-example layers it watches (``fed``), so the probe hooks only the others.

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
        self._model, self._skip = model, frozenset(skip)
        # The layers and parameters, looked up once at the first arm (a deep model's `parameters()`
        # takes ms): after `fully_shard` or `parallelize_module` have made their DTensor parameters.
        self._sources: list[Source] = []
        self._parameters: list[Tensor] = []
        self._sharded = False
        self._looked_up = False
        self._handles: list[RemovableHandle] = []
        self._fed: dict[int, Source] = {}  # armed: the sources another owner's hooks feed (`saw`)
        # The armed step's sources that ran, in the order they ran: a fresh dict each step, so a
        # hook of an earlier step (a graph kept past its collect) writes where nothing reads.
        self._step: dict[Source, Seen | list | None] = {}
        self._armed = False
        self._batch: int | None = None
        self._accumulation = 1
        self._small: Tensor | None = None  # the sum of each backward's squared gradient norm
        self._backwards = 0  # ... over this many backward passes (micro-batches)
        self._scratch = Scratch()  # the buffers of pairs_total's stacks, reused between logged steps
        #: The ``all_reduce`` calls made so far (one per collected step with several ranks).
        self.collectives = 0

    def _look_up(self) -> None:
        """Find the per-example source layers and the trainable parameters, once."""
        if self._looked_up:
            return
        self._looked_up = True
        owners: dict[int, int] = {}
        for module in self._model.modules():
            for p in module._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        sources = [
            Source(m, _shards.unsharded_type(m)) for m in self._model.modules()
            if _shards.unsharded_type(m) in SOURCE_TYPES and id(m) not in self._skip
            and getattr(m, "weight", None) is not None
            and all(owners[id(p)] == 1 for p in m._parameters.values() if p is not None)
        ]
        self._sources = [s for s in sources if s.parameters]
        self._parameters = [p for p in self._model.parameters() if p.requires_grad]
        self._elements = sum(p.numel() for p in self._parameters)
        # FSDP2 or tensor parallelism: per-example norms on each rank's local tensors (the local
        # gradient before the reduce-scatter is no leaf the hooks of the parameters can see)
        self._sharded = any(_shards.is_dtensor(p) for p in self._parameters)
        # A model with normalisation layers: they give the estimate (Gray et al. 2024), and a
        # Linear over a sequence is covered only where an exact form costs no more than the sketch.
        sketch = not any(s.kind is not nn.Linear for s in self._sources)
        for source in self._sources:
            source.sharded, source.sketch = self._sharded, sketch

    @property
    def sources(self) -> list[str]:
        """The per-example source layers, by qualified name (looked up at the first arm)."""
        self._look_up()
        names = {id(m): n for n, m in self._model.named_modules()}
        return [names[id(s.module)] for s in self._sources]

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def scratch_bytes(self) -> int:
        """Memory kept between logged steps to stack the next one's per-example inputs and output
        gradients into (buffers of at most :data:`~lightning_gradhooks.core.stats.SCRATCH_KEPT`
        elements each); freed by :meth:`remove`."""
        return self._scratch.nbytes

    @property
    def hooks(self) -> int:
        """How many hooks of the probe are in the model now (0 when not armed)."""
        return len(self._handles)

    def arm(self, batch_size: int | None = None, accumulation: int = 1, fed: Collection[int] = ()) -> None:
        """Put the hooks in for the coming step; what an armed probe measured is dropped.

        Args:
            batch_size: examples in each micro-batch on this rank (needed with accumulation or
                several ranks; the per-example layers see it themselves).
            accumulation: micro-batches (backward passes) accumulated into the step's gradient.
            fed: ids of modules whose forward hook of another owner (the monitor's) passes each
                forward to :meth:`saw` and calls what it returns with the output's gradient: the
                probe puts no hook of its own on them.
        """
        check_int("batch_size", batch_size, allow_none=True)
        check_int("accumulation", accumulation)
        self.disarm()
        self._look_up()
        self._armed = True
        self._batch, self._accumulation = batch_size, accumulation
        self._small, self._backwards = None, 0
        if (accumulation > 1 or _world() > 1) and not self._sharded:
            params = self._parameters
            if params:
                self._handles.append(register_multi_grad_hook(params, self._each_backward, mode="all"))
            return
        for source in self._sources:
            if id(source.module) in fed:
                self._fed[id(source.module)] = source
            else:
                self._handles.append(source.module.register_forward_hook(functools.partial(self._forward, source)))

    def saw(self, module: nn.Module, args: tuple, output: object) -> Callable[[Tensor], None] | None:
        """One forward of a module the caller's hook feeds (``fed`` when arming): returns what to
        call with the gradient of ``output`` in backward; None when the probe needs nothing of it
        (not a source, not armed for per-example norms, a second call)."""
        source = self._fed.get(id(module))
        return None if source is None else source.seen(args, output, self._step)

    def _forward(self, source: Source, module: nn.Module, args: tuple, output: object) -> None:
        """The probe's own forward hook (a module no monitor hook feeds): a tensor hook on the output."""
        backward = source.seen(args, output, self._step)
        if backward is not None:
            output.register_hook(backward)

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
        self._fed, self._step = {}, {}
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._small, self._backwards = None, 0

    def remove(self) -> None:
        """:meth:`disarm`, and free the buffers kept between logged steps."""
        self.disarm()
        self._scratch = Scratch()

    def collect(self, parameters: Iterable[Tensor] | None = None,
                squares: Mapping[int, float] | None = None) -> NoiseSample | None:
        """The step's :class:`NoiseSample`, and disarm; None when not armed.

        Call it where the optimizer is about to step (after any gradient clipping's unscale,
        before ``zero_grad``), on every rank of a data-parallel job (one ``all_reduce``).

        Args:
            parameters: the parameters of the optimizer about to step; default: all of the
                model's trainable parameters.
            squares: squared norms of the parameters' gradients that the caller has already
                computed (the monitor's statistics), by ``id`` of the parameter: ``|G_B|²`` is
                summed from them where every parameter it needs is there (not under sharding),
                instead of reading the gradients again.
        """
        if not self._armed:
            return None
        try:
            params = self._parameters if parameters is None else [p for p in parameters if p.requires_grad]
            if not params:  # a backward that no optimizer step followed (the end of an epoch)
                return None
            world, k = _world(), self._accumulation
            if self._sharded:
                return NoiseSample.none(8, "per_example") if k > 1 else self._per_example(params, world)
            if k > 1 or world > 1:
                return self._two_batches(params, world, k, squares)
            return self._per_example(params, squares=squares)
        finally:
            self.disarm()

    def _two_batches(self, params: list[Tensor], world: int, k: int, squares: Mapping[int, float] | None
                     ) -> NoiseSample:
        source = "+".join(s for s, on in (("accumulation", k > 1), ("data_parallel", world > 1)) if on)
        if self._batch is None:  # before the collective: every rank decides alike
            return NoiseSample.none(0, source)
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
            return replace(NoiseSample.none(1, source, big), nonfinite_ranks=bad)
        if not all(reached):
            return NoiseSample.none(2, source, big)
        small_sq = sum(values) / world * k * k  # the micro-batch's loss was divided by k
        big_sq = _known_squares(params, squares)
        return self._checked(NoiseSample(small_sq, big_sq, b, big, source))

    def _per_example(self, params: list[Tensor], world: int = 1, squares: Mapping[int, float] | None = None
                     ) -> NoiseSample:
        """From per-example norms: ``b = 1``, ``B`` the batch. Sharded (``world`` ranks): each rank's
        own examples, or its piece of each, summed over the ranks in the one collective."""
        if not self._sources:
            return NoiseSample.none(3, "per_example")
        used, pairs, batch, why = self._usable(params)
        sources = [source for source, _ in pairs] + [s.source for s in used]
        total = big_sq = None
        if why is None:
            total = pairs_total([(source.layout, pair) for source, pair in pairs]
                                 + [s.pair for s in used if s.pair is not None], self._scratch)
            self._scratch.trim()
            totals = [s.total for s in used if s.total is not None] + ([total] if total is not None else [])
            total = sum(t.to(totals[0].device) for t in totals[1:]) + totals[0]
            covered = [p for source in sources for p in source.parameters]
            if self._sharded:
                pieces = [_shards.local_piece(p.grad) if p.grad is not None else (None, None) for p in covered]
                if any(reason == _shards.PARTIAL for _, reason in pieces):
                    why = 9
                big_sq = _squares(piece for piece, _ in pieces)
            else:
                big_sq = _known_squares(covered, squares)
        all_elements = self._elements if params is self._parameters else sum(p.numel() for p in params)
        coverage = sum(source.elements for source in sources) / all_elements if all_elements else 0.0
        if self._sharded and world > 1:
            return self._pooled(total, big_sq, batch, all(s.owns_examples for s in used) if sources else False,
                                why, coverage, world)
        if why is not None:
            return NoiseSample.none(why, "per_example", batch if why in (5, 6) else math.nan)
        # Example i's share of .grad is c_i; its gradient of the mean loss is B c_i, so the mean
        # over examples of |G_1|² is B Σ|c_i|².
        return self._checked(NoiseSample(batch * float(total), big_sq, 1, batch, "per_example", coverage))

    def _usable(self, params: list[Tensor]
                ) -> tuple[list[Seen], list[tuple[Source, list]], int, int | None]:
        """The sources that give this step's per-example norms: their records, and the Linear
        layers on 2-D inputs with their ``[input, output gradient]`` (kept apart: no object per
        layer); the batch, and why none do (an index into :data:`REASONS`)."""
        wanted = None if params is self._parameters else {id(p) for p in params}
        step = self._step.items() if wanted is None else [
            (source, seen) for source, seen in self._step.items() if all(id(p) in wanted for p in source.parameters)]
        pairs = [(source, seen) for source, seen in step if type(seen) is list and len(seen) == 2]
        used = [seen for _, seen in step if type(seen) is Seen and seen.grads == 1
                and (seen.total is not None or seen.pair is not None)]
        if not used and not pairs:
            return [], [], self._batch or 0, 4
        batch = self._batch or max([s.examples for s in used] + [pair[0].shape[0] for _, pair in pairs])
        used = [s for s in used if s.examples == batch]
        pairs = [(source, pair) for source, pair in pairs if pair[0].shape[0] == batch]
        if not used and not pairs:
            return [], [], batch, 5
        return used, pairs, batch, 6 if batch < 2 else None

    def _pooled(self, total: Tensor | None, big_sq: Tensor | None, batch: int, owns: bool, why: int | None,
                coverage: float, world: int) -> NoiseSample:
        """The sharded estimate: one ``all_reduce`` of a slot per rank for each of its examples'
        ``b² Σ|c_i|²``, its pieces' ``|G_B|²``, the examples it owns and whether it has them."""
        device = total.device if total is not None else torch.device("cpu")
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        slots = torch.zeros(4, world, dtype=dtype, device=device)
        rank = dist.get_rank()
        if why is None:
            slots[0, rank] = total.to(dtype) * batch * batch
            if big_sq is not None:
                slots[1, rank] = big_sq.to(device, dtype)
            slots[2, rank], slots[3, rank] = float(batch) if owns else 0.0, 1.0
        dist.all_reduce(slots)  # the one collective
        self.collectives += 1
        small, big, examples, usable = slots.tolist()
        big_batch = sum(examples)
        bad = tuple(r for r in range(world) if not (math.isfinite(small[r]) and math.isfinite(big[r])))
        if bad:
            return replace(NoiseSample.none(1, "per_example", big_batch), nonfinite_ranks=bad)
        if not all(usable):
            return NoiseSample.none(10 if why is None else why, "per_example", batch if why in (5, 6) else math.nan)
        return self._checked(NoiseSample(sum(small) / big_batch, sum(big), 1, big_batch, "per_example", coverage))

    @staticmethod
    def _checked(sample: NoiseSample) -> NoiseSample:
        if not (math.isfinite(sample.small_sq) and math.isfinite(sample.big_sq)):
            return NoiseSample.none(1, sample.source, sample.big)
        if sample.small_sq == 0 and sample.big_sq == 0:
            return NoiseSample.none(7, sample.source, sample.big)
        return sample
