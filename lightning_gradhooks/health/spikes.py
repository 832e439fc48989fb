"""``spike``: an optimizer step whose gradient norm jumps far above its recent level, at the step
it happened, logged or not (``GradHooks(spikes=True)``). Python and numpy: no torch.

:class:`SpikeRule` judges the norms of every step (from
:class:`~lightning_gradhooks.core.spikes.StepNorms`, on the host) as they arrive; a spike becomes a
summary of its own (:func:`spike_summary`, entries of kind ``spike``) written at its step, from
which :class:`SpikeRows` makes the report's rows, at the end of fit and in the ``report``
command alike.

The rule is OLMo-core's (a step whose gradient norm passes mean + 6 sigma of the last 128 steps)
made robust to the spikes it looks for and to the spread of gradient norms, which is
multiplicative (a step's norm is its recent level times a noise factor, heavy-tailed at small
batches): over the logarithms of the last finite norms, the median absolute deviation of the
last ``SPREAD_STEPS`` (times 1.4826, a standard deviation for normal noise) is the spread, and
the median of the last ``LEVEL_STEPS`` the recent level (over a longer window, both lag behind
warmup and decay: the panel's runs fall 10-50x in their first hundred steps); a step is a spike when its norm is at least ``spike_z`` spreads above that level and at
least ``spike_factor`` times the level itself (so that a run whose norms barely vary does not
see a spike in a 20 % step). On the validation panel (tests/helpers/report_panel_runs.py, ``--spikes``;
docs/validation.md) no healthy run of the tune half named a spike, and 3 of 34 held-out run-seeds did. Steps whose norm is not finite (a gradient scaler's skipped
step, a NaN the sentinel caught) are not spikes: they are the scaler's and ``nonfinite``'s
business, and stay out of the window.

Example:
    >>> rule = SpikeRule(Thresholds())
    >>> names = ("a.weight", "b.weight")
    >>> found = [rule.add(step, names, np.array([1.0, 1.0 + 0.01 * (step % 5)])) for step in range(40)]
    >>> rule.add(40, names, np.array([1.0, 30.0])).carriers[0][0]
    'b'
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lightning_gradhooks.summary.text import counted
from lightning_gradhooks.summary.records import Key, Kind, Summary
from lightning_gradhooks.health.flags import Flag, Row
from lightning_gradhooks.health.thresholds import Thresholds

#: Steps in the window before any step is judged.
MIN_STEPS = 32
#: The recent level a step is compared with: the median of the last this many steps' norms ...
LEVEL_STEPS = 32
#: ... and the spread: the median absolute deviation of the last this many steps' log norms.
SPREAD_STEPS = 64
#: The modules' own recent level: the median of their last this many steps.
MODULE_WINDOW = 16
#: The modules a spike row names at most.
CARRIERS = 3
#: A spike at most this many steps after the one it follows is logged in full because of it, and
#: spikes at most this many steps apart are one row.
LR_STEPS = 2
#: A learning-rate change at most this many steps before a spike is said with it (a jump shows in
#: the gradient norm once the weights it moved have moved far enough: 1 to 3 steps on the panel).
LR_CHANGE_STEPS = 5
#: The name of a spike summary's entry of the whole step (the others are modules).
TOTAL = "(total)"
#: A learning rate that changes by this factor or more in one step has jumped.
LR_JUMP = 2.0
#: Spikes at most this many steps apart are one episode: one row.
EPISODE_GAP = 2
#: A standard deviation of normal noise, in median absolute deviations.
_MAD_SIGMA = 1.4826


class Spike(NamedTuple):
    """A spike at optimizer step ``step``: its total gradient ``norm``, the ``median`` of the
    ``window`` steps before it, the modules carrying most of it (``(module, share of the rise,
    ratio to its own recent level)``, biggest share first) and a learning-rate change just before
    it (``(step, before, after)``) or None."""

    step: int
    norm: float
    median: float
    window: int
    carriers: list[tuple[str, float, float]]
    lr_change: tuple[int, float, float] | None
    optimizer: int | None = None  # the optimizer whose step it is, of several


class SpikeRule:
    """Judges the gradient norms of every optimizer step, in step order (see the module).

    State (:meth:`state_dict`): the window of total norms, the modules' recent levels and the
    learning rates, so that a resumed run judges its first steps against the steps before.
    """

    def __init__(self, thresholds: Thresholds | None = None, optimizer: int | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self.optimizer = optimizer  # the optimizer whose steps it judges, of several (None: the only one)
        self.norms: deque[float] = deque(maxlen=self.thresholds.spike_window)
        self._names: tuple[str, ...] = ()
        self._modules: list[str] = []
        self._ids = np.zeros(0, dtype=np.int64)
        self._levels: deque[np.ndarray] = deque(maxlen=MODULE_WINDOW)  # each module's squared norm, per step
        self._lrs: list[float] = []
        self._lr_change: tuple[int, float, float] | None = None

    def add(self, step: int, names: Sequence[str], norms: np.ndarray, lrs: Sequence[float] | None = None) -> Spike | None:
        """Take the parameter gradient norms ``norms`` (of the parameters ``names``) of optimizer
        step ``step`` and the learning rates of its param groups; a :class:`Spike` if it is one."""
        self._learning_rates(step, lrs)
        total = math.sqrt(float(np.dot(norms, norms)))
        if not math.isfinite(total):
            return None  # the scaler's or the sentinel's step: not in the window either
        squares = self._module_squares(names, norms)
        spike = self._judge(step, total, squares)
        self.norms.append(total)
        self._levels.append(squares)
        return spike

    def _judge(self, step: int, total: float, squares: np.ndarray) -> Spike | None:
        if len(self.norms) < MIN_STEPS:
            return None
        t = self.thresholds
        logs = np.log(np.fromiter(self.norms, dtype=np.float64, count=len(self.norms)))
        recent = logs[-SPREAD_STEPS:]  # recent, so that level and spread follow a trend (warmup, decay)
        spread = _MAD_SIGMA * float(np.median(np.abs(recent - np.median(recent))))
        middle = float(np.median(logs[-LEVEL_STEPS:]))
        median = math.exp(middle)
        if not (total > 0 and median > 0 and total >= t.spike_factor * median
                and math.log(total) >= middle + t.spike_z * spread):
            return None
        lr_change = self._lr_change if self._lr_change is not None and step - self._lr_change[0] <= LR_CHANGE_STEPS else None
        return Spike(step, total, median, min(len(logs), LEVEL_STEPS), self._carriers(squares), lr_change, self.optimizer)

    def _carriers(self, squares: np.ndarray) -> list[tuple[str, float, float]]:
        """The modules whose squared norm rose most over their own recent level."""
        level = np.median(np.stack(self._levels), axis=0) if self._levels else np.zeros_like(squares)
        rise = np.maximum(squares - level, 0.0)
        if not rise.sum() > 0:
            return []
        order = np.argsort(-rise, kind="stable")[:CARRIERS]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.sqrt(squares / level)
        return [(self._modules[i], float(rise[i] / rise.sum()), float(ratios[i])) for i in order.tolist()
                if rise[i] > 0]

    def _module_squares(self, names: Sequence[str], norms: np.ndarray) -> np.ndarray:
        names = tuple(names)
        if names is not self._names and names != self._names:  # another set of gradients: the modules' levels start over
            self._names = names
            ids: dict[str, int] = {}
            self._ids = np.array([ids.setdefault(n.rpartition(".")[0] or "(model)", len(ids)) for n in names], dtype=np.int64)
            self._modules = list(ids)
            self._levels.clear()
        return np.bincount(self._ids, weights=np.square(norms), minlength=len(self._modules))

    def _learning_rates(self, step: int, lrs: Sequence[float] | None) -> None:
        if lrs is None:
            return
        lrs = [float(lr) for lr in lrs]
        if self._lrs and len(lrs) == len(self._lrs):
            # a jump (x2 or /2 in one step), not a schedule's smooth decay
            changed = [(a, b) for a, b in zip(self._lrs, lrs) if b > LR_JUMP * a or a > LR_JUMP * b]
            if changed:
                self._lr_change = (step, *changed[0])
        self._lrs = lrs

    def state_dict(self) -> dict[str, Any]:
        """The window, the modules' levels and the learning rates, as plain Python values."""
        return {"norms": list(self.norms), "names": list(self._names),
                "levels": [level.tolist() for level in self._levels], "lrs": list(self._lrs),
                "lr_change": list(self._lr_change) if self._lr_change is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict`."""
        self.norms = deque((float(v) for v in state["norms"]), maxlen=self.thresholds.spike_window)
        self._names = ()
        self._module_squares(state["names"], np.zeros(len(state["names"])))
        self._levels.extend(np.array(level, dtype=np.float64) for level in state["levels"])
        self._lrs = [float(v) for v in state["lrs"]]
        change = state.get("lr_change")
        self._lr_change = (int(change[0]), float(change[1]), float(change[2])) if change else None


def spike_summary(spike: Spike) -> Summary:
    """The summary written at a spike's step (entries of kind ``spike``): what the report and the
    ``report`` command read back (:class:`SpikeRows`)."""
    total = {"norm": spike.norm, "median": spike.median, "ratio": spike.norm / spike.median, "window": float(spike.window)}
    if spike.lr_change is not None:
        total.update(lr_step=float(spike.lr_change[0]), lr_before=spike.lr_change[1], lr_after=spike.lr_change[2])
    summary: Summary = {Key(Kind.SPIKE, TOTAL, spike.optimizer): total}
    for module, share, ratio in spike.carriers:
        summary[Key(Kind.SPIKE, module, spike.optimizer)] = {"share": share, "ratio": ratio}
    return summary


def is_spike(stats: Mapping[Any, Any]) -> bool:
    """Whether a step's summary is a spike's (:func:`spike_summary`) and nothing else."""
    return bool(stats) and all(key[0] == Kind.SPIKE for key in stats)


class SpikeRows:
    """The ``spike`` rows of a run, from the spike summaries given (:meth:`take`), in step order;
    each row names the next logged step, logged in full after it."""

    def __init__(self) -> None:
        self.spikes: dict[tuple[int, int | None], Summary] = {}  # (step, optimizer) -> its summary

    def take(self, step: int, stats: Mapping[Any, Mapping[str, float]]) -> None:
        """Take the spike summaries of ``step`` (one per optimizer that spiked)."""
        for key, values in stats.items():
            key = key if isinstance(key, Key) else Key(*key)
            self.spikes.setdefault((step, key.optimizer), {})[key] = dict(values)

    def rows(self, logged: Sequence[int]) -> list[Row]:
        """The rows, in step order: one per episode of an optimizer (spikes at most
        ``EPISODE_GAP`` steps apart, told from its first step, its worst and its last);
        ``logged``: the logged steps the judge saw."""
        episodes: list[list[tuple[int, int | None]]] = []
        for optimizer in sorted({o for _, o in self.spikes}, key=lambda o: -1 if o is None else o):
            for at in sorted(s for s in self.spikes if s[1] == optimizer):
                if episodes and episodes[-1][-1][1] == optimizer and at[0] - episodes[-1][-1][0] <= EPISODE_GAP:
                    episodes[-1].append(at)
                else:
                    episodes.append([at])
        rows = []
        for steps in sorted(episodes):
            row = _row(steps[0][0], self.spikes[steps[0]], logged)
            if len(steps) > 1:
                ratios = {s: self.spikes[s].get(Key(Kind.SPIKE, TOTAL, s[1]), {}).get("ratio", math.nan) for s in steps}
                worst = max(steps, key=lambda s: ratios[s])
                row.detail += (f"; {counted(len(steps) - 1, 'more spike step')} to step {steps[-1][0]} "
                               f"(worst x{ratios[worst]:.3g} at step {worst[0]})")
                row.value = row.score = max(row.value, ratios[worst])
            rows.append(row)
        return rows

    def flags(self) -> list[Flag]:
        return [Flag("spike", "", row.module, row.since, row.value, row.module, row.score) for row in self.rows(())]

    def state_dict(self) -> dict[str, Any]:
        return {"spikes": [[step, [[str(k.kind), k.name, k.optimizer, v] for k, v in stats.items()]]
                           for (step, _), stats in self.spikes.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.spikes = {}
        for step, stats in state.get("spikes", []):
            self.take(int(step), {Key(Kind(k), n, o): v for k, n, o, v in stats})


def _row(step: int, stats: Summary, logged: Sequence[int]) -> Row:
    total = next((values for key, values in stats.items() if key.name == TOTAL), {})
    ratio, median, window = total.get("ratio", math.nan), total.get("median", math.nan), int(total.get("window", 0))
    carriers = [(key.label, values) for key, values in stats.items() if key.name != TOTAL]
    detail = (f"gradient norm {total.get('norm', math.nan):.3g}, x{ratio:.3g} the median ({median:.3g}) of the "
              f"{counted(window, 'step')} before it")
    if carriers:
        detail += "; carried by " + ", ".join(f"`{m}` (x{v.get('ratio', math.nan):.3g}, {v.get('share', 0.0):.0%} of the rise)"
                                             for m, v in carriers)
    if "lr_step" in total:
        when = "at" if step - int(total["lr_step"]) <= 1 else "after"
        detail += (f"; {when} a learning-rate change (step {int(total['lr_step'])}: {total['lr_before']:.3g} -> "
                   f"{total['lr_after']:.3g})")
    after = next((s for s in logged if s > step), None)
    if after is not None and after - step <= LR_STEPS:  # the step logged in full because of it
        detail += f"; step {after} logged in full after it"
    module = carriers[0][0] if carriers else "(model)"
    return Row("spike", module, step, ratio, detail, [f"spike {m}" for m, _ in carriers], score=ratio)
