"""Per-example gradient norms from what a layer's forward and output gradient give, for the noise
probe (:class:`lightning_gradhooks.core.noise.NoiseProbe`, whose docstring says which layers and
forms, and why): :class:`Source` is one such layer, :class:`Seen` what one armed step saw of it,
:func:`pairs_total` the Linear layers on 2-D inputs reduced together at collect."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.core.stats import Scratch
from lightning_gradhooks.summary.noise import SOURCE_NAMES

__all__ = ["SKETCH_VECTORS", "SOURCE_TYPES", "Seen", "Source", "float32", "linear_form", "pairs_total"]

#: Random vectors of the sketch of a per-example norm on a 3-D (sequence) input of a Linear.
SKETCH_VECTORS = 4
#: Per-example sources: exact types only (a subclass may compute more in its ``forward``), and
#: those types under FSDP2's ``fully_shard``, which adds no computation.
SOURCE_TYPES = tuple(getattr(nn, name) for name in SOURCE_NAMES)


def float32(tensor: Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``tensor``'s device: the probe's products stay in the float32 it casts to
    (under fp16 autocast the forward's would be float16 and meet a float32 gradient)."""
    kind = tensor.device.type
    return torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else contextlib.nullcontext()


@torch.no_grad()
def pairs_total(pairs: list[tuple[tuple, Sequence]], scratch: Scratch) -> Tensor | None:
    """``Σ_l Σ_i ‖x_i‖²‖δ_i‖² (weight) + ‖δ_i‖² (bias)`` over Linear layers on 2-D inputs, from
    each layer's layout (:attr:`Source.layout`) and ``[input, output gradient]``, with
    a few ops per group of layers of one layout and device (500 layers of one width: about ten
    ops). Each group's two stacks go into float32 buffers of ``scratch``, reused from one logged
    step to the next (500 × 32 × 64 on this CPU: 1.4 against 5.5 ms for the two stacks into fresh
    tensors, which page-fault); the stack casts to float32 as it copies."""
    groups: dict[tuple, list[list]] = {}
    for layout, pair in pairs:
        groups.setdefault((layout, pair[0].device), []).append(pair)
    total = None
    for i, ((layout, device), members) in enumerate(groups.items()):
        features_in, features_out, weight, bias = layout
        x = _stacked(scratch, f"noise {i} inputs", [m[0] for m in members], features_in, device)  # (layers, B, in)
        d = _stacked(scratch, f"noise {i} output gradients", [m[1] for m in members], features_out, device)
        # one reduction pass each (vecdot would multiply, then sum)
        xs, ds = torch.linalg.vector_norm(x, dim=-1).square(), torch.linalg.vector_norm(d, dim=-1).square()
        part = (ds * (xs * weight + bias)).sum()
        total = part if total is None else total + part.to(total.device)
    return total


def _stacked(scratch: Scratch, name: str, tensors: list[Tensor], features: int, device: torch.device) -> Tensor:
    """``torch.stack(tensors)`` of ``(examples, features)`` tensors, into a float32 buffer of ``scratch``."""
    shape = (len(tensors), tensors[0].shape[0], features)
    return torch.stack(tensors, out=scratch.get(name, math.prod(shape), torch.float32, device).view(shape))


def linear_form(positions: int, features_in: int, features_out: int, sketch: bool = True) -> str | None:
    """The cheapest way to the per-example ``‖Σ_t δ_t x_tᵀ‖²`` of a Linear over a sequence, by
    multiply-adds per example: each example's weight gradient (``T·in·out``), the Gram form
    ``Σ_{t,s} (δ_t·δ_s)(x_t·x_s)`` (``T²·(in+out)``), both exact, or the sketch over
    :data:`SKETCH_VECTORS` random vectors (``2·k·T·(in+out)``), unbiased; exact at equal cost.
    Without ``sketch`` (a model with normalisation layers, which give the estimate instead), None
    where an exact form costs more than the sketch would: the layer is left out."""
    t, width = positions, features_in + features_out
    costs = {"gram": t * t * width, "direct": t * features_in * features_out, "sketch": 2 * SKETCH_VECTORS * t * width}
    form = min(costs, key=lambda form: (costs[form], form == "sketch"))
    return form if sketch or form != "sketch" else None


