"""``NonfiniteSentinel``: catch NaN/Inf gradients on every step, before the optimizer writes them
into the weights. Pure torch, opt-in (``GradHooks(catch_nonfinite=True)``).

At the default cadence 49 of 50 steps are not logged, so most NaNs are born on a step nobody
watched, and the report can only say "the weights were already non-finite". The sentinel closes
that gap for one fused reduction per step: the L2 norm of all the gradients about to be stepped
(``torch._foreach_norm``, one norm per gradient in one fused call, shared with
:class:`~lightning_gradhooks.core.spikes.StepNorms` when both are on) and one read of
that number on the host. Only when it is not finite (NaN/Inf in a gradient, or gradients whose
norm overflows float32, which ``clip_grad_norm_`` would see as infinite) does it look further:
one norm per gradient, to name the parameters. The caller then drops those gradients (the
optimizer skips parameters without a gradient, as a gradient scaler skips such a step) so the
weights stay finite.

Where the NaN was born follows from which parameters got one: backward carries a NaN from where
it appears to everything upstream, so the parameter with a non-finite gradient that is nearest
the loss (last in the module order) belongs to the module where backward first met it; when
every parameter has one, it came from the loss or the forward pass.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> sentinel = NonfiniteSentinel(model.named_parameters())
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> sentinel.check() is None
    True
    >>> model[1].weight.grad[0, 0] = float("nan")
    >>> sentinel.check()
    ['1.weight']
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_gradhooks.core.spikes import parameter_norms


class NonfiniteSentinel:
    """Checks, in one reduction, that the gradients of some parameters are finite.

    Args:
        named_parameters: ``(name, parameter)`` pairs in the model's order (forward order, as
            ``named_parameters()`` gives them): the parameters checked, and the order that says
            which is nearest the loss.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]]) -> None:
        self._named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.last_checked = 0

    def check(self, parameters: Iterable[Tensor] | None = None, norms: Tensor | None = None) -> list[str] | None:
        """None when every gradient of ``parameters`` (default: all) is finite; else the names
        of the parameters whose gradient is not (or of all of them, when only their total norm
        overflows), in model order, the one nearest the loss last. :attr:`last_checked` is the
        number of gradients the last call checked.

        Costs one foreach norm over the gradients and one host read of the result; the names
        cost one norm per gradient, only when the check fails. ``norms``: the gradients' norms,
        one per parameter with a gradient in model order, if computed already
        (:class:`~lightning_gradhooks.core.spikes.StepNorms`): not computed again."""
        wanted = None if parameters is None else {id(p) for p in parameters}
        named = [(n, p.grad) for n, p in self._named if p.grad is not None and (wanted is None or id(p) in wanted)]
        self.last_checked = len(named)
        if not named:
            return None
        if norms is None:
            norms = parameter_norms([g for _, g in named])
        if math.isfinite(torch.linalg.vector_norm(norms).item()):
            return None
        bad = [n for (n, _), norm in zip(named, norms.tolist()) if not math.isfinite(norm)]
        return bad or [n for n, _ in named]
