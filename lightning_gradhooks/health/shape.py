"""What the judge learns of the model from its logged steps: the backward order of its modules,
the element count of each parameter and which parameters' gradients are all zero. Python and numpy."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import compress
from typing import Any

import numpy as np


def size_of(mean: np.ndarray, std: np.ndarray, norm: np.ndarray, std_told: np.ndarray) -> np.ndarray:
    """The element count of many gradients at once, from their norm, mean and std (``std_told``:
    where a std was logged; a std that is not finite is a single element's, 0): ``(norm² + std²)
    / (mean² + std²)``; NaN where it cannot be told (no std, a mean or norm not finite or not
    logged, all zero)."""
    std = np.where(np.isfinite(std), std, 0.0)
    spread = mean * mean + std * std
    elements = (norm * norm + std * std) / spread
    elements[~std_told | ~np.isfinite(mean) | ~np.isfinite(norm) | (spread == 0)] = math.nan
    return elements


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

    def learn(self, layout: Any, column: Callable[..., np.ndarray]) -> None:
        """Take in a step (before its checks read it): its
        :class:`~lightning_gradhooks.health.step.Layout` and its ``column`` reader (:meth:`Step.column`)."""
        order = self.order
        if not order.keys() >= layout.gradient_modules:
            for module in layout.gradient_modules:
                if module not in order:
                    order[module] = len(order)
        grads = layout.param_grads
        mean, std, norm = (column(name)[grads] for name in ("mean", "std", "norm"))
        elements = size_of(mean, std, norm, column("std", -1.0)[grads] != -1.0)
        names = layout.grad_names
        known = ~np.isnan(elements)
        self.sizes.update(zip(compress(names, known.tolist()), elements[known].tolist()))
        zeros = column("zero_fraction", -1.0)[grads]
        zero = zeros >= self._dead
        self.zero_grads.difference_update(compress(names, ((zeros != -1.0) & ~zero).tolist()))
        self.zero_grads.update(compress(names, ((zeros != -1.0) & zero).tolist()))

    def state_dict(self) -> dict[str, Any]:
        return {"order": dict(self.order), "sizes": dict(self.sizes), "zero_grads": sorted(self.zero_grads)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order, self.sizes = dict(state["order"]), dict(state["sizes"])
        self.zero_grads = set(state["zero_grads"])
