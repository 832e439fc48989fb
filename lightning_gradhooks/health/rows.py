"""Grouping the flags into the report's rows: functions over a
:class:`~lightning_gradhooks.health.tracker.Tracker` and the model's
:class:`~lightning_gradhooks.health.shape.Shape`. Pure Python."""

from __future__ import annotations

import math

from lightning_gradhooks.summary.text import counted, listed
from lightning_gradhooks.health.flags import FLAGS, FORWARD_FLAGS, PARAM_GROUP, Flag, Row
from lightning_gradhooks.health.shape import Shape
from lightning_gradhooks.health.tracker import Tracker
from lightning_gradhooks.summary.records import Kind


def behind_dead(tracker: Tracker, shape: Shape) -> list[Flag]:
    """Notes of parameters whose gradient is exactly zero, when a module is dead: a weight whose
    input is zero, not a redundant parameter."""
    if not any(f.flag == "dead" for f in tracker.flags.values()):
        return []
    return [f for f in tracker.notes.values() if f.entry in shape.zero_grads]


def stalled_behind_dead(tracker: Tracker, shape: Shape) -> list[Flag]:
    return [Flag("stalled", str(Kind.PARAM), n.entry, n.since, 0.0, n.module) for n in behind_dead(tracker, shape)]


def all_flags(tracker: Tracker, shape: Shape) -> list[Flag]:
    """Every flagged entry (the full table): non-finite first, then by flag, then by step."""
    found = sorted([*tracker.flags.values(), *stalled_behind_dead(tracker, shape)],
                   key=lambda f: (FLAGS.index(f.flag), f.since, -f.score))
    first = tracker.nonfinite
    head = [Flag("nonfinite", "", first.module, first.since, first.value, first.module, math.inf)] if first else []
    return head + found


def notes(tracker: Tracker, shape: Shape) -> list[Flag]:
    """The notes, in backward order, less those of parameters behind a dead module."""
    behind = set(map(id, behind_dead(tracker, shape)))
    return sorted((f for f in tracker.notes.values() if id(f) not in behind),
                  key=lambda f: (shape.order.get(f.module, 0), f.name))


def rows(tracker: Tracker, shape: Shape) -> list[Row]:
    """The grouped report: one row per flag per module (its entries folded in), worst first;
    upstream modules with the same flag, and stalled parameters of dead modules, under their
    cause; non-finite weights under the explosion that made them."""
    groups: dict[tuple[str, str], list[Flag]] = {}
    for f in tracker.flags.values():
        groups.setdefault((f.flag, f.module), []).append(f)
    grouped = {key: _row(key, flags) for key, flags in groups.items()}
    order = shape.order
    _fold_upstream(grouped, groups, "dead", order)
    _fold_upstream(grouped, groups, "vanishing", order)
    dead = sorted((r for r in grouped.values() if r.flag == "dead"), key=lambda r: r.since)
    _fold_stalled_under_dead(grouped, groups, dead, shape)
    _fold_upstream(grouped, groups, "stalled", order)
    _fold_downstream(grouped, groups, "activation_growth", order)
    # A weight whose gradient is exactly zero because its input is (downstream of a dead
    # layer) is no redundant parameter: it is stalled, under the dead layer.
    if dead:
        dead[0].consequences += stalled_behind_dead(tracker, shape)
    ranked = sorted(grouped.values(), key=lambda r: (FLAGS.index(r.flag), -r.score, r.since, order.get(r.module, 0)))
    ranked = _with_nonfinite(ranked, tracker.nonfinite)
    _after_forward(ranked, groups, order)
    return ranked


#: What a forward flag is about.
_WHAT = {"attention_logits": "the attention logits", "activation_growth": "the output RMS"}
#: The gradient flags whose row says which forward flag came before it.
_AFTER_FORWARD = ("nonfinite", "exploding", "stalled")
#: Remedies the literature names for attention logits that grow (Dehghani et al. 2023, ViT-22B;
#: Wortsman et al. 2023, small-scale proxies for large-scale Transformer training instabilities).
ATTENTION_REMEDIES = "known remedies: QK-norm, a lower learning rate or a longer warmup"


def upstream_or_same(forward: str, module: str, order: dict[str, int]) -> bool:
    """Whether ``forward`` is ``module``, holds it or is held by it, or runs before it in the
    forward pass (later in backward order; a module without gradient entries takes the place of
    its nearest parent with some)."""
    if forward == module or forward.startswith(module + ".") or module.startswith(forward + "."):
        return True
    at, of = _position(forward, order), _position(module, order)
    return at is not None and of is not None and at > of


def _position(module: str, order: dict[str, int]) -> int | None:
    """``module``'s place in backward order, or its nearest parent's."""
    while module not in order and "." in module:
        module = module.rpartition(".")[0]
    return order.get(module)


def _after_forward(ranked: list[Row], groups: dict[tuple[str, str], list[Flag]], order: dict[str, int]) -> None:
    """A gradient row (non-finite, exploding, stalled without a cause of its own) that follows a
    forward flag on its module or upstream of it says so: the earliest such flag, at or before
    the row's step."""
    forward = sorted((f for (flag, _), flags in groups.items() if flag in FORWARD_FLAGS for f in flags),
                     key=lambda f: (f.since, -f.score))
    if not forward:
        return
    for row in ranked:
        if row.flag not in _AFTER_FORWARD or (row.flag == "stalled" and any(f.reason for f in groups[(row.flag, row.module)])):
            continue
        cause = next((f for f in forward if f.since <= row.since and upstream_or_same(f.module, row.module, order)), None)
        if cause is not None:
            when = "" if " at step " in cause.reason else f" at step {cause.since}"  # (activation_growth's says none)
            row.detail += f"; after {_WHAT[cause.flag]} of `{cause.module}` {cause.reason}{when}"


