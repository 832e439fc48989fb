"""The one owner of the runs of bad steps, the flags, the notes and the first non-finite step.
Python, the runs of each flag in numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from lightning_gradhooks.health.flags import Flag, Row, Subject
from lightning_gradhooks.health.series import Rows

_NONE = Subject("", "", "")  # a run's subject before its first bad step (a tuple: shared, never changed)


def objects(items: Sequence[Any]) -> np.ndarray:
    """``items`` as a one-dimensional array of objects (tuples stay elements); an array as it is."""
    return items if isinstance(items, np.ndarray) else np.fromiter(items, dtype=object, count=len(items))


class _Runs:
    """The runs of one flag, one row per subject label in the order first judged (a row is never
    removed): where each began (-1: not in one), its length, and the value, score and subject at
    its latest bad step; for a subject flagged, its worst score, and whether it was raised again
    since its :class:`Flag` was last made (``again``) with the value, subject and reason of the
    latest raise."""

    def __init__(self) -> None:
        self.numbers = Rows()
        self.labels = self.numbers.labels  # each row's subject label
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.last = np.zeros(0)
        self.score = np.zeros(0)
        self.subject = np.empty(0, dtype=object)
        self.flagged = np.zeros(0, dtype=bool)
        self.worst = np.zeros(0)
        self.again = np.zeros(0, dtype=bool)
        self.value = np.zeros(0)  # at the latest raise
        self.raised_subject = np.empty(0, dtype=object)
        self.reason = np.empty(0, dtype=object)

    def of(self, labels: Sequence[str]) -> np.ndarray:
        """The rows of ``labels`` (:meth:`~lightning_gradhooks.health.series.Rows.of`; new ones
        get new rows, in order)."""
        found = self.numbers.of(labels)
        if len(self.labels) > len(self.start):
            self._grow(len(self.labels))
        return found

    def _grow(self, size: int) -> None:
        more = size - len(self.start)
        self.start = np.concatenate([self.start, np.full(more, -1, dtype=np.int64)])
        self.length = np.concatenate([self.length, np.zeros(more, dtype=np.int64)])
        for name in ("last", "score", "worst", "value"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(more)]))
        for name in ("flagged", "again"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(more, dtype=bool)]))
        for name, fill in (("subject", _NONE), ("raised_subject", _NONE), ("reason", "")):
            grown = np.empty(size, dtype=object)
            grown[: size - more] = getattr(self, name)
            for row in range(size - more, size):  # (one by one: a tuple is an element here, not a row)
                grown[row] = fill
            setattr(self, name, grown)


class Tracker:
    """Runs and flags, keyed by ``(flag, subject label)``; a flag is raised once a run lasts
    long enough (:meth:`run`) and stays, with the step its first run began at. Also holds the
    notes (no problem, worth knowing) and the row of the first non-finite step."""

    def __init__(self) -> None:
        self._runs: dict[str, _Runs] = {}  # flag -> its runs
        self._order: list[tuple[str, int]] = []  # (flag, row) of every run, in the order first judged
        self._flags: dict[tuple[str, str], Flag] = {}
        self.notes: dict[str, Flag] = {}  # parameter -> its note, while it holds
        self.nonfinite: Row | None = None

    def run(self, flag: str, subject: Subject, step: int, bad: bool, needed: int, value: float,
            score: float = 0.0, reason: str = "", began: int | None = None) -> None:
        """Step ``subject``'s run of ``flag``: on a bad step it grows, and at ``needed`` steps the
        flag is raised (kept from an earlier run: its ``since`` and its worst score); a good step
        ends it. ``began``: where the trouble began when that is before the run (the flag's
        ``since`` goes back to it)."""
        self.run_many(flag, (subject,), (subject.label,), step, [0] if bad else [], needed, [value], [score], reason,
                      None if began is None else [began])

    @property
    def flags(self) -> dict[tuple[str, str], Flag]:
        """The flags raised, by ``(flag, subject label)``, in the order first raised."""
        for flag, runs in self._runs.items():
            for row in np.flatnonzero(runs.again).tolist():
                self._flag(flag, runs.labels[row])
        return self._flags

    def _flag(self, flag: str, label: str) -> Flag:
        """The flag of ``label`` as of now (made from its latest raise)."""
        runs = self._runs[flag]
        row = runs.numbers.rows[label]
        made = self._flags[(flag, label)]
        if runs.again[row]:
            runs.again[row] = False
            subject = runs.raised_subject[row]
            made = self._flags[(flag, label)] = Flag(made.flag, *subject[:2], made.since, float(runs.value[row]),
                                                     subject.module, float(runs.worst[row]), runs.reason[row])
        return made

    def run_many(self, flag: str, subjects: Sequence[Subject], labels: Sequence[str], step: int,
                 bad: Sequence[int] | np.ndarray, needed: int | Sequence[int] | np.ndarray,
                 values: Sequence[float] | np.ndarray, scores: Sequence[float] | np.ndarray | float = 0.0,
                 reason: str = "", began: Sequence[int | None] | None = None) -> None:
        """:meth:`run` on each of ``subjects`` (whose labels are ``labels``, each once), at once:
        ``bad`` lists the bad ones (their positions, in order), with their ``needed``, ``values``
        and ``scores`` (each a number, or one per bad subject) and ``began`` (None, or one per
        bad subject: see :meth:`run`); the others are good. The same as
        one :meth:`run` each, in arrays: pass the same ``labels`` list at each step (a layout's)
        and the labels cost nothing."""
        runs = self._runs.get(flag)
        if runs is None:
            runs = self._runs[flag] = _Runs()
        known = len(runs.labels)
        rows = runs.of(labels)
        if len(runs.labels) > known:  # the runs are kept in the order first judged
            self._order.extend((flag, row) for row in range(known, len(runs.labels)))
            for row in range(known, len(runs.labels)):  # a flag without a run (a state of an earlier release)
                made = self._flags.get((flag, runs.labels[row]))
                if made is not None:
                    runs.flagged[row], runs.worst[row] = True, made.score
        bad = np.asarray(bad, dtype=np.int64)
        running = runs.start[rows] >= 0
        if len(bad) and running.any():
            running[bad] = False
        if running.any():  # runs that end
            ending = rows[running]
            runs.start[ending], runs.length[ending] = -1, 0
        if not len(bad):
            return
        at = rows[bad]
        self._raise(flag, runs, at, subjects, bad, step, needed, values, scores, reason)
        for row, start in zip(at.tolist(), began if began is not None else ()):
            made = self._flags.get((flag, runs.labels[row]))
            if start is not None and made is not None and made.since > start:
                self._flags[(flag, runs.labels[row])] = replace(self._flag(flag, runs.labels[row]), since=int(start))

    def _raise(self, flag: str, runs: _Runs, at: np.ndarray, subjects: Sequence[Subject], bad: np.ndarray, step: int,
               needed: int | Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
               scores: Sequence[float] | np.ndarray | float, reason: str) -> None:
        """The bad steps of :meth:`run_many`: the runs at ``at`` grow, and those long enough raise
        their flag."""
        values = np.full(len(at), values) if np.ndim(values) == 0 else np.asarray(values, dtype=np.float64)
        scores = np.full(len(at), scores) if np.ndim(scores) == 0 else np.asarray(scores, dtype=np.float64)
        starting = at[runs.start[at] < 0]
        runs.start[starting] = step
        runs.length[at] += 1
        runs.last[at], runs.score[at] = values, scores
        runs.subject[at] = objects(subjects)[bad]
        raised = runs.length[at] >= needed
        if not raised.any():
            return
        at, values, scores = at[raised], values[raised], scores[raised]
        old = runs.flagged[at]
        if not old.all():
            for row, value, score in zip(at[~old].tolist(), values[~old].tolist(), scores[~old].tolist()):
                subject = runs.subject[row]
                self._flags[(flag, runs.labels[row])] = Flag(flag, *subject[:2], int(runs.start[row]), value,
                                                            subject.module, score, reason)
            runs.flagged[at[~old]] = True
            runs.worst[at[~old]] = scores[~old]
        at, scores = at[old], scores[old]  # raised again: their since stays, the rest is the latest
        runs.value[at], runs.raised_subject[at] = values[old], runs.subject[at]
        runs.worst[at] = np.maximum(scores, runs.worst[at])
        runs.again[at] = True
        runs.reason[at] = reason

    def running(self, flag: str) -> bool:
        """Whether any subject is in a run of ``flag`` now."""
        runs = self._runs.get(flag)
        return runs is not None and bool((runs.start >= 0).any())

    def promote(self, flag: str) -> None:
        """Raise ``flag`` on every subject in a run of it now, however short."""
        runs = self._runs.get(flag)
        if runs is None:
            return
        for row in np.flatnonzero((runs.start >= 0) & ~runs.flagged).tolist():
            subject, score = runs.subject[row], float(runs.score[row])
            self._flags[(flag, runs.labels[row])] = Flag(flag, *subject[:2], int(runs.start[row]), float(runs.last[row]),
                                                        subject.module, score)
            runs.flagged[row], runs.worst[row] = True, score

    def state_dict(self) -> dict[str, Any]:
        def run(flag: str, row: int) -> list[Any]:
            runs = self._runs[flag]
            start = int(runs.start[row])
            return [flag, runs.labels[row], None if start < 0 else start, int(runs.length[row]), float(runs.last[row]),
                    float(runs.score[row]), list(runs.subject[row])]

        return {
            "runs": [run(flag, row) for flag, row in self._order],
            "flags": [asdict(f) for f in self.flags.values()],
            "notes": [asdict(f) for f in self.notes.values()],
            "nonfinite": asdict(self.nonfinite) if self.nonfinite is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._runs, self._order = {}, []
        self._flags = {(flag.flag, flag.name): flag for flag in (Flag(**f) for f in state["flags"])}
        for flag, label, start, length, last, score, subject in state["runs"]:
            runs = self._runs.setdefault(flag, _Runs())
            (row,) = runs.of([label]).tolist()
            self._order.append((flag, row))
            runs.start[row], runs.length[row] = -1 if start is None else start, length
            runs.last[row], runs.score[row], runs.subject[row] = last, score, Subject(*subject)
            made = self._flags.get((flag, label))
            if made is not None:
                runs.flagged[row], runs.worst[row] = True, made.score
        self.notes = {f["entry"]: Flag(**f) for f in state["notes"]}
        row = state["nonfinite"]
        self.nonfinite = None if row is None else Row(**{**row, "consequences": [Flag(**f) for f in row["consequences"]]})