class Source:
    """One per-example source layer, as it is for every step; what one armed step's forward and
    output gradient give is a :class:`Seen`, made at the layer's first forward of the step.

    Under sharding (FSDP2's ``fully_shard``, tensor parallelism), it sees this rank's local
    tensors: its own examples (FSDP2), or this rank's piece of each example's gradient (tensor
    parallelism); a parameter that is a replica on this rank (a tensor-parallel bias at mesh
    coordinate 1) is left to the rank at coordinate 0, as the parameter's statistics are.
    """

    def __init__(self, module: nn.Module, kind: type) -> None:
        self.module, self.kind = module, kind
        self.weight = module.weight is not None and module.weight.requires_grad
        bias = getattr(module, "bias", None)
        self.bias = bias is not None and bias.requires_grad
        self.parameters = [p for p, on in ((module.weight, self.weight), (bias, self.bias)) if on]
        #: Whether (weight, bias) count: what a Linear on a 2-D input's ``[input, output gradient]`` gives.
        self.counted = (self.weight, self.bias)
        #: A Linear's ``(in, out, weight counted, bias counted)``: the layers on 2-D inputs whose
        #: layouts (and devices) are alike are reduced together (:func:`pairs_total`).
        self.layout = (getattr(module, "in_features", 0), getattr(module, "out_features", 0), *self.counted)
        self.elements = sum(p.numel() for p in self.parameters)
        self._generator: dict[torch.device, torch.Generator] = {}  # the sketch's, not the user's stream
        #: Whether the model has sharded (DTensor) parameters: its tensors may be DTensors.
        self.sharded = False
        #: Whether a Linear over a sequence may take the sketch (False: the model's normalisation
        #: layers give the estimate, and such a Linear is left out where no exact form is cheaper).
        self.sketch = True

    def seen(self, args: tuple, output: object, step: dict[Source, Seen | list | None]
             ) -> Callable[[Tensor], None] | None:
        """Take in one forward of the module into ``step`` (the armed step's layers: a
        :class:`Seen`, a Linear on a 2-D input's ``[input, output gradient]``, or None
        where the layer gives nothing this step); returns what to call with its output's gradient
        (None: nothing is needed from this call)."""
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return None
        if self in step:  # called twice: its examples' gradients are sums over calls; left out
            step[self] = None
            return None
        x = args[0] if args and isinstance(args[0], Tensor) else None
        dims = -1 if x is None else x.dim()
        if dims < 2 or x.shape[0] < 1:
            step[self] = None
            return None
        if dims == 2 and self.kind is nn.Linear and not self.sharded:
            # [input, output gradient]: no op here, reduced with every such layer's at collect (a
            # few ops in all); detached: the graph is not held past backward (held, its nodes are
            # freed at collect instead: no saving, measured)
            step[self] = pair = [x.detach()]
            return pair.append
        seen = step[self] = Seen(self)
        if self.sharded:
            if _shards.is_dtensor(x):  # tensor parallel: the ranks of its mesh hold the same examples
                seen.owns_examples = _shards.owns_examples(x)
                x = x.to_local()
            m = self.module
            seen.counted = (self.weight and _shards.reports(m.weight), self.bias and _shards.reports(m.bias))
        seen.examples = x.shape[0]
        if self.kind is nn.Linear and x.dim() == 2:  # sharded: this rank's local tensors
            return functools.partial(seen.paired, x)
        with float32(x):
            saved = self._saved(x.detach())
        return None if saved is None else functools.partial(self._backward, seen, saved)

    def _vectors(self, examples: int, features: int, device: torch.device) -> Tensor:
        """Gaussian vectors of the sketch, ``(examples, features, SKETCH_VECTORS)``: fresh ones for
        each example and layer, so that their errors average out over the batch."""
        generator = self._generator.get(device)
        if generator is None:
            generator = self._generator[device] = torch.Generator(device=device).manual_seed(0)
        return torch.randn(examples, features, SKETCH_VECTORS, generator=generator, device=device)

    def _saved(self, x: Tensor) -> tuple | None:
        """What the backward needs of the input, as small as it can be (None: nothing, a sequence
        Linear left to the normalisation layers)."""
        m = self.module
        if self.kind is nn.Linear:
            x = x.flatten(1, -2).float()  # (B, positions, in)
            form = linear_form(x.shape[1], x.shape[2], m.out_features, self.sketch)
            if form == "sketch":
                return ("sketch", torch.bmm(x, self._vectors(x.shape[0], x.shape[-1], x.device)))  # (B, positions, k)
            return None if form is None else (form, x)
        if self.kind is nn.LayerNorm:
            return ("normed", F.layer_norm(x.float(), m.normalized_shape, eps=m.eps), len(m.normalized_shape))
        if self.kind is nn.RMSNorm:
            return ("normed", F.rms_norm(x.float(), m.normalized_shape, eps=m.eps), len(m.normalized_shape))
        # GroupNorm: (B, C, *) normalised per example and group; per-channel weight and bias
        return ("channels", F.group_norm(x.float(), m.num_groups, eps=m.eps))

    def _backward(self, seen: Seen, saved: tuple, grad: Tensor) -> None:
        seen.grads += 1
        if self.sharded and _shards.is_dtensor(grad):
            grad = grad.to_local()
        with float32(grad):
            seen.total = self._total(grad.detach().float(), saved, seen.counted)

    @staticmethod
    def _total(d: Tensor, saved: tuple, counted: tuple[bool, bool]) -> Tensor:
        """The sum over the examples of their squared gradient norms, from the output's gradient ``d``."""
        how, b = saved[0], d.shape[0]
        weight, bias = counted
        total = d.new_zeros(())
        if how in ("sketch", "gram", "direct"):  # weight: ‖Σ_t δ_t x_tᵀ‖² per example; bias: ‖Σ_t δ_t‖²
            d = d.flatten(1, -2)  # (B, positions, out)
            if weight and how == "sketch":  # E‖Σ_t δ_t (x_t·v)‖² over Gaussian v
                total = torch.bmm(saved[1].transpose(1, 2), d).square().sum() / SKETCH_VECTORS
            elif weight and how == "gram":
                a = saved[1]
                total = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum()
            elif weight:
                total = torch.bmm(saved[1].transpose(1, 2), d).square().sum()  # each example's xᵀδ
            if bias:
                total = total + d.sum(1).square().sum()
        elif how == "normed":  # weight: Σ over positions of δ·x̂, per example; bias: Σ δ
            shape = (b, -1, math.prod(d.shape[d.dim() - saved[2]:]))
            if weight:
                total = (d * saved[1]).reshape(shape).sum(1).square().sum()
            if bias:
                total = total + d.reshape(shape).sum(1).square().sum()
        else:  # channels (GroupNorm): sums over the positions of each channel
            shape = (b, d.shape[1], -1)
            if weight:
                total = (d * saved[1]).reshape(shape).sum(2).square().sum()
            if bias:
                total = total + d.reshape(shape).sum(2).square().sum()
        return total


class Seen:
    """What one armed step saw of a source layer called once: its output gradients, its examples,
    and the sum of its examples' squared gradient norms (a device tensor), or, for a Linear on a
    2-D input under sharding, its local input and output gradient. A hook of a step already
    collected writes into a ``Seen`` the probe no longer holds."""

    __slots__ = ("source", "grads", "examples", "owns_examples", "counted", "total", "pair")

    def __init__(self, source: Source) -> None:
        self.source = source
        self.grads, self.examples = 0, 0
        #: Whether this rank counts its examples (False: a replica of them at another mesh coordinate).
        self.owns_examples = True
        #: Whether this rank counts (weight, bias): not where it holds a replica of another rank's piece.
        self.counted = source.counted
        self.total: Tensor | None = None
        #: The local ``(layout, (input, output gradient))`` (see :func:`pairs_total`).
        self.pair: tuple[tuple, tuple[Tensor, Tensor]] | None = None

    def paired(self, x: Tensor, grad: Tensor) -> None:
        self.grads += 1
        if self.source.sharded and _shards.is_dtensor(grad):
            grad = grad.to_local()
        self.pair = ((x.shape[1], grad.shape[1], *self.counted), (x, grad))
