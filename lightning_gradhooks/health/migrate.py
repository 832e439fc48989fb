"""The judge's state of earlier releases, in today's shape: every migration in one place. Pure Python.

- version 1: flags named ``"<kind> <entry>"``, summary keys ``(kind, name)`` with ``optimizer_<i>/``
  in the name;
- version 2: one flat dictionary (the judge was one class): runs of every check in ``tracks``
  (the exploding baseline as ``history`` tracks, round-off runs as ``no_gradient`` tracks);
- version 3 (:data:`VERSION`): the judge's own (``seen``, ``pending``), the ``tracker``'s, the
  ``shape``'s, and each check's under its name in ``checks`` (a check absent there starts fresh:
  the forward checks ``attention_logits`` and ``activation_growth`` came after version 3, and
  start at the resume from a state without them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_gradhooks.summary.records import Key

#: The version of the state a judge writes.
VERSION = 3


def upgrade(state: Mapping[str, Any], reader: str) -> Mapping[str, Any]:
    """``state`` of any version read, as of :data:`VERSION`.

    Raises:
        ValueError: ``state`` is not a state of a version read (``reader`` names who reads it).
    """
    version = state.get("version") if isinstance(state, Mapping) else None
    if version not in (1, 2, VERSION):
        got = version if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{reader}.load_state_dict expected a state of version 1, 2 or {VERSION}, got {got!r}")
    if version == 1:
        state = _from_version_1(state)
    if state["version"] == 2:
        state = _from_version_2(state)
    return state


def _split_label(label: str) -> tuple[str, str]:
    """``"<kind> <entry>"`` (version 1's flag names and track labels) as ``(kind, entry)``; a
    module's own label has no kind."""
    kind, space, entry = label.partition(" ")
    return (kind, entry) if space else ("", label)


def _from_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
    def flag(f: Mapping[str, Any]) -> dict[str, Any]:
        kind, entry = _split_label(f["name"])
        return {**{k: v for k, v in f.items() if k != "name"}, "kind": kind, "entry": entry}

    def subject(label: str) -> list[str]:
        kind, entry = _split_label(label)
        return [kind, entry, Key.of_label(kind, entry).module if kind else entry]

    row = state["nonfinite"]
    return {
        **state,
        "version": 2,
        "flags": [flag(f) for f in state["flags"]],
        "tracks": [[c, label, start, length, values, last, score, subject(label)]
                   for c, label, start, length, values, last, score in state["tracks"]],
        "nonfinite": None if row is None else {**row, "consequences": [flag(f) for f in row["consequences"]]},
        "notes": [flag(f) for f in state["notes"]],
        "pending": [[step, [[k, key.name, key.optimizer, s] for k, n, s in stats for key in [Key.of_label(k, n)]]]
                    for step, stats in state["pending"]],
    }


def _from_version_2(state: Mapping[str, Any]) -> dict[str, Any]:
    runs, history, round_off = [], {}, {}
    for check, label, start, length, values, last, score, subject in state["tracks"]:
        if check == "history":  # the exploding check's baseline
            history[label] = list(values)
        elif check == "no_gradient":  # the round-off check's runs
            if start is not None:
                round_off[label] = [start, length]
        else:
            runs.append([check, label, start, length, last, score, subject])
    return {
        "version": VERSION,
        "seen": state["seen"],
        "pending": state["pending"],
        "tracker": {"runs": runs, "flags": state["flags"], "notes": state["notes"], "nonfinite": state["nonfinite"]},
        "shape": {"order": state["order"], "sizes": state["sizes"], "zero_grads": state["zero_grads"]},
        "checks": {
            "exploding": {"history": history},
            "round_off": {"runs": round_off},
            "lr_cut": {"peaks": dict(state.get("lr_peaks", {}))},
            "no_gradient": {"since": dict(state.get("no_grad", {}))},
        },
    }
