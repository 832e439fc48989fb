"""``stalled``: param groups whose learning rate is cut (0, or tiny next to its highest so far).
Python and numpy."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.summary.text import counted
from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import PARAM_GROUP, Subject
from lightning_gradhooks.health.step import Layout, Step
from lightning_gradhooks.health.tracker import Tracker

#: A learning rate at most this share of its group's highest so far is cut (0, or tiny).
LR_CUT = 1e-6


@functools.lru_cache(maxsize=256)
def common_module(modules: tuple[str, ...]) -> str:
    """The innermost module holding all of ``modules`` (``(model)`` for the model itself)."""
    common = []
    for parts in zip(*(m.split(".") for m in modules)):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common) or "(model)"


def _groups(layout: Layout, at: np.ndarray, group: np.ndarray) -> dict[tuple[int | None, int], tuple[np.ndarray, str, list[str]]]:
    """The param groups of the parameters at ``at`` (their group indices: ``group``), in the order
    of their first parameter: ``(optimizer, index)`` -> the positions of their parameters in
    ``at``, the module holding them all and their names; the same for every step of a layout."""
    found = layout.memo.get(("groups", at.tobytes(), group.tobytes()))
    if found is not None:
        return found
    optimizers = np.array([-1 if layout.keys[i].optimizer is None else layout.keys[i].optimizer for i in at.tolist()],
                          dtype=np.int64)
    found = {}
    pairs = np.stack([optimizers, group.astype(np.int64)], axis=1)
    unique, first, inverse = np.unique(pairs, axis=0, return_index=True, return_inverse=True)
    for u in np.argsort(first, kind="stable").tolist():
        optimizer, index = unique[u].tolist()
        members = np.flatnonzero(inverse.reshape(-1) == u)
        positions = at[members].tolist()
        found[(None if optimizer == -1 else optimizer, index)] = (
            members, common_module(tuple(layout.modules[i] for i in positions)), [layout.names[i] for i in positions])
    if len(layout.memo) > 64:
        layout.memo.clear()
    layout.memo[("groups", at.tobytes(), group.tobytes())] = found
    return found


class LrCut(Check):
    """A param group whose learning rate (read from the optimizer's ``param_groups``) is at most
    :data:`LR_CUT` of its highest so far, for ``stalled_steps`` logged steps: ``stalled``, one
    row per group naming it and its learning rate.

    State: each group's highest learning rate so far. Writes: ``step.lr_cut`` (the parameters
    of the cut groups: explained by it).
    """

    name = "lr_cut"

    def __init__(self, thresholds: Any) -> None:
        super().__init__(thresholds)
        self.peaks: dict[str, float] = {}  # param group -> its highest learning rate so far

    def __call__(self, step: Step, tracker: Tracker) -> None:
        layout = step.layout
        params = layout.params
        group, lr = step.column("group", -1.0)[params], step.column("lr")[params]  # (a group is an index: never -1)
        chosen = (group != -1.0) & np.isfinite(lr)
        at, group, lr = params[chosen], group[chosen], lr[chosen]
        for (optimizer, index), (members, module, names) in _groups(layout, at, group).items():
            rate = float(lr[members[0]])
            of = "" if optimizer is None else f" of optimizer {optimizer}"
            label = f"param_groups[{index}]{of}"
            peak = self.peaks[label] = max(self.peaks.get(label, 0.0), rate)
            cut = rate <= LR_CUT * peak
            reason = (f"learning rate {rate:g} (`param_groups[{index}]['lr']`{of}, its highest so far {peak:g}): "
                      f"the {counted(len(members), 'parameter')} of the group do not move")
            tracker.run("stalled", Subject(PARAM_GROUP, label, module), step.number, cut,
                        self.thresholds.stalled_steps, rate, reason=reason)
            if cut:
                step.lr_cut.update(names)

    def state_dict(self) -> dict[str, Any]:
        return {"peaks": dict(self.peaks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.peaks = dict(state["peaks"])
