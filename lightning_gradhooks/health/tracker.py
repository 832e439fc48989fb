"""The one owner of the runs of bad steps, the flags, the notes and the first non-finite step.
Pure Python."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_gradhooks.health.flags import Flag, Row, Subject


@dataclass
class Run:
    """A run of bad steps of one flag on one subject: where it began (None: not in one), its
    length, and the value, score and subject at its latest bad step."""

    start: int | None = None
    length: int = 0
    last: float = 0.0
    score: float = 0.0
    subject: Subject = Subject("", "", "")  # (a tuple: shared, never changed)


class Tracker:
    """Runs and flags, keyed by ``(flag, subject label)``; a flag is raised once a run lasts
    long enough (:meth:`run`) and stays, with the step its first run began at. Also holds the
    notes (no problem, worth knowing) and the row of the first non-finite step."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], Run] = {}
        self._flags: dict[tuple[str, str], Flag] = {}
        # Flags raised again since they were last read: their latest (value, subject, worst score,
        # reason), made into a Flag when read (a flag stays raised for many steps; a Flag is dear to make).
        self._raised: dict[tuple[str, str], tuple[float, Subject, float, str]] = {}
        self.notes: dict[str, Flag] = {}  # parameter -> its note, while it holds
        self.nonfinite: Row | None = None
        self._judged: dict[str, set[str]] = {}  # flag -> the labels with a run of it
        self._open: dict[str, set[str]] = {}  # flag -> the labels in a run of it now

    def run(self, flag: str, subject: Subject, step: int, bad: bool, needed: int, value: float,
            score: float = 0.0, reason: str = "", began: int | None = None) -> None:
        """Step ``subject``'s run of ``flag``: on a bad step it grows, and at ``needed`` steps the
        flag is raised (kept from an earlier run: its ``since`` and its worst score); a good step
        ends it. ``began``: where the trouble began when that is before the run (the flag's
        ``since`` goes back to it)."""
        label = subject.label
        self.run_many(flag, (subject,), (label,), step, ((0, needed, value, score),) if bad else (), reason)
        previous = self._flags.get((flag, label))
        if bad and began is not None and previous is not None and previous.since > began:
            self._flags[(flag, label)] = replace(self._flag((flag, label)), since=int(began))

    @property
    def flags(self) -> dict[tuple[str, str], Flag]:
        """The flags raised, by ``(flag, subject label)``, in the order first raised."""
        for key in list(self._raised):
            self._flag(key)
        return self._flags

    def _flag(self, key: tuple[str, str]) -> Flag:
        """The flag of ``key`` as of now (made from its latest raise)."""
        raised, flag = self._raised.pop(key, None), self._flags[key]
        if raised is not None:
            value, subject, worst, reason = raised
            flag = self._flags[key] = Flag(flag.flag, *subject[:2], flag.since, value, subject.module, worst, reason)
        return flag

    def run_many(self, flag: str, subjects: Sequence[Subject], labels: Sequence[str], step: int,
                 bad: Iterable[tuple[int, int, float, float]], reason: str = "") -> None:
        """:meth:`run` on each of ``subjects`` (whose labels are ``labels``, each once), in order:
        ``bad`` lists the bad ones as ``(index, needed, value, score)``, in order; the others are
        good. The same as one :meth:`run` each, at the cost of the bad ones and the runs that end."""
        judged, runs = self._judged.setdefault(flag, set()), self.runs
        if not judged.issuperset(labels):  # the runs are kept in the order first judged
            for label in labels:
                if label not in judged:
                    runs[(flag, label)] = Run()
                    judged.add(label)
        bad = list(bad)
        running = self._open.setdefault(flag, set())
        for label in running.intersection(labels).difference([labels[i] for i, *_ in bad]):  # runs that end
            run = runs[(flag, label)]
            run.start, run.length = None, 0
            running.discard(label)
        flags, raised = self._flags, self._raised
        for i, needed, value, score in bad:
            label, subject = labels[i], subjects[i]
            key = (flag, label)
            run = runs[key]
            if run.start is None:
                run.start = step
                running.add(label)
            run.length += 1
            run.last, run.score, run.subject = value, score, subject
            if run.length >= needed:
                previous = flags.get(key)
                if previous is None:
                    flags[key] = Flag(flag, *subject[:2], run.start, value, subject.module, score, reason)
                else:  # its since stays; the rest is its latest (made into a Flag when read)
                    latest = raised.get(key)
                    raised[key] = (value, subject, max(score, previous.score if latest is None else latest[2]), reason)

    def running(self, flag: str) -> bool:
        """Whether any subject is in a run of ``flag`` now."""
        return bool(self._open.get(flag))

    def promote(self, flag: str) -> None:
        """Raise ``flag`` on every subject in a run of it now, however short."""
        for key, run in self.runs.items():
            if key[0] != flag or run.start is None or key in self._flags:
                continue
            subject = run.subject
            self._flags[key] = Flag(flag, *subject[:2], run.start, run.last, subject.module, run.score)

    def state_dict(self) -> dict[str, Any]:
        return {
            "runs": [[flag, label, r.start, r.length, r.last, r.score, list(r.subject)]
                     for (flag, label), r in self.runs.items()],
            "flags": [asdict(f) for f in self.flags.values()],
            "notes": [asdict(f) for f in self.notes.values()],
            "nonfinite": asdict(self.nonfinite) if self.nonfinite is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.runs = {(flag, label): Run(start, length, last, score, Subject(*subject))
                     for flag, label, start, length, last, score, subject in state["runs"]}
        self._judged, self._open = {}, {}
        for (flag, label), run in self.runs.items():
            self._judged.setdefault(flag, set()).add(label)
            if run.start is not None:
                self._open.setdefault(flag, set()).add(label)
        self._flags = {(flag.flag, flag.name): flag for flag in (Flag(**f) for f in state["flags"])}
        self._raised = {}
        self.notes = {f["entry"]: Flag(**f) for f in state["notes"]}
        row = state["nonfinite"]
        self.nonfinite = None if row is None else Row(**{**row, "consequences": [Flag(**f) for f in row["consequences"]]})
