"""Argument checks shared by ``GradHooks``, ``GradientMonitor``, ``save_on_disk`` and the report's ``Thresholds``.

Every check runs at construction and raises a ``ValueError`` that names the argument, says what
is accepted and shows the value received::

    `histogram_bins` expected an int from 1 to 4096, got 1000000000000

Each returns the value to keep (a list made from a tuple of patterns, a folder as a ``str``), so
that a constructor checks and converts in one line. Pure Python: no torch, no Lightning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

#: The most histogram bins anywhere (``GradHooks(histogram_bins=)``, ``GradientMonitor(bins=)``):
#: TensorBoard shows ~30 buckets, and every bin costs bytes in every histogram event and memory in
#: every reduction.
MAX_BINS = 4096


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    argument: str, value: object, minimum: int = 1, maximum: int | None = None, allow_none: bool = False
) -> int | None:
    """``value`` if it is an int (not a bool) from ``minimum`` to ``maximum`` (or None, if allowed)."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        if maximum is not None:
            accepted = f"an int from {minimum} to {maximum}"
        else:
            accepted = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"`{argument}` expected {accepted}{' or None' if allow_none else ''}, got {value!r}")
    return value


def check_number(
    argument: str, value: object, low: float, high: float | None = None, closed: tuple[bool, bool] = (True, True)
) -> float:
    """``value`` as a float if it is a finite number (not a bool) from ``low`` to ``high`` (None: no
    upper end), each end included or not as ``closed`` says."""
    if high is None:
        accepted = f"{'>=' if closed[0] else '>'} {low:g}"
    else:
        accepted = f"in {'[' if closed[0] else '('}{low:g}, {high:g}{']' if closed[1] else ')'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{argument}` expected a finite number {accepted}, got {value!r}")
    below = value < low if closed[0] else value <= low
    above = high is not None and (value > high if closed[1] else value >= high)
    if below or above:
        raise ValueError(f"`{argument}` expected a number {accepted}, got {value!r}")
    return float(value)


def check_bool(argument: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``: ``"no"``, ``0`` or ``None`` are refused, not read as truth values."""
    if not isinstance(value, bool):
        raise ValueError(f"`{argument}` expected a bool (True or False), got {value!r}")
    return value


def _strings(value: object) -> bool:
    """A list or tuple of str. Generators (used up by a single look), sets (no order) and a bare str
    (a pattern, or an iterable of one-letter patterns?) are refused rather than guessed at."""
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def check_patterns(argument: str, value: object, allow_empty: bool = True) -> list[str] | None:
    """``value`` as a list of glob patterns, or None.

    ``allow_empty=False`` (``include``): an empty list is refused, since it could mean "nothing"
    or "the default selection"; None is the default selection.
    """
    if value is None:
        return None
    if not _strings(value) or (not value and not allow_empty):
        accepted = "a list of glob patterns (str)" if allow_empty else "a non-empty list of glob patterns (str)"
        raise ValueError(f"`{argument}` expected {accepted} or None, got {value!r}")
    return list(value)


def check_choices(argument: str, value: object, choices: Sequence[str]) -> list[str]:
    """``value`` as a list of names, each one of ``choices``."""
    if not _strings(value) or not all(v in choices for v in value):
        raise ValueError(f"`{argument}` expected a list drawn from {list(choices)}, got {value!r}")
    return list(value)


def check_folder(argument: str, value: object, pathlike: bool = False) -> str | None:
    """``value`` as a ``str`` path, or None: a ``str`` (or ``os.PathLike`` if ``pathlike``) that is
    not empty and holds no NUL byte. Whether the folder exists is for the offload engine to say."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike) if pathlike else str):
        accepted = "a str, os.PathLike or None" if pathlike else "a str or None"
        raise ValueError(f"`{argument}` expected {accepted}, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or path == "" or "\0" in path:
        raise ValueError(f"`{argument}` expected a non-empty path without NUL bytes, got {value!r}")
    return path


def check_needs(argument: str, value: object, needed: str, needed_value: object, off: str) -> None:
    """``argument`` set (not None) needs ``needed`` set too; ``off``: what ``needed=None`` means."""
    if value is not None and needed_value is None:
        raise ValueError(f"`{argument}` expected `{needed}` to be set too, got {argument}={value!r} "
                         f"with {needed}=None ({off})")


def check_overrides(argument: str, value: object, known: Sequence[str]) -> dict:
    """``value`` as a dict whose keys are among ``known`` (None: an empty dict)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not set(value) <= set(known):
        raise ValueError(f"`{argument}` expected a dict with keys from {sorted(known)}, got {value!r}")
    return dict(value)


def check_instance(argument: str, value: object, accepted: type | tuple[type, ...], described: str) -> object:
    """``value`` if it is an instance of ``accepted`` (``described`` in the message)."""
    if not isinstance(value, accepted):
        raise ValueError(f"`{argument}` expected {described}, got {type(value).__name__}")
    return value
