"""``StepNorms``: the gradient norm of every parameter at every optimizer step, kept on the device
and read one step late, without the host ever waiting for the device.

A gradient spike lasts a step or two and rarely falls on a logged step. What finds it costs one
fused reduction per optimizer step: ``torch._foreach_norm`` over the gradients the optimizer
steps (one read of the gradient bytes), stacked into one small vector (a float32 per parameter),
and a non-blocking copy of that vector into page-locked host memory. The host reads a step's
copy only once the device says it is done (an event, queried, never waited on): on a GPU that is
at the next batch's start or the one after; on a CPU the copy is done when it is made. The norms
are unscaled under a gradient scaler whose scale has not been taken off yet (a device tensor,
never read on the host) and, for sharded parameters (FSDP2, tensor parallelism: ``DTensor``),
pooled over the ranks (one ``all_reduce`` of the squares, on the device): the norm of the whole
parameter's gradient, not of one rank's piece.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> norms = StepNorms()
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> vector = norms.keep(7, list(model.named_parameters()))
    >>> [(step, names) for step, names, _, _ in norms.ready()]
    [(7, ('0.weight', '0.bias', '1.weight', '1.bias'))]
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_gradhooks.core._shards import is_dtensor, local_piece

#: Copies in flight at most: a host more steps ahead of its device than this drops the oldest
#: (counted in :attr:`StepNorms.dropped`).
IN_FLIGHT = 8


class _Copy(NamedTuple):
    step: int
    names: tuple[str, ...]
    host: Tensor
    event: Any  # a device event recorded after the copy; None on the CPU (the copy is done when made)
    extra: Any  # the caller's, handed back with the norms


def parameter_norms(grads: list[Tensor]) -> Tensor:
    """The L2 norm of each of ``grads`` as one float32 vector, from one fused ``_foreach_norm``
    (per device; a sparse gradient by its values)."""
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    devices = {g.device for g in grads}
    if len(devices) == 1:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    device = grads[0].device  # parameters on several devices (pipelined by hand): one vector on the first
    return torch.stack([n.to(device) for n in torch._foreach_norm(grads, 2, dtype=torch.float32)])


class StepNorms:
    """Keeps the gradient norm of every parameter at every optimizer step (:meth:`keep`) and
    hands them to the host once they have arrived (:meth:`ready`), in step order.

    Its host buffers are the only resource it owns: page-locked on a GPU, a few per step in
    flight, freed with it.
    """

    def __init__(self) -> None:
        self._flight: deque[_Copy] = deque()
        # The last ``named`` kept, whether its parameters are sharded, which had a gradient, their names.
        self._named: list[tuple[str, Tensor]] | None = None
        self._sharded = False
        self._present: tuple[bool, ...] | None = None
        self._names: tuple[str, ...] = ()
        self._spare: list[Tensor] = []
        #: Steps whose copy was dropped because the host ran too far ahead of its device.
        self.dropped = 0

    def keep(self, step: int, named: list[tuple[str, Tensor]], inv_scale: Tensor | None = None,
             norms: Tensor | None = None, extra: Any = None) -> Tensor | None:
        """Keep the gradient norms of ``named`` (``(name, parameter)`` pairs: those the optimizer
        is about to step; parameters without a gradient are left out) at optimizer step ``step``.

        Args:
            inv_scale: a device tensor the gradients are still to be multiplied by (the gradient
                scaler's inverse scale, for an optimizer that unscales in its own step).
            norms: the norms, if computed already for these gradients (the non-finite sentinel's).
            extra: anything of the caller's, handed back with the norms by :meth:`ready`.

        Returns:
            The norms (a float32 device vector, before unscaling), for another user of the same
            reduction; None when no parameter has a gradient.
        """
        if named is not self._named:  # another set of parameters: what follows from it, once
            self._named, self._sharded = named, any(is_dtensor(p) for _, p in named)
            self._present = None
        grads = [p.grad for _, p in named]
        present = tuple(g is not None for g in grads)
        if present != self._present:  # which parameters have a gradient: the names follow from it
            self._present, self._names = present, tuple(n for (n, _), on in zip(named, present) if on)
        if not all(present):
            grads = [g for g in grads if g is not None]
        if not grads:
            return None
        if self._sharded:
            computed = _pooled_norms(grads)
        else:
            computed = norms if norms is not None else parameter_norms(grads)
        vector = computed if inv_scale is None else computed * inv_scale.to(computed.device, torch.float32)
        self._copy(step, vector, extra)
        return computed

    def _copy(self, step: int, vector: Tensor, extra: Any) -> None:
        if len(self._flight) >= IN_FLIGHT:
            self._flight.popleft()
            self.dropped += 1
        at = next((i for i, t in enumerate(self._spare) if t.numel() == vector.numel()), None)
        if at is not None:
            host = self._spare.pop(at)
        else:
            host = torch.empty(vector.numel(), dtype=torch.float32, pin_memory=vector.device.type == "cuda")
        host.copy_(vector.detach(), non_blocking=True)
        event = None
        if vector.device.type != "cpu":
            event = torch.Event(device=vector.device)
            event.record()
        self._flight.append(_Copy(step, self._names, host, event, extra))

    def ready(self, wait: bool = False) -> list[tuple[int, tuple[str, ...], np.ndarray, Any]]:
        """``(step, names, norms, extra)`` of every kept step whose copy has arrived, in order;
        never waits for the device (a copy still in flight waits for the next call), unless
        ``wait`` (at the end of fit: every copy)."""
        out = []
        while self._flight and (self._flight[0].event is None or wait or self._flight[0].event.query()):
            copy = self._flight.popleft()
            if copy.event is not None and wait:
                copy.event.synchronize()
            out.append((copy.step, copy.names, copy.host.numpy().astype(np.float64), copy.extra))
            if len(self._spare) < IN_FLIGHT:
                self._spare.append(copy.host)
        return out

    def clear(self) -> None:
        """Forget the copies in flight and the buffers (the fit is over)."""
        self._flight.clear()
        self._spare.clear()


def _pooled_norms(grads: list[Tensor]) -> Tensor:
    """The norms of the whole gradients of which some are sharded (``DTensor``): each rank's
    pieces squared, summed over the ranks in one ``all_reduce`` (a replica counted once:
    :func:`~lightning_gradhooks.core._shards.local_piece`)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    # A plain gradient beside sharded ones is the same on every rank: rank 0 counts it.
    pieces = [local_piece(g)[0] if is_dtensor(g) else g if rank == 0 else None for g in grads]
    device = next((p.device for p in pieces if p is not None), grads[0].device)
    present = [p for p in pieces if p is not None]
    norms = iter(parameter_norms(present).square() if present else ())
    squares = torch.stack([next(norms) if p is not None else torch.zeros((), device=device) for p in pieces])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares)
    return squares.sqrt()
