"""Where the NaN/Inf of a logged step were born (:func:`nonfinite_origin`), and which entries of a
step are non-finite (:func:`bad_entries`). Pure Python."""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_gradhooks.summary.text import counted
from lightning_gradhooks.health.flags import OVERFLOW_NORM
from lightning_gradhooks.summary.records import ACTIVATION_KINDS, GRADIENT_KINDS, Key, Kind


def why_bad(kind: str, stats: Mapping[str, float]) -> str | None:
    """Why an entry is non-finite (None: it is not)."""
    if kind in ACTIVATION_KINDS:  # the forward statistics: their NaN/Inf are the forward checks' to place
        return None
    count = stats.get("nonfinite", 0)
    if count and count > 0:
        return f"{int(count)} NaN/Inf"
    norm = stats.get("norm")
    if kind in GRADIENT_KINDS and norm is not None and not (norm < OVERFLOW_NORM):
        return f"norm {norm:.3g} overflows float32"
    if kind == Kind.PARAM:
        ratio, size = stats.get("update_ratio"), stats.get("param_norm")
        if size is not None and not math.isfinite(size):
            return "weights non-finite after the step"
        if ratio is not None and math.isnan(ratio):
            return "update ratio NaN"
    return None


def bad_entries(stats: Mapping[Key, Mapping[str, float]]) -> dict[Key, str]:
    """The non-finite entries of a step, in record order, with why."""
    return {key: why for key, s in stats.items() if (why := why_bad(key.kind, s)) is not None}


def nonfinite_origin(stats: Mapping[Key, Mapping[str, float]]) -> tuple[str, str, float] | None:
    """Where the NaN/Inf of one logged step were born, from its summary (entries in record order):
    ``(module, description, value)``, or None when the step is finite.

    In this order: the weights were already non-finite when the step began; a module's inputs
    were non-finite before its forward (made outside any module: the batch or functional code);
    a module's forward made them (the first, in forward order, whose inputs were finite); the
    loss (the first gradient of backward is already bad); the backward of a module (the first
    bad gradient in backward order); the optimizer step (a non-finite update).
    """
    return origin(stats, bad_entries(stats))


def origin(stats: Mapping[Key, Mapping[str, float]], found: Mapping[Key, str]) -> tuple[str, str, float] | None:
    """:func:`nonfinite_origin`, given the step's non-finite entries (:func:`bad_entries`)."""
    if not found:
        return None
    bad = list(found.items())
    count = {key: s.get("nonfinite", 0) for key, s in stats.items()}
    caught = [key for key, _ in bad if key.kind == Kind.CAUGHT]
    if caught:  # by the sentinel, on a step that may not be logged: the parameters alone tell
        return _caught(stats, caught)
    for key, why in bad:
        if key.kind == Kind.WEIGHTS:
            return key.label, f"weights already non-finite when the step began ({counted(int(count[key]), 'parameter')})", count[key]
    for key, why in bad:
        if key.kind == Kind.FORWARD_INPUT:
            module = key.module
            return module, f"inputs of `{module}` already non-finite: made outside any module (the batch, or functional code before it)", count[key]
        if key.kind == Kind.FORWARD:
            return key.label, f"born in the forward of `{key.label}`", count[key]
    found_in_backward = _backward(stats, bad, count)
    if found_in_backward is not None:
        return found_in_backward
    key, why = bad[0]
    return key.module, f"the optimizer step: {why} of `{key.label}`", 0.0


def _caught(stats: Mapping[Key, Mapping[str, float]], caught: list[Key]) -> tuple[str, str, float]:
    checked = int(stats[caught[0]].get("checked", 0))
    where = ("in every parameter: the loss or the forward pass made them" if len(caught) == checked else
             f"nearest the loss `{caught[-1].label}`: born in its module's backward or after it")
    return (caught[-1].module,
            f"caught before the optimizer step, which was skipped (the weights are still finite): non-finite "
            f"gradients in {counted(len(caught), 'parameter')}, {where}", float(len(caught)))


def _backward(stats: Mapping[Key, Mapping[str, float]], bad: list[tuple[Key, str]],
              count: Mapping[Key, float]) -> tuple[str, str, float] | None:
    """The first bad gradient in backward order: the loss, a module's backward, or another rank."""
    gradients = [key for key in stats if key.kind in GRADIENT_KINDS]
    ranks = next((s for key, s in stats.items() if key.kind == Kind.RANKS), None)  # bad before the all-reduce
    elsewhere = ""
    if ranks is not None:
        more = int(ranks.get("nonfinite_ranks", 1)) - 1
        elsewhere = f"rank {int(ranks.get('first_rank', 0))}" + (f" and {counted(more, 'other')}" if more else "")
    for key, why in bad:
        if key.kind in GRADIENT_KINDS:
            value = count[key] or stats[key].get("norm", 0.0)  # NaN/Inf count, or the overflowing norm
            if ranks is not None and not ranks.get("own", 1) and key.kind == Kind.PARAM_GRAD:
                # This rank's own backward was finite (its hooks, its local gradients): the
                # collective that averages the ranks' gradients brought the NaN.
                return key.module, (f"another rank: the gradients of {elsewhere} were already non-finite before the "
                                    f"all-reduce, which brought them here (this rank's forward, loss and own gradients "
                                    f"were finite); first seen in {key.kind} of `{key.label}` ({why})"), value
            on = f" (on {elsewhere}, before the all-reduce)" if ranks is not None else ""
            if gradients and gradients[0] == key:
                return key.module, f"the loss: the first gradient of backward ({key.kind} of `{key.label}`) is already bad: {why}{on}", value
            return key.module, f"born in backward: first seen in {key.kind} of `{key.label}` ({why}){on}", value
    return None
