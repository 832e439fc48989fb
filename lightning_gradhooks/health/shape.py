"""What the judge learns of the model from its logged steps: the backward order of its modules,
the element count of each parameter and which parameters' gradients are all zero. Pure Python."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.records import GRADIENT_KINDS, Kind, Summary


def size(stats: Mapping[str, float]) -> float | None:
    """The element count of a gradient, from its norm, mean and std (None if not told)."""
    mean, std, norm = stats.get("mean"), stats.get("std"), stats.get("norm")
    if None in (mean, std, norm) or not all(map(math.isfinite, (mean, norm))):
        return None
    std = std if math.isfinite(std) else 0.0
    if mean * mean + std * std == 0:
        return None
    return (norm * norm + std * std) / (mean * mean + std * std)


class Shape:
    """The model as the logged steps show it (updated by the judge before the checks read a step).

    Attributes:
        order: module -> its first position in backward order.
        sizes: parameter -> element count, from its gradient.
        zero_grads: parameters whose latest gradient is all zero (``dead_zero_fraction``).
    """

    def __init__(self, dead_zero_fraction: float) -> None:
        self._dead = dead_zero_fraction
        self.order: dict[str, int] = {}
        self.sizes: dict[str, float] = {}
        self.zero_grads: set[str] = set()

    def learn(self, entries: Summary, modules: Mapping[Any, Any]) -> None:
        """Take in a step's entries (``modules``: each key's subject)."""
        order = self.order
        for key, s in entries.items():
            if key.kind not in GRADIENT_KINDS:
                continue
            module = modules[key].module
            if module not in order:
                order[module] = len(order)
            if key.kind == Kind.PARAM_GRAD:
                if (elements := size(s)) is not None:
                    self.sizes[key.label] = elements
                if s.get("zero_fraction") is not None:
                    zero = s["zero_fraction"] >= self._dead
                    (self.zero_grads.add if zero else self.zero_grads.discard)(key.label)

    def state_dict(self) -> dict[str, Any]:
        return {"order": dict(self.order), "sizes": dict(self.sizes), "zero_grads": sorted(self.zero_grads)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order, self.sizes = dict(state["order"]), dict(state["sizes"])
        self.zero_grads = set(state["zero_grads"])
