"""Small text helpers shared by the messages and the report."""

from __future__ import annotations

from collections.abc import Sequence


def listed(names: Sequence[str], limit: int = 8) -> str:
    """``a, b, c and 5 more``: names for a one-line message.

    Example:
        >>> listed(["a", "b", "c"], limit=2)
        'a, b and 1 more'
    """
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """``counted(1, "logged step")`` -> ``"1 logged step"``; ``counted(2, "entry", "entries")`` -> ``"2 entries"``."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
