"""A gradient-health report: what looks wrong, where, and since when. Pure Python.

:class:`HealthReport` consumes one :class:`~lightning_gradhooks.records.GradientRecord` per
logged step (from the callback, a plain loop or Fabric) or the scalars of a TensorBoard log
(the ``report`` command) and flags, per module or parameter:

- ``nonfinite``: NaN/Inf gradient elements; the first step and the first entry (in the record's
  order: backward order, parameters last) where they were seen;
- ``vanishing``: an RMS below ``vanishing_ratio`` times the median RMS of the same kind of
  gradient at the same step, for ``vanishing_steps`` logged steps in a row;
- ``exploding``: an RMS grown ``exploding_factor`` times over the last ``exploding_window``
  logged steps, or an ``update_ratio`` above ``exploding_update_ratio``;
- ``dead``: a ``zero_fraction`` of at least ``dead_zero_fraction`` for ``dead_steps`` logged
  steps in a row (``grad_output`` and parameter gradients);
- ``stalled``: an ``update_ratio`` below ``stalled_update_ratio`` for ``stalled_steps`` logged
  steps in a row.

The RMS of a gradient is its per-element root mean square, ``norm / sqrt(count)``; from a log,
where the count is not written, ``sqrt(mean² + std²)``. A check whose statistic was not logged
is skipped.

Example:
    >>> report = HealthReport()
    >>> for step in range(0, 50, 10):
    ...     report.add_stats(step, {("grad_output", "a"): {"mean": 0.0, "std": 1.0},
    ...                             ("grad_output", "b"): {"mean": 0.0, "std": 1e-9},
    ...                             ("grad_output", "c"): {"mean": 0.0, "std": 2.0}})
    >>> [(f.flag, f.name, f.since) for f in report.flags()]
    [('vanishing', 'grad_output b', 0)]
"""

from __future__ import annotations

import math
import statistics as _statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_gradhooks.records import GradientRecord

#: The flags, in the order the report lists them.
FLAGS = ("nonfinite", "exploding", "vanishing", "dead", "stalled")


@dataclass(frozen=True)
class Thresholds:
    """When the report raises a flag; every field can be overridden.

    Attributes:
        vanishing_ratio: RMS below this share of the median RMS (same kind, same step).
        vanishing_steps: ... for this many logged steps in a row.
        exploding_factor: RMS this many times its smallest value over the window.
        exploding_window: the window, in logged steps.
        exploding_update_ratio: ``update_ratio`` above this: a step half as big as the weights
            themselves (500x the healthy 1e-3; biases that start near zero reach 0.1 early).
        dead_zero_fraction: ``zero_fraction`` at least this ...
        dead_steps: ... for this many logged steps in a row.
        stalled_update_ratio: ``update_ratio`` below this (1/100 of the healthy 1e-3) ...
        stalled_steps: ... for this many logged steps in a row.
    """

    vanishing_ratio: float = 1e-3
    vanishing_steps: int = 3
    exploding_factor: float = 100.0
    exploding_window: int = 5
    exploding_update_ratio: float = 0.5
    dead_zero_fraction: float = 0.99
    dead_steps: int = 3
    stalled_update_ratio: float = 1e-5
    stalled_steps: int = 3


@dataclass(frozen=True)
class Flag:
    """One problem: ``flag`` (one of :data:`FLAGS`) on ``name`` since logged step ``since``;
    ``last`` is the statistic's latest value (RMS, zero fraction, update ratio or NaN count)."""

    flag: str
    name: str
    since: int
    last: float


@dataclass
class _Track:
    """Per name and check: the step a run of bad steps began at (None: not in one), its length."""

    start: int | None = None
    length: int = 0
    rms: list[float] = field(default_factory=list)


def _rms(stats: Mapping[str, float], count: float | None) -> float | None:
    if count and "norm" in stats:
        return stats["norm"] / math.sqrt(count)
    if "mean" in stats and "std" in stats:
        return math.hypot(stats["mean"], stats["std"])
    return None