def _fold_stalled_under_dead(grouped: dict[tuple[str, str], Row], groups: dict[tuple[str, str], list[Flag]],
                             dead: list[Row], shape: Shape) -> None:
    """Stalled parameters of a dead module, or whose gradient is all zero (downstream of a dead
    layer): a consequence of the first dead layer."""
    for (flag, module), row in list(grouped.items()):
        stalled = groups[(flag, module)]
        if flag == "stalled" and dead and not any(f.reason for f in stalled) and (
            ("dead", module) in groups or all(f.entry in shape.zero_grads for f in stalled)
        ):
            cause = next((r for r in dead if r.module == module or any(c.module == module for c in r.consequences)), dead[0])
            cause.consequences += stalled
            del grouped[(flag, module)]


def _with_nonfinite(ranked: list[Row], first: Row | None) -> list[Row]:
    """The rows with the first non-finite step's: under the explosion whose updates made the
    weights non-finite, or first, naming the explosions before it."""
    if first is None:
        return ranked
    earlier = [r for r in ranked if r.flag == "exploding" and r.since <= first.since]
    made_by_updates = first.detail.startswith(("weights already non-finite", "the optimizer step"))
    if earlier and made_by_updates:
        cause = min(earlier, key=lambda r: (r.since, -r.score))
        cause.consequences.append(Flag("nonfinite", "", first.module, first.since, first.value, first.module,
                                       math.inf, first.detail))
        return [cause] + [r for r in ranked if r is not cause]
    detail = first.detail
    if earlier:
        modules = len({r.module for r in earlier})
        detail += f"; preceded by exploding since step {min(r.since for r in earlier)} on {counted(modules, 'module')}"
    return [Row("nonfinite", first.module, first.since, first.value, detail, score=math.inf)] + ranked


def _fold_upstream(rows: dict[tuple[str, str], Row], groups: dict[tuple[str, str], list[Flag]], flag: str,
                   order: dict[str, int]) -> None:
    """Fold the rows of ``flag`` under the first flagged module in backward order (the one
    nearest the loss): a module upstream of it flagged since the same step or later is one of
    its consequences (no gradient flows up through a dead layer; a vanishing one keeps
    shrinking; nothing moves where nothing arrives). A row with a reason of its own (a parameter
    in no optimizer) is its own cause."""
    flagged = sorted((r for (fl, m), r in rows.items() if fl == flag and not any(f.reason for f in groups[(fl, m)])),
                     key=lambda r: order.get(r.module, 0))
    causes: list[Row] = []
    for row in flagged:
        cause = next((c for c in causes if c.since <= row.since), None)
        if cause is None:
            causes.append(row)
            continue
        cause.consequences += groups[(flag, row.module)]
        del rows[(flag, row.module)]


def _fold_downstream(rows: dict[tuple[str, str], Row], groups: dict[tuple[str, str], list[Flag]], flag: str,
                     order: dict[str, int]) -> None:
    """Fold the rows of ``flag`` under the first flagged module in forward order (the furthest from
    the loss) among those flagged first: activations that compound block after block grow
    downstream of where they began."""
    flagged = sorted((r for (fl, _), r in rows.items() if fl == flag),
                     key=lambda r: (r.since, -(_position(r.module, order) or 0)))
    causes: list[Row] = []
    for row in flagged:
        cause = next((c for c in causes if c.since <= row.since and upstream_or_same(c.module, row.module, order)), None)
        if cause is None:
            causes.append(row)
            continue
        cause.consequences += groups[(flag, row.module)]
        del rows[(flag, row.module)]


def _row(key: tuple[str, str], flags: list[Flag]) -> Row:
    flag, module = key
    flags = sorted(flags, key=lambda f: (f.since, -f.score))
    worst = max(flags, key=lambda f: f.score)
    entries = [f.name for f in flags]
    if flag == "dead":
        detail = "output and parameter gradients all zero"
    elif flag == "stalled":
        reasons: dict[str, list[str]] = {}
        for f in flags:
            reasons.setdefault(f.reason or "update ratio 0 or far below the model's", []).append(f.entry)
        # A param group's row says what the group is; other rows list the parameters.
        detail = "; ".join(why if any(f.kind == PARAM_GROUP and f.reason == why for f in flags) else
                           f"{why}: {listed(names, 6)}" for why, names in reasons.items())
    else:
        detail = listed(entries, 4)
        if flag == "exploding":
            detail = f"worst x{worst.score:.3g}: " + detail
        elif flag == "attention_logits":
            detail = f"{_WHAT[flag]} {worst.reason} and kept rising: {detail}; {ATTENTION_REMEDIES}"
        elif flag == "activation_growth":
            detail = f"{_WHAT[flag]} {worst.reason} (worst x{worst.score:.3g}): {detail}"
    return Row(flag, module, flags[0].since, worst.last, detail, entries, score=worst.score)
