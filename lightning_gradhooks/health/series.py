""":class:`Rows`: subject labels numbered, the rows of a check's arrays (the tracker's runs,
:class:`Series`); :class:`Series`: a few values kept per subject label, for checks that compare a
value with a subject's own earlier ones (``exploding``'s baseline, ``activation_growth``'s early
level). Python and numpy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat

import numpy as np


class Rows:
    """Subject labels numbered in the order first seen: the rows of a check's arrays."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # subject label -> its row
        self.labels: list[str] = []
        self._seen: dict[int, tuple[Sequence[str], np.ndarray]] = {}  # lists of labels given, and their rows

    def of(self, labels: Sequence[str]) -> np.ndarray:
        """The rows of ``labels`` (new ones get new rows, in order); a list given before costs
        nothing (a check passes its layout's lists, the same objects at every step)."""
        seen = self._seen.get(id(labels))
        if seen is not None and seen[0] is labels:
            return seen[1]
        rows = self.rows
        found = np.fromiter(map(rows.get, labels, repeat(-1)), dtype=np.int64, count=len(labels))
        for i in np.flatnonzero(found < 0).tolist():
            found[i] = rows[labels[i]] = len(self.labels)
            self.labels.append(labels[i])
        if len(self._seen) >= 16:
            self._seen.clear()
        self._seen[id(labels)] = (labels, found)
        return found


class Series:
    """Per subject label, its kept values (at most ``length`` once :meth:`add` has cut them),
    oldest first: one row each in the order first seen, the values then +inf, their number in
    ``count``."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.rows = Rows()
        self.values = np.zeros((0, length))
        self.count = np.zeros(0, dtype=np.int64)

    def of(self, labels: Sequence[str]) -> np.ndarray:
        """The rows of ``labels`` (new ones get empty rows): :meth:`Rows.of`."""
        found = self.rows.of(labels)
        more = len(self.rows.labels) - len(self.count)
        if more:
            self.values = np.concatenate([self.values, np.full((more, self.values.shape[1]), np.inf)])
            self.count = np.concatenate([self.count, np.zeros(more, dtype=np.int64)])
        return found

    def median(self, rows: np.ndarray) -> np.ndarray:
        """The median of each row's values (the middle one, or the mean of the two: as
        ``statistics.median``); NaN for a row without values."""
        ordered = np.sort(self.values[rows], axis=1)  # (+inf after the values)
        count = self.count[rows]
        line, half = np.arange(len(rows)), count // 2
        return np.where(count == 0, np.nan, np.where(count % 2 == 1, ordered[line, half], (
            ordered[line, np.maximum(half - 1, 0)] + ordered[line, half]) / 2))

    def add(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Add a value to each of ``rows`` (each once), keeping their last ``length``."""
        history, count, length = self.values, self.count, self.length
        full = count[rows] >= history.shape[1]
        shifting = rows[full]
        history[shifting, :-1] = history[shifting, 1:]
        history[shifting, -1] = values[full]
        growing = rows[~full]
        history[growing, count[growing]] = values[~full]
        count[growing] += 1
        for row in rows[count[rows] > length].tolist():  # (a longer series loaded: cut to the last ``length``)
            kept = history[row, count[row] - length : count[row]].copy()
            history[row] = np.inf
            history[row, :length], count[row] = kept, length

    def state_dict(self) -> dict[str, list[float]]:
        """Each label's values, oldest first."""
        return {label: self.values[row, : self.count[row]].tolist() for row, label in enumerate(self.rows.labels)}

    def load_state_dict(self, state: Mapping[str, Sequence[float]]) -> None:
        series = {label: [float(v) for v in values] for label, values in state.items()}
        self.rows = Rows()
        self.rows.of(list(series))
        self.values = np.full((len(series), max([self.length, *map(len, series.values())])), np.inf)
        self.count = np.array([len(values) for values in series.values()], dtype=np.int64)
        for row, values in enumerate(series.values()):
            self.values[row, : len(values)] = values
