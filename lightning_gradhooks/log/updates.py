"""``UpdateTracker``: ‖Δw‖/‖w_before‖ of an optimizer step, from the optimizer's own step hooks. Pure torch.

On a step marked with :meth:`UpdateTracker.expect`, the step pre-hook copies the watched
parameters of that optimizer (one copy of them, on their device: the snapshot memory is the
size of the watched parameters of the one optimizer being stepped, held only between its pre-
and post-hook, on marked steps only), and the post-hook turns the copy into two numbers per
parameter, ``‖w_after - w_before‖ / ‖w_before‖`` (the update ratio: how far the step moved the
weights, against where they were) and ``‖w_after‖``, in a few foreach ops, and frees it. Those
numbers go to the host in one copy per step: on CUDA a non-blocking copy into pinned memory, read
by :meth:`UpdateTracker.ready` (the log calls it at its next write, by when the copy has long
landed), so the step itself adds no synchronisation; elsewhere at once.

Any optimizer, AMP included (a step the gradient scaler skips calls neither hook, so nothing is
measured), gradient accumulation (the step is what is measured) and manual optimization.

Example:
    >>> model = torch.nn.Linear(2, 1)
    >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> tracker = UpdateTracker({"weight": model.weight, "bias": model.bias})
    >>> tracker.attach(sgd)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> tracker.expect(sgd, step=0)
    >>> sgd.step()
    >>> [(step, sorted(values)) for step, _, values in tracker.ready()]
    [(0, ['bias', 'weight'])]
    >>> tracker.remove()
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_gradhooks.summary.records import GradientRecord


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer of a Lightning ``LightningOptimizer`` or Fabric ``_FabricOptimizer``
    (which hold it as ``_optimizer``); an optimizer as it is."""
    return getattr(optimizer, "_optimizer", optimizer)


def unheld(named: Iterable[tuple[str, Tensor]], optimizers: Sequence[Any]) -> list[tuple[str, Tensor]]:
    """The ``(name, parameter)`` pairs of ``named`` that no optimizer of ``optimizers`` holds."""
    held = {id(p) for o in map(unwrapped, optimizers) for group in o.param_groups for p in group["params"]}
    return [(n, p) for n, p in named if id(p) not in held]


def _ratio(update: float, before: float) -> float:
    """``‖Δw‖ / ‖w_before‖``; 0 for no update; ``inf`` for weights that were all zero and moved
    (zero-initialised biases at their first step: the report skips those, it reads ``inf`` as
    an overflow only where ``‖w_after‖`` is not finite either)."""
    if before > 0:
        return update / before
    return 0.0 if update == 0 else float("inf")


class Update(NamedTuple):
    """What one optimizer step did to one parameter, and what the optimizer held for it then."""

    #: ``‖w_after - w_before‖ / ‖w_before‖``.
    update_ratio: float
    #: ``‖w_after‖``.
    param_norm: float
    #: The index of its param group in ``optimizer.param_groups``.
    group: int = 0
    #: Its group's learning rate at the step (``param_groups[group]["lr"]``; NaN without one).
    lr: float = math.nan
    #: Whether it had a gradient when the step began: False for a parameter that requires grad
    #: and whose ``.grad`` is None (the optimizer skips it).
    gradient: bool = True


#: What the optimizer held for a parameter when its step began: the group index, the group's
#: learning rate, whether it had a gradient (:class:`Update`'s last three fields).
_Facts = tuple[int, float, bool]


def _lr(group: Mapping[str, Any]) -> float:
    try:
        return float(group.get("lr", math.nan))
    except (TypeError, ValueError):  # a schedule object in place of a number
        return math.nan


