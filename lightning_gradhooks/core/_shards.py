"""The local piece of a sharded gradient, and whether this rank is the one that reports it.

A parameter sharded by FSDP2 (``fully_shard``) or tensor parallelism (``parallelize_module``)
is a ``DTensor``: each rank holds a piece of the full logical tensor. Across the mesh dims
where it is ``Shard``, the pieces are a partition of the whole, so the statistics of the
whole are the pooled statistics of the pieces. Across the dims where it is ``Replicate``,
every rank holds the same piece: only the rank at coordinate 0 of those dims reports it, so
nothing is counted twice. A ``Partial`` gradient (a sum not reduced yet) cannot be pooled
from its pieces and is refused.

FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) keeps each original parameter as
a flat view of this rank's part of a flat parameter: all of it, part of it, or nothing.
With ``FULL_SHARD`` or ``SHARD_GRAD_OP`` those parts are again a partition of the whole.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

#: Why a chosen parameter gave no entry, as told to the user once.
PARTIAL = "its gradient has a Partial placement (a sum not reduced yet), which its shards cannot give"
NO_GRAD = "no gradient (not used in the step, or the optimizer step did not include it)"
FLAT = "flattened by FSDP1 without use_orig_params=True"


@functools.lru_cache(maxsize=1)
def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(tensor: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def fsdp1_sharded(model: nn.Module) -> tuple[set[int], set[int]]:
    """The ids of parameters that FSDP1 turned into shard views, and of its flat parameters.

    Parameters under ``NO_SHARD`` are whole on every rank (as under DDP) and under the
    hybrid strategies replicated across nodes: neither is listed.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return set(), set()  # FSDP1 needs a process group: no walk over the modules without one
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    views: set[int] = set()
    flat: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel):
            continue
        if not module._use_orig_params:
            flat.update(id(p) for p in module.parameters(recurse=False))
        elif module.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            views.update(id(p) for p in module.parameters())
    return views, flat


def reports(tensor: Tensor) -> bool:
    """Whether this rank counts its piece of ``tensor``: a plain tensor always; a ``DTensor`` at
    coordinate 0 of every mesh dim where it is not ``Shard`` (the other ranks hold replicas)."""
    if not is_dtensor(tensor):
        return True
    coordinate = tensor.device_mesh.get_coordinate()
    return coordinate is not None and all(p.is_shard() or c == 0 for p, c in zip(tensor.placements, coordinate))


def owns_examples(activation: Tensor) -> bool:
    """Whether this rank counts the examples of an activation: a ``DTensor`` one (tensor
    parallelism) is held by every rank of its mesh, and counted at coordinate 0 of every mesh dim
    where it is not sharded along the batch (its first dim)."""
    if not is_dtensor(activation):
        return True
    coordinate = activation.device_mesh.get_coordinate()
    return coordinate is not None and all(
        (p.is_shard() and p.dim == 0) or c == 0 for p, c in zip(activation.placements, coordinate))


def unsharded_type(module: nn.Module) -> type:
    """The class of ``module`` before FSDP2's ``fully_shard``, which swaps it for a subclass of
    ``FSDPModule`` and the class, adding no computation of its own; other classes as they are."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and bases[0].__module__.startswith("torch.distributed"):
        return bases[1]
    return cls


def local_piece(grad: Tensor) -> tuple[Tensor | None, str | None]:
    """This rank's piece of ``grad`` to reduce, or None; and a reason when it is refused.

    A plain tensor is its own piece. A ``DTensor`` gives its local tensor on the ranks at
    coordinate 0 of every mesh dim where it is not ``Shard``, and None on the other ranks (and
    on ranks outside its mesh).
    """
    if not is_dtensor(grad):
        return grad, None
    if any(p.is_partial() for p in grad.placements):
        return None, PARTIAL
    if not reports(grad):
        return None, None  # a replica (the rank at coordinate 0 reports it), or not in its mesh
    return grad.to_local(), None


def pieces(
    parameters: dict[str, nn.Parameter], views: set[int], wanted: set[int] | None
) -> Iterator[tuple[str, Tensor | None, str | None]]:
    """``(name, local piece or None, reason or None)`` for each parameter to report."""
    for name, param in parameters.items():
        if wanted is not None and id(param) not in wanted:
            continue
        grad = param.grad
        if grad is None:
            # An empty FSDP1 view holds nothing here; the other ranks report the parameter.
            yield name, None, None if id(param) in views and param.numel() == 0 else NO_GRAD
            continue
        if type(grad) is Tensor:  # the common case, without local_piece's checks
            yield name, grad if grad.numel() else None, None
            continue
        piece, reason = local_piece(grad)
        yield name, None if piece is not None and piece.numel() == 0 else piece, reason
