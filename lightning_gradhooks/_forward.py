"""Forward checks on logged steps: where non-finite values are *born*.

A NaN made in the forward of ``net.6`` reaches every later module's output and, in backward,
first shows in the gradient of the last module. On logged steps, a forward hook on every
monitored module reduces each floating output to its sum (one op per output; the sum is NaN or
Inf exactly when an element is, barring a float32 overflow of the sum of finite values) and hands
it to :meth:`GradientMonitor.observe`, so it is read in the step's one transfer as an entry of
kind ``"forward"``. Those entries come first in the record, in forward order, so
:attr:`GradientRecord.first_nonfinite` names the first module whose output was non-finite.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gradhooks.monitor import GradientMonitor, _tensor_leaves


def _check(monitor: GradientMonitor, name: str, module: nn.Module, args: tuple, output: Any) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return
    floating = [t.detach() for _, t in _tensor_leaves(output) if t.is_floating_point()]
    sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in floating]
    if sums:
        monitor.observe("forward", name, (sums[0] if len(sums) == 1 else torch.stack(sums).sum()).reshape(1))


class ForwardChecks:
    """Forward hooks on the monitored modules, registered for logged steps only; idempotent removal."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def register(self, monitor: GradientMonitor) -> None:
        if not self._handles:
            for name, module in monitor.modules.items():
                self._handles.append(module.register_forward_hook(functools.partial(_check, monitor, name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
