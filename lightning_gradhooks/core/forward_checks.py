"""``ForwardChecks``: where NaN/Inf are born in the forward pass, for the monitor's armed steps.

On an armed step, every module's forward hook sums each floating input (kind ``forward_input``)
and output (kind ``forward``): one op per tensor, NaN or Inf exactly when an element is (barring a
float32 overflow of a sum of finite values). The first check of the step also takes the norm of
every floating parameter (kind ``weights``: the weights were already non-finite when the step
began). A tensor is summed once a step: the output of one module that is the next one's input is
not summed again. The sums are reduced with the gradients (the monitor's reducer), so the report
can name the first module whose forward made a NaN
(:func:`lightning_gradhooks.health.nonfinite_origin`).

:class:`OutputStatistics` reduces the outputs of the watched modules on armed steps (kind
``output``): RMS, absmax, mean, the share of zeros and absmax over RMS, from one read of each
output, as it is when the module returns it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gradhooks.summary.records import Kind

#: A module hook: the module, whether it is a forward pre-hook, the hook (and, for a forward hook
#: that must run also when the forward raises, True).
Hook = tuple[nn.Module, bool, Callable] | tuple[nn.Module, bool, Callable, bool]


def tensor_leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Tensor]]:
    """The tensors in a module's output or inputs, with their key paths, however nested.

    Walks tensors, mappings (``ModelOutput`` is one), lists and tuples (named tuples by field
    name) and dataclasses; other objects are opaque.
    """
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from tensor_leaves(item, (*path, str(key)))
    elif isinstance(value, (list, tuple)):
        names = getattr(value, "_fields", None)
        for i, item in enumerate(value):
            yield from tensor_leaves(item, (*path, names[i] if names else str(i)))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensor_leaves(getattr(value, f.name), (*path, f.name))


class ForwardChecks:
    """The forward checks of one monitor.

    Args:
        model: the model whose weights are checked.
        unmonitored: modules the monitor does not hook, by label: they get a forward hook of
            their own (:attr:`hooks`), which the monitor puts in and parks with its own.
        reduce: the monitor's ``(kind, label, tensor)`` reduction.
        armed: whether the monitor is armed (a hook that fires after ``collect`` does nothing).
        weights_label: the label of the ``weights`` entry.
    """

    def __init__(self, model: nn.Module, unmonitored: Mapping[str, nn.Module],
                 reduce: Callable[[Kind, str, Tensor, bool], None], armed: Callable[[], bool],
                 weights_label: str) -> None:
        self._model = model
        self._reduce = reduce
        self._armed = armed
        self._weights_label = weights_label
        #: The forward hooks of the modules the monitor does not hook.
        self.hooks: list[Hook] = [(m, False, functools.partial(self._check_only, label)) for label, m in unmonitored.items()]
        self._weights_checked = False  # on this armed step
        self._seen: dict[int, tuple[weakref.ref, int]] = {}  # summed this armed step: (tensor, version)

    def reset(self) -> None:
        """Forget the armed step: the next one checks the weights and every tensor again."""
        self._weights_checked = False
        self._seen = {}

    def same_as(self, view: Tensor, tensor: Tensor) -> None:
        """``view`` (of ``tensor``, the monitor's view of an input) is summed when ``tensor`` is."""
        known = self._seen.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            self._seen[id(view)] = (weakref.ref(view), tensor._version)

    def _check_only(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self._armed() and torch.is_grad_enabled() and module.training:
            self.check(name, args, output)

    def check(self, name: str, args: tuple, output: Any, outputs: bool = True) -> None:
        """Sum the floating inputs and outputs of a module's forward (each tensor once a step);
        ``outputs=False``: the monitor reads the outputs' NaN/Inf from their statistics (kind
        ``output``), so they are only marked as seen (the next module's input is not summed)."""
        if not self._weights_checked:
            self._weights_checked = True
            self._check_weights()
        seen = self._seen
        for kind, value in ((Kind.FORWARD_INPUT, args), (Kind.FORWARD, output)):
            floating = []
            for _, t in tensor_leaves(value):
                # A tensor another check already summed, unchanged since (a module's input that
                # is the output of the module before it, a container's output): not again.
                known = seen.get(id(t))
                if not t.is_floating_point() or (known is not None and known[0]() is t and known[1] == t._version):
                    continue
                seen[id(t)] = (weakref.ref(t), t._version)
                if kind == Kind.FORWARD_INPUT or outputs:
                    floating.append(t.detach())
            sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in floating]
            if sums:
                self._reduce(kind, name, (sums[0] if len(sums) == 1 else torch.stack(sums).sum()).reshape(1), False)

    def _check_weights(self) -> None:
        """The L2 norm of each floating parameter (NaN or Inf when it holds one; also Inf for
        weights so large that their squares overflow float32, beyond 1e19), one ``weights`` entry
        whose ``nonfinite`` counts those parameters. (The norm: ~4x faster on the CPU than the max.)"""
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in self._model.parameters():
            if p.is_floating_point() and type(p.data) is Tensor:  # sharded (DTensor) ones: their pieces differ per rank
                by_device.setdefault(p.device, []).append(p.detach())
        with torch.no_grad():
            for params in by_device.values():
                norms = torch._foreach_norm(params)
                self._reduce(Kind.WEIGHTS, self._weights_label, torch.stack([n.float() for n in norms]), False)
