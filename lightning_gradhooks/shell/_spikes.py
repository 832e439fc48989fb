"""What ``GradHooks(spikes=True)`` owns in a fit: the norms kept at every optimizer step
(:class:`~lightning_gradhooks.core.spikes.StepNorms`) and one
:class:`~lightning_gradhooks.health.spikes.SpikeRule` per optimizer, run on every rank (the
norms are the whole model's on each, so every rank decides the same and logs the same steps).

Per optimizer step: one fused norm on the device and a non-blocking copy (:meth:`SpikeWatch.keep`).
Per batch start: the copies that have arrived are judged on the host (:meth:`SpikeWatch.read`),
each step's total norm charted (``∇1 overview/step_norm``) and a spike written at its step;
the shell then logs the next step in full.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_gradhooks.core.spikes import StepNorms
from lightning_gradhooks.health.spikes import Spike, SpikeRule
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.log.updates import unwrapped


class SpikeWatch:
    """The step norms and the spike rules of one fit.

    Args:
        named_parameters: the model's ``(name, parameter)`` pairs (trainable ones are kept).
        thresholds: the rule's (``spike_factor``, ``spike_z``, ``spike_window``).
    """

    def __init__(self, named_parameters: Any, thresholds: Thresholds) -> None:
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.norms = StepNorms()
        self.thresholds = thresholds
        self.rules: dict[int, SpikeRule] = {}
        self._named_by_optimizer: dict[int, tuple[tuple[int, ...], list]] = {}  # by optimizer: (parameter ids, pairs)
        self._restored: dict[str, Any] = {}

    def keep(self, step: int, optimizer: Any, optimizers: list[Any], params: list[Any], inv_scale: Any = None) -> Any:
        """Keep the gradient norms of ``params`` (those ``optimizer`` steps) at ``step``; returns
        the norms' vector (for the sentinel), or None without gradients."""
        index = next((i for i, o in enumerate(optimizers) if o is unwrapped(optimizer)), 0)
        lrs = [g["lr"] for g in optimizer.param_groups]
        lrs = lrs if all(isinstance(lr, (float, int)) for lr in lrs) else None  # a tensor lr: not read on the host
        return self.norms.keep(step, self._named_of(index, params), inv_scale,
                               extra=(index if len(optimizers) > 1 else None, lrs))

    def _named_of(self, index: int, params: list[Any]) -> list[tuple[str, Any]]:
        """The ``(name, parameter)`` pairs of ``params``, in model order: made again only when the
        optimizer's parameters change (the same list object every step after: no per-step walk)."""
        ids = tuple(map(id, params))
        kept = self._named_by_optimizer.get(index)
        if kept is None or kept[0] != ids:
            wanted = set(ids)
            kept = self._named_by_optimizer[index] = (ids, [(n, p) for n, p in self.named if id(p) in wanted])
        return kept[1]

    def read(self, wait: bool = False) -> list[tuple[int, int | None, float, Spike | None]]:
        """Judge every kept step whose norms have arrived (all of them with ``wait``, at the end):
        ``(step, optimizer index or None when there is one, total norm, spike or None)``, in order."""
        out = []
        for step, names, norms, (index, lrs) in self.norms.ready(wait):
            rule = self.rules.get(index or 0)
            if rule is None:
                rule = self.rules[index or 0] = SpikeRule(self.thresholds, optimizer=index)
                if str(index or 0) in self._restored:
                    rule.load_state_dict(self._restored.pop(str(index or 0)))
            out.append((step, index, float(np.sqrt(np.dot(norms, norms))), rule.add(step, names, norms, lrs)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's rule (its window), by optimizer index; and what was restored but not used yet."""
        return {**self._restored, **{str(i): rule.state_dict() for i, rule in self.rules.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rules.clear()
        self._restored = dict(state)

    def remove(self) -> None:
        self.norms.clear()