class HealthReport:
    """Accumulates logged steps and flags gradient problems (see the module docstring).

    Args:
        thresholds: when to flag; default :class:`Thresholds`.
    """

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self.steps = 0
        self._flags: dict[tuple[str, str], Flag] = {}
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._nonfinite: Flag | None = None

    def add(self, step: int, record: GradientRecord) -> None:
        """Take in the record of one logged step."""
        self.add_stats(step, {(e.kind, e.name): e.stats for e in record.entries}, {(e.kind, e.name): e.count for e in record.entries})

    def add_stats(
        self,
        step: int,
        stats: Mapping[tuple[str, str], Mapping[str, float]],
        counts: Mapping[tuple[str, str], float] | None = None,
        new_step: bool = True,
    ) -> None:
        """Take in one logged step as ``{(kind, name): {statistic: value}}``, in record order;
        ``new_step=False`` for more statistics of a step already counted (update ratios)."""
        t = self.thresholds
        self.steps += new_step
        counts = counts or {}
        rms = {key: _rms(s, counts.get(key)) for key, s in stats.items()}
        medians = {}
        for kind in {k for k, _ in stats}:
            values = [v for (k, _), v in rms.items() if k == kind and v is not None and math.isfinite(v)]
            medians[kind] = _statistics.median(values) if len(values) > 2 else None
        for key, s in stats.items():
            label = f"{key[0]} {key[1]}"
            if s.get("nonfinite", 0) > 0 and self._nonfinite is None:
                self._nonfinite = Flag("nonfinite", label, step, s["nonfinite"])
            value, median = rms[key], medians[key[0]]
            if value is not None and math.isfinite(value) and key[0] != "forward":  # forward: sums
                low = median is not None and median > 0 and value < t.vanishing_ratio * median
                self._run("vanishing", label, step, low, t.vanishing_steps, value)
                history = self._track("exploding-rms", label).rms
                history.append(value)
                del history[: -t.exploding_window]
                floor = min(history)
                if len(history) > 1 and value > t.exploding_factor * floor:
                    self._raise("exploding", label, step, value)
            zero = s.get("zero_fraction")
            if zero is not None and key[0] in ("grad_output", "param_grad"):
                self._run("dead", label, step, zero >= t.dead_zero_fraction, t.dead_steps, zero)
            ratio = s.get("update_ratio")
            if ratio is not None and math.isfinite(ratio):
                if ratio > t.exploding_update_ratio:
                    self._raise("exploding", label, step, ratio)
                self._run("stalled", label, step, ratio < t.stalled_update_ratio, t.stalled_steps, ratio)

    def _track(self, check: str, label: str) -> _Track:
        return self._tracks.setdefault((check, label), _Track())

    def _run(self, flag: str, label: str, step: int, bad: bool, needed: int, value: float) -> None:
        track = self._track(flag, label)
        if not bad:
            track.start, track.length = None, 0
            return
        if track.start is None:
            track.start = step
        track.length += 1
        if track.length >= needed:
            self._raise(flag, label, track.start, value)

    def _raise(self, flag: str, label: str, since: int, value: float) -> None:
        previous = self._flags.get((flag, label))
        self._flags[(flag, label)] = Flag(flag, label, previous.since if previous else since, value)

    def flags(self) -> list[Flag]:
        """Every flag raised so far: non-finite first, then by flag, then by first step."""
        found = sorted(self._flags.values(), key=lambda f: (FLAGS.index(f.flag), f.since))
        return ([self._nonfinite] if self._nonfinite else []) + found

    def table(self) -> str:
        """The report as plain text: one line per flag, or one line saying nothing was seen."""
        flags = self.flags()
        if not flags:
            return f"GradHooks: no gradient problems seen in {self.steps} logged steps."
        rows = [("module", "flag", "since step", "last value")] + [
            (f.name, f.flag, str(f.since), f"{f.last:.3g}") for f in flags
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        header = f"GradHooks: {len(flags)} gradient problems in {self.steps} logged steps:"
        return "\n".join([header, *lines])

    def markdown(self) -> str:
        """The report as a Markdown table (TensorBoard's Text tab renders it)."""
        flags = self.flags()
        if not flags:
            return f"No gradient problems seen in {self.steps} logged steps."
        lines = ["| module | flag | since step | last value |", "|---|---|---|---|"]
        lines += [f"| `{f.name}` | {f.flag} | {f.since} | {f.last:.3g} |" for f in flags]
        return "\n".join(lines)

    def names(self, flags: set[str] | None = None) -> set[str]:
        """The flags present (optionally only among ``flags``)."""
        present = {f.flag for f in self.flags()}
        return present if flags is None else present & flags
