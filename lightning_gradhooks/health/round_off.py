"""Notes: parameters whose gradient is float round-off next to the gradient their module
receives, zero by construction (a bias followed by a normalisation layer). Python and numpy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import repeat
from typing import Any

import numpy as np

from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import Flag
from lightning_gradhooks.health.shape import size_of
from lightning_gradhooks.health.step import Layout, Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind

#: A noted parameter keeps its note while its gradient is below this share of its module's.
NOTE_HOLD_RATIO = 1e-3


def _beside_siblings(norms: np.ndarray, modules: np.ndarray, elements: np.ndarray,
                     chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the ``chosen`` parameter gradients, whose module's ``grad_output`` is not told: their
    norm over the largest gradient norm of a sibling with more elements (NaN: none), and 1 where
    there is one (the limit, in round-offs). A bias's gradient sums the output gradient over the
    rows its weight's gradient multiplies with inputs: a real one is within a few orders of
    magnitude of its weight's; one zero by construction is round-off of it."""
    ratio, limit = np.full(int(chosen.sum()), math.nan), np.zeros(int(chosen.sum()))
    module_of, size_of_, norm_of = modules.tolist(), elements.tolist(), norms.tolist()
    siblings: dict[int, list[tuple[float, float]]] = {}  # module -> (elements, norm) of its finite gradients
    for j in np.flatnonzero(np.isfinite(norms)).tolist():
        siblings.setdefault(module_of[j], []).append((size_of_[j], norm_of[j]))
    for j, i in enumerate(np.flatnonzero(chosen).tolist()):
        reference = max((n for e, n in siblings.get(module_of[i], ()) if e > size_of_[i]), default=0.0)
        if reference > 0:
            ratio[j], limit[j] = norm_of[i] / reference, 1.0
    return ratio, limit


class RoundOff(Check):
    """A note (never a flag) on a parameter whose gradient norm is below ``round_off_factor``
    round-offs of its module's output gradient for ``vanishing_steps`` logged steps in a row.

    Round-off of a sum of ``n`` terms of the module's output gradient spread over a parameter's
    ``p`` elements is about ``eps * sqrt(n / p)`` of its norm. Where the module's output gradient
    is not told (modules in compiled code kept compiled on logged steps), a parameter's gradient
    is compared with its siblings' with more elements (a bias with its weight): below
    ``round_off_factor * eps`` of the largest, it is round-off. A parameter whose smaller sibling
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
        names, modules, ratio, elements, none = self._found(step)
        if none.any():  # a weight whose input is small, beside a bias that gets its gradient
            getting = ~none & (elements > 0)
            for i in np.flatnonzero(none).tolist():
                if np.any(getting & (modules == modules[i]) & (elements < elements[i])):
                    none[i] = False
        notes, runs = tracker.notes, self.runs
        if notes:
            held = np.fromiter((name in notes for name in names), dtype=bool, count=len(names))
            none |= held & (ratio < NOTE_HOLD_RATIO)
        # Only the parameters at round-off, and those that were: the others have nothing to change.
        known = none if not runs and not notes else none | np.fromiter(
            (name in runs or name in notes for name in names), dtype=bool, count=len(names))
        layout = step.layout
        for i in np.flatnonzero(known).tolist():
            name = names[i]
            if not none[i]:
                runs.pop(name, None)
                notes.pop(name, None)
                continue
            run = runs.setdefault(name, [step.number, 0])
            run[1] += 1
            if run[1] >= self.thresholds.vanishing_steps:
                at = self._at[i]
                notes[name] = Flag("note", str(layout.keys[at].kind), name, run[0], float(ratio[i]), layout.modules[at])
            step.round_off.add(name)

    def _found(self, step: Step) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The parameter gradients judged (in record order): their names, their modules (ids),
        their norm over their module's output gradient's, their element counts (0: not known),
        and whether that is at round-off."""
        layout, norms = step.layout, step.column("norm")
        told = step.finite & ~np.isnan(norms)  # (a norm is NaN only where not told: NaN is non-finite)
        arriving, ids, unique, at, names, at_ids = self._positions(layout, told)
        sizes = size_of(step.column("mean", math.nan)[arriving], step.column("std", math.nan)[arriving], norms[arriving],
                        step.column("std", -1.0)[arriving] != -1.0)
        # Each module's output gradients: their norm together, and their element count.
        modules = len(layout.module_names)
        arriving_norm, outputs_size = np.zeros(modules), np.zeros(modules)
        if unique:  # one each (math.hypot(0, norm) is norm, 0 + size is size)
            arriving_norm[ids], outputs_size[ids] = np.abs(norms[arriving]), np.where(np.isnan(sizes), 0.0, sizes)
        else:
            for module, norm, size in zip(ids.tolist(), norms[arriving].tolist(), sizes.tolist()):
                arriving_norm[module] = math.hypot(arriving_norm[module], norm)
                outputs_size[module] += 0.0 if math.isnan(size) else size
        self._at, ids = at, at_ids
        elements = np.fromiter(map(step.shape.sizes.get, names, repeat(0.0)), dtype=np.float64, count=len(names))
        told_module = np.zeros(modules, dtype=bool)
        told_module[layout.module_ids[arriving]] = True
        arriving_norm, outputs_size = arriving_norm[ids], outputs_size[ids]
        ratio = np.where(arriving_norm > 0, norms[at] / arriving_norm, math.nan)
        limit = np.where((outputs_size != 0) & (elements != 0), self.thresholds.round_off_factor * step.eps
                         * np.sqrt(outputs_size / elements), 0.0)
        untold = ~told_module[ids]
        if untold.any():  # no grad_output of the module (kept compiled): next to its bigger siblings' gradients
            ratio[untold], limit[untold] = _beside_siblings(norms[at], ids, elements, untold)
            limit[untold] *= self.thresholds.round_off_factor * step.eps
        none = (ratio == 0) | (ratio < limit)
        return names, ids, ratio, elements, none

    @staticmethod
    def _positions(layout: Layout,
                   told: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray, list[str], np.ndarray]:
        """Where the entries ``told`` (bool) are, made once per layout and ``told``: the module
        output gradients (positions, module ids, whether one per module) and the parameter
        gradients (positions, names, module ids)."""
        memo_key = ("round_off", told.tobytes())
        found = layout.memo.get(memo_key)
        if found is None:
            if len(layout.memo) > 64:
                layout.memo.clear()
            arriving = np.flatnonzero(told & layout.is_kind(Kind.GRAD_OUTPUT))
            ids = layout.module_ids[arriving]
            at = np.flatnonzero(told & layout.is_kind(Kind.PARAM_GRAD))
            found = layout.memo[memo_key] = (arriving, ids, len(ids) == len(np.unique(ids)), at,
                                             [layout.names[i] for i in at.tolist()], layout.module_ids[at])
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"runs": {name: list(run) for name, run in self.runs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.runs = {name: [int(start), int(length)] for name, (start, length) in state["runs"].items()}
