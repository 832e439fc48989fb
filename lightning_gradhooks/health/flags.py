"""What the judge decides: :class:`Flag` (one flagged entry), :class:`Row` (a line of the grouped
report), :class:`Subject` (what a check judges) and the constants the checks share. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_gradhooks.summary.records import Key

#: The flags, worst first: the order the report lists them in.
FLAGS = ("nonfinite", "exploding", "spike", "attention_logits", "activation_growth", "vanishing", "dead", "stalled")
#: The flags on the forward pass: what a gradient flag on the same module or downstream may follow.
FORWARD_FLAGS = ("attention_logits", "activation_growth")
#: A norm whose square is beyond float32: what float32 norms (``clip_grad_norm_``) see as Inf.
OVERFLOW_NORM = math.sqrt(3.4028234663852886e38)
#: Why a parameter that gets gradients is ``stalled`` at once: no optimizer holds it.
UNOWNED = "in no optimizer: it gets gradients, but nothing steps it"
#: The kind of a flag on a param group (its learning rate).
PARAM_GROUP = "param_group"


@dataclass(frozen=True)
class Flag:
    """One flagged entry: ``flag`` (one of :data:`FLAGS`, or ``"note"``) on the entry ``entry`` of
    kind ``kind`` (a module's own flag, ``dead``: kind ``""`` and the module as ``entry``) since
    logged step ``since``; ``last`` is the statistic's latest value (RMS, zero fraction, update
    ratio or NaN count); ``module`` the module the entry belongs to."""

    flag: str
    kind: str
    entry: str
    since: int
    last: float
    module: str = ""
    score: float = 0.0  # how bad, within the flag: higher is worse
    reason: str = ""  # a reason other than the flag's own definition (``UNOWNED``)

    @property
    def name(self) -> str:
        """The entry as the full table names it: ``"<kind> <entry>"``, or the module alone."""
        return f"{self.kind} {self.entry}" if self.kind else self.entry


@dataclass
class Row:
    """One line of the grouped report: a flag on a module, its entries folded in, and the
    flags that follow from it (upstream modules, stalled parameters) under it."""

    flag: str
    module: str
    since: int
    value: float
    detail: str
    entries: list[str] = field(default_factory=list)
    consequences: list[Flag] = field(default_factory=list)
    score: float = 0.0


class Subject(NamedTuple):
    """What a check judges: an entry (its kind, its name as written, its module), or a module
    (kind ``""``)."""

    kind: str
    entry: str
    module: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.entry}" if self.kind else self.entry

    @classmethod
    def of(cls, key: Key) -> Subject:
        return cls(str(key.kind), key.label, key.module)
