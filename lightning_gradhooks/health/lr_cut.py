"""``stalled``: param groups whose learning rate is cut (0, or tiny next to its highest so far).
Python and numpy."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_gradhooks.core._text import counted
from lightning_gradhooks.health.check import Check
from lightning_gradhooks.health.flags import PARAM_GROUP, Subject
from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.core.records import Key

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
        groups: dict[tuple[int | None, int], list[tuple[Key, float]]] = {}
        params, keys = step.layout.params, step.layout.keys
        group, lr = step.column("group", -1.0)[params], step.column("lr")[params]  # (a group is an index: never -1)
        chosen = (group != -1.0) & np.isfinite(lr)
        for i, index, rate in zip(params[chosen].tolist(), group[chosen].tolist(), lr[chosen].tolist()):
            groups.setdefault((keys[i].optimizer, int(index)), []).append((keys[i], rate))
        for (optimizer, index), members in groups.items():
            lr = members[0][1]
            of = "" if optimizer is None else f" of optimizer {optimizer}"
            label = f"param_groups[{index}]{of}"
            peak = self.peaks[label] = max(self.peaks.get(label, 0.0), lr)
            cut = lr <= LR_CUT * peak
            module = common_module(tuple(step.subjects[key].module for key, _ in members))
            reason = (f"learning rate {lr:g} (`param_groups[{index}]['lr']`{of}, its highest so far {peak:g}): "
                      f"the {counted(len(members), 'parameter')} of the group do not move")
            tracker.run("stalled", Subject(PARAM_GROUP, label, module), step.number, cut,
                        self.thresholds.stalled_steps, lr, reason=reason)
            if cut:
                step.lr_cut.update(key.label for key, _ in members)

    def state_dict(self) -> dict[str, Any]:
        return {"peaks": dict(self.peaks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.peaks = dict(state["peaks"])