class UpdateTracker:
    """Measures the update of the watched parameters on the optimizer steps it is told to expect.

    Args:
        parameters: the parameters to watch, by name.
    """

    def __init__(self, parameters: Mapping[str, nn.Parameter]) -> None:
        self._names = {id(p): n for n, p in parameters.items()}
        self._handles: list[Any] = []
        self._due: dict[int, tuple[int, int | None]] = {}  # id(optimizer) -> (step, index)
        # (id(optimizer), step, index, names, parameters, their copies, facts) of a step under way
        self._snapshot: tuple[int, int, int | None, list[str], list[Tensor], list[Tensor], list[_Facts]] | None = None
        # (step, index, names, facts, norms on the host, CUDA event or None): norms on their way
        self._landing: list[tuple[int, int | None, list[str], list[_Facts], Tensor, Any]] = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Register the step pre- and post-hook on ``optimizer`` (removed by :meth:`remove`)."""
        self._handles.append(optimizer.register_step_pre_hook(self._before))
        self._handles.append(optimizer.register_step_post_hook(self._after))

    def expect(self, optimizer: torch.optim.Optimizer, step: int, index: int | None = None, now: bool = False) -> None:
        """Measure the next step of ``optimizer``, reported as ``step`` of optimizer ``index``.

        With ``now``, the weights are copied at once instead of in the step pre-hook: for a
        call made inside ``optimizer.step(closure)``, from the closure (Lightning calls
        ``on_before_optimizer_step`` there), after the pre-hook has run.
        """
        self._due[id(optimizer)] = (step, index)
        if now:
            self._before(optimizer, (), {})

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        due = self._due.pop(id(optimizer), None)
        if due is None:
            return
        names, params, facts = [], [], []
        for index, group in enumerate(optimizer.param_groups):
            lr = _lr(group)
            for p in group["params"]:
                if id(p) in self._names:
                    names.append(self._names[id(p)])
                    params.append(p)
                    facts.append((index, lr, p.grad is not None or not p.requires_grad))
        if params:
            with torch.no_grad():
                self._snapshot = (id(optimizer), *due, names, params, [p.detach().clone() for p in params], facts)

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._snapshot is None or self._snapshot[0] != id(optimizer):
            return
        _, step, index, names, params, before, facts = self._snapshot
        self._snapshot = None
        with torch.no_grad():
            now = [p.detach() for p in params]
            before_norms = torch._foreach_norm(before)
            torch._foreach_sub_(before, now)  # in place: no second copy
            values = torch.stack([*torch._foreach_norm(before), *torch._foreach_norm(now), *before_norms]).double()
        del before
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._landing.append((step, index, names, facts, host, event))
        else:
            self._landing.append((step, index, names, facts, values.cpu(), None))

    def ready(self) -> list[tuple[int, int | None, dict[str, Update]]]:
        """The measured steps, waiting for their numbers to reach the host:
        ``(step, index, {name: Update})``, in step order (``index`` as given to :meth:`expect`).
        A copy whose step never came (a step the gradient scaler skipped) is dropped here."""
        self._snapshot = None
        out = []
        for step, index, names, facts, host, event in self._landing:
            if event is not None:
                event.synchronize()
            values = host.tolist()
            n = len(names)
            out.append((step, index, {
                name: Update(_ratio(values[k], values[2 * n + k]), values[n + k], *facts[k])
                for k, name in enumerate(names)
            }))
        self._landing = []
        return out

    def remove(self) -> None:
        """Remove the optimizer hooks and drop what was not read; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._due.clear()
        self._snapshot = None
        self._landing.clear()


class UpdateRatios:
    """The update ratios of a log's optimizers: which optimizer a step belongs to, which
    parameters no optimizer holds, and one :class:`UpdateTracker` (made at the first record
    with parameters to watch) whose hooks on every optimizer :meth:`remove` takes out.

    Args:
        optimizers: the optimizers to measure (Lightning and Fabric wrappers are unwrapped).
    """

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = [unwrapped(o) for o in optimizers]
        self._tracker: UpdateTracker | None = None

    def index(self, optimizer: Any) -> int | None:
        """The index of ``optimizer`` among :attr:`optimizers`; None for None (all of them).

        Raises:
            ValueError: an optimizer that is not one of them.
        """
        if optimizer is None:
            return None
        optimizer = unwrapped(optimizer)
        for i, o in enumerate(self.optimizers):
            if o is optimizer:
                return i
        raise ValueError(f"`optimizer` expected one of the log's {len(self.optimizers)} optimizers, got another")

    def unowned(self, record: GradientRecord) -> list[str]:
        """Chosen parameters with a gradient that no optimizer holds: their ``param`` entry says
        ``in_optimizer`` 0 (the report flags them ``stalled``)."""
        if not self.optimizers or not record.parameters:
            return []
        return [name for name, p in unheld(record.parameters.items(), self.optimizers)
                if getattr(p, "grad", None) is not None]

    def expect(self, record: GradientRecord, step: int, index: int | None, labelled: int | None,
               now: bool = False) -> None:
        """Measure the next step of optimizer ``index`` (None: of each), reported as ``step`` of
        optimizer ``labelled``; ``now``: inside its step already (see :meth:`UpdateTracker.expect`).
        A sharded parameter is left out: the norm of a local piece is not the parameter's."""
        if not self.optimizers:
            return
        if self._tracker is None:
            watched = {n: p for n, p in record.parameters.items() if n not in record.sharded}
            if not watched:
                return
            self._tracker = UpdateTracker(watched)
            for o in self.optimizers:
                self._tracker.attach(o)
        for i, o in enumerate(self.optimizers):
            if index is None or i == index:
                self._tracker.expect(o, step, labelled, now=now)

    def ready(self) -> list[tuple[int, int | None, dict[str, Update]]]:
        """The measured steps whose numbers are on the host (:meth:`UpdateTracker.ready`)."""
        return [] if self._tracker is None else self._tracker.ready()

    def remove(self) -> None:
        """Remove the optimizer hooks; idempotent."""
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None
