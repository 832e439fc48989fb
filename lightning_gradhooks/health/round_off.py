"""Notes: parameters whose gradient is float round-off next to the gradient their module
receives, zero by construction (a bias followed by a normalisation layer). Python and numpy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Flag
from lightning_gradhooks.health.shape import size_of
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.core.records import Key, Kind

#: A noted parameter keeps its note while its gradient is below this share of its module's.
NOTE_HOLD_RATIO = 1e-3


class RoundOff(Check):
    """A note (never a flag) on a parameter whose gradient norm is below ``round_off_factor``
    round-offs of its module's output gradient for ``vanishing_steps`` logged steps in a row.

    Round-off of a sum of ``n`` terms of the module's output gradient spread over a parameter's
    ``p`` elements is about ``eps * sqrt(n / p)`` of its norm. A parameter whose smaller sibling
    (same module, fewer elements) gets more than round-off is no such parameter: the module's
    gradient reaches its parameters, and this one's is small because its input is. Once noted,
    a parameter stays noted while its gradient stays below :data:`NOTE_HOLD_RATIO` of its
    module's (a scale before a LayerNorm, whose eps lets a little through as training goes).

    State: each parameter's run of round-off steps. Writes: ``step.round_off``.
    """

    name = "round_off"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.runs: dict[str, list[int]] = {}  # parameter -> [first step of its run, length]

    def __call__(self, step: Step, tracker: Tracker) -> None:
        found = self._found(step)
        siblings: dict[str, list[tuple[float, bool]]] = {}  # module -> its parameters' element counts, round-off
        for _, module, _, elements, none in found.values():
            siblings.setdefault(module, []).append((elements, none))
        for name, (key, module, ratio, elements, none) in found.items():
            if none and any(not other_none and 0 < other < elements for other, other_none in siblings[module]):
                none = False  # a weight whose input is small, beside a bias that gets its gradient
            none = none or (name in tracker.notes and ratio < NOTE_HOLD_RATIO)
            if not none:
                self.runs.pop(name, None)
                tracker.notes.pop(name, None)
                continue
            run = self.runs.setdefault(name, [step.number, 0])
            run[1] += 1
            if run[1] >= self.thresholds.vanishing_steps:
                tracker.notes[name] = Flag("note", str(key.kind), name, run[0], ratio, module)
            step.round_off.add(name)

    def _found(self, step: Step) -> dict[str, tuple[Key, str, float, float, bool]]:
        """Parameter -> its key, its module, its gradient's norm over its module's, its element
        count, and whether that is at round-off."""
        layout, norms = step.layout, step.column("norm")
        told = step.finite & ~np.isnan(norms)  # (a norm is NaN only where not told: NaN is non-finite)
        outputs: dict[str, list[float]] = {}  # module -> [norm, elements] of its output gradients
        arriving = np.flatnonzero(told & (layout.kinds == Kind.GRAD_OUTPUT))
        sizes = size_of(step.column("mean", math.nan)[arriving], step.column("std", math.nan)[arriving], norms[arriving],
                        step.column("std", -1.0)[arriving] != -1.0)
        for i, norm, elements in zip(arriving.tolist(), norms[arriving].tolist(), sizes.tolist()):
            module = layout.modules[i]
            before, before_elements = outputs.setdefault(module, [0.0, 0.0])
            outputs[module] = [math.hypot(before, norm), before_elements + (0.0 if math.isnan(elements) else elements)]
        found = {}
        factor, eps, sizes_of = self.thresholds.round_off_factor, step.eps, step.shape.sizes
        for i in np.flatnonzero(told & (layout.kinds == Kind.PARAM_GRAD)).tolist():
            key, module, norm = layout.keys[i], layout.modules[i], float(norms[i])
            arriving_norm, outputs_size = outputs.get(module, [0.0, 0.0])
            elements = sizes_of.get(layout.names[i], 0.0)
            ratio = norm / arriving_norm if arriving_norm > 0 else math.nan
            limit = factor * eps * math.sqrt(outputs_size / elements) if outputs_size and elements else 0.0
            found[layout.names[i]] = (key, module, ratio, elements, ratio == 0 or ratio < limit)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"runs": {name: list(run) for name, run in self.runs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.runs = {name: [int(start), int(length)] for name, (start, length) in state["runs"].items()}
