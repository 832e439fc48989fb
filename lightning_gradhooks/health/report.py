"""The gradient-health report: what the :class:`~lightning_gradhooks.health.judge.Judge` decided,
rendered. Pure Python.

:class:`HealthReport` holds the judge of a run and renders it: :meth:`~HealthReport.table` (the
grouped report printed at the end of fit and by the ``report`` command; every flagged entry with
``full``) and :meth:`~HealthReport.markdown` (TensorBoard's Text tab). What each flag means is in
:mod:`lightning_gradhooks.health`.

Example:
    >>> report = HealthReport()
    >>> for step in range(0, 50, 10):
    ...     report.add_stats(step, {("grad_output", "a"): {"mean": 0.0, "std": 1.0},
    ...                             ("grad_output", "b"): {"mean": 0.0, "std": 1e-9},
    ...                             ("grad_output", "c"): {"mean": 0.0, "std": 2.0}})
    >>> print(report.table())  # doctest: +NORMALIZE_WHITESPACE
    GradHooks: vanishing on 1 module in 5 logged steps (worst first; every entry: --all, or the Text tab):
    flag       module  since  value  what
    vanishing  b       0      1e-09  grad_output b
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.summary.text import counted, listed
from lightning_gradhooks.health.flags import FLAGS, FORWARD_FLAGS, Flag, Row
from lightning_gradhooks.health.judge import Judge
from lightning_gradhooks.health.thresholds import Thresholds


class HealthReport:
    """The report of a run: a :class:`~lightning_gradhooks.health.judge.Judge` (:attr:`judge`)
    that takes in the logged steps, and its renderings.

    Args:
        thresholds: when to flag; default :class:`~lightning_gradhooks.health.thresholds.Thresholds`.
    """

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.judge = Judge(thresholds)

    @property
    def thresholds(self) -> Thresholds:
        return self.judge.thresholds

    @property
    def steps(self) -> int:
        """The number of logged steps taken in."""
        return self.judge.steps

    def add_stats(self, step: int, stats: Mapping[tuple[str, ...], Mapping[str, float]]) -> None:
        """:meth:`Judge.add_stats <lightning_gradhooks.health.judge.Judge.add_stats>`."""
        self.judge.add_stats(step, stats)

    @property
    def first_nonfinite(self) -> Row | None:
        """The ``nonfinite`` row: the first logged step with NaN/Inf and where they were born."""
        return self.judge.first_nonfinite

    def flags(self) -> list[Flag]:
        """Every flagged entry (the full table): non-finite first, then by flag, then by step."""
        return self.judge.flags()

    def rows(self) -> list[Row]:
        """The grouped report: one row per flag per module, worst first."""
        return self.judge.rows()

    def notes(self) -> list[Flag]:
        """Parameters that get no gradient by construction: never a flag."""
        return self.judge.notes()

    def names(self, flags: set[str] | None = None) -> set[str]:
        """The flags present (optionally only among ``flags``)."""
        return self.judge.names(flags)

    def state_dict(self) -> dict[str, Any]:
        """The judge's state (for a checkpoint)."""
        return self.judge.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`, of this release or an earlier one."""
        self.judge.load_state_dict(state)

    def table(self, full: bool = False, limit: int = 8, max_lines: int = 40) -> str:
        """The report as plain text: the grouped rows, worst first, at most ``limit`` per flag
        and ``max_lines`` lines in all (the rest counted), or every flagged entry with ``full``;
        one line when nothing was seen."""
        return render_table(self.judge, full, limit, max_lines)

    def markdown(self) -> str:
        """The report as Markdown (TensorBoard's Text tab): the grouped rows, then every entry."""
        return render_markdown(self.judge)


def _note_lines(judge: Judge) -> list[str]:
    """The notes at the end of the report: parameters that get no gradient by construction, then
    the checks' own (a gradient scaler's skipped steps)."""
    line = _note_line(judge)
    return ([line] if line else []) + judge.check_notes()


def _note_line(judge: Judge) -> str | None:
    """The line on parameters that get no gradient by construction (None: there are none)."""
    notes = judge.notes()
    if not notes:
        return None
    names = [f.entry for f in notes]
    shown = listed(names, 6)
    verb = "gets" if len(notes) == 1 else "get"
    return (f"note: {counted(len(notes), 'parameter')} {verb} no gradient by construction (float round-off next "
            f"to the gradient its module receives: a bias followed by a normalisation layer, a shift or scale that a "
            f"later operation removes); never trained, removable: {shown}")


def render_table(judge: Judge, full: bool = False, limit: int = 8, max_lines: int = 40) -> str:
    """:meth:`HealthReport.table` of ``judge``."""
    rows = judge.rows()
    notes = _note_lines(judge)
    if not rows:
        return "\n".join([f"GradHooks: no gradient problems seen in {counted(judge.steps, 'logged step')}.", *notes])
    if full:
        return render_full_table(judge)
    counts = {flag: sum(r.flag == flag for r in rows) + sum(c.flag == flag and c.score == math.inf
                                                             for r in rows for c in r.consequences) for flag in FLAGS}
    summary = ", ".join(f"{flag} at {counted(n, 'step')}" if flag == "spike" else f"{flag} on {counted(n, 'module')}"
                        for flag, n in counts.items() if n)
    header = f"GradHooks: {summary} in {counted(judge.steps, 'logged step')} (worst first; every entry: --all, or the Text tab):"
    cells = [("flag", "module", "since", "value")] + [(r.flag, r.module, str(r.since), f"{r.value:.3g}") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [header, "  ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + "  what"]
    budget = max_lines - len(lines) - len(notes)
    blocks = {flag: [(r, cell) for r, cell in zip(rows, cells[1:]) if r.flag == flag] for flag in FLAGS}
    # Every flag keeps room for its worst row (and what follows from it) and a count of the rest.
    reserved = {f: 1 + bool(b[0][0].consequences) + (len(b) > 1) if b else 0 for f, b in blocks.items()}
    for flag, block in blocks.items():
        reserved[flag] = 0
        room = budget - sum(reserved.values())
        shown = 0
        for r, cell in block:
            needed = 1 + bool(r.consequences) + (shown + 1 < len(block))  # room for the "more" line
            if shown == limit or needed > room:
                break
            room -= 1 + bool(r.consequences)
            lines.append("  ".join(c.ljust(w) for c, w in zip(cell, widths)) + "  " + r.detail)
            lines.extend(["    " + _consequences(r)] if r.consequences else [])
            shown += 1
            budget -= 1 + bool(r.consequences)
        if shown < len(block) and budget > 0:
            lines.append(f"    ... and {counted(len(block) - shown, 'more module')} flagged {flag} (--all)")
            budget -= 1
    lines += notes
    return "\n".join(line.rstrip() for line in lines)


def render_full_table(judge: Judge) -> str:
    """Every flagged entry of ``judge``, one per line."""
    flags = judge.flags()
    rows = [("entry", "flag", "since step", "last value")] + [
        (f.name, f.flag, str(f.since), f"{f.last:.3g}") for f in flags
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    header = f"GradHooks: {counted(len(flags), 'flagged entry', 'flagged entries')} in {counted(judge.steps, 'logged step')}:"
    first = judge.first_nonfinite
    extra = [f"nonfinite: {first.detail}"] if first else []
    return "\n".join([header, *lines, *extra, *_note_lines(judge)])


def render_markdown(judge: Judge) -> str:
    """:meth:`HealthReport.markdown` of ``judge``."""
    rows = judge.rows()
    notes = _note_lines(judge)
    if not rows:
        return "\n\n".join([f"No gradient problems seen in {counted(judge.steps, 'logged step')}.", *notes])
    lines = ["| flag | module | since step | value | what |", "|---|---|---|---|---|"]
    for r in rows:
        what = r.detail + (f"<br>{_consequences(r)}" if r.consequences else "")
        lines.append(f"| {r.flag} | `{r.module}` | {r.since} | {r.value:.3g} | {what} |")
    lines += ["", "Every flagged entry:", "", "| entry | flag | since step | last value |", "|---|---|---|---|"]
    lines += [f"| `{f.name}` | {f.flag} | {f.since} | {f.last:.3g} |" for f in judge.flags()]
    for note in notes:
        lines += ["", note]
    return "\n".join(lines)


def _consequences(row: Row) -> str:
    then = [f"then nonfinite at logged step {f.since}: {f.reason}" for f in row.consequences if f.flag == "nonfinite"]
    others = [f for f in row.consequences if f.flag != "nonfinite"]
    where = "downstream" if row.flag in FORWARD_FLAGS else "upstream"  # activations compound forward
    return "; ".join(([_elsewhere(others, where)] if others else []) + then)


def _elsewhere(consequences: list[Flag], where: str) -> str:
    kinds: dict[str, list[str]] = {}
    for f in consequences:
        kinds.setdefault(f.flag, []).append(f.module if f.flag != "stalled" else f.entry)
    parts = []
    for flag, names in kinds.items():
        names = list(dict.fromkeys(names))
        parts.append(f"{flag}: {listed(names, 6)}")
    return f"follows from it ({where}): " + "; ".join(parts)
