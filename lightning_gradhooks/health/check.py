"""The base of every check (see :mod:`lightning_gradhooks.health` for the interface). Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from lightning_gradhooks.health.step import Step
from lightning_gradhooks.health.thresholds import Thresholds
from lightning_gradhooks.health.tracker import Tracker


class Check:
    """One check: reads a :class:`~lightning_gradhooks.health.step.Step`, steps runs and raises
    flags in the :class:`~lightning_gradhooks.health.tracker.Tracker`, may write the step's fields
    that later checks read. A check with state of its own overrides :meth:`state_dict` and
    :meth:`load_state_dict` (plain Python values, saved under its :attr:`name`)."""

    #: The check's name: its key in the judge's state.
    name: ClassVar[str] = ""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds

    def __call__(self, step: Step, tracker: Tracker) -> None:
        raise NotImplementedError

    def note(self) -> str | None:
        """One line for the end of the report (``note: ...``), never a flag; None: nothing to say."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a stateless check has nothing to load)."""
