"""The gradient-flow picture and the custom-scalars layout, for TensorBoard.

:class:`GradientFlow` keeps, for every module, the per-element RMS of its ``grad_output``
(``norm / sqrt(count)``) at each logged step, and draws one image of two panels:

- left, a heatmap: modules in forward order (top to bottom) by logged steps so far (left to
  right), colour = ``log10`` of the RMS; a module that vanishes is a dark row, an explosion a
  bright column;
- right, the current step's RMS per module as bars on a log scale: the classic
  "gradient flow" plot.

Drawing needs matplotlib (``pip install lightning-gradhooks[plots]``); :func:`have_matplotlib`
says whether it is there. The image is ``WIDTH`` pixels wide and :func:`image_height` high.

Drawing is host work of 0.1 s to 1 s (more modules, more tick labels), so the picture is not
drawn at every logged step: :meth:`GradientFlow.due` allows a drawing while the time spent
drawing stays within :data:`DRAW_BUDGET` of the time since the first logged step, and the
callback draws the last logged step at the end of fit. The heatmap holds every logged step, so
a skipped drawing loses no data.
"""

from __future__ import annotations

import math
import time
from typing import Any

from lightning_gradhooks.records import GradientRecord
from lightning_gradhooks.stats import STATISTICS

WIDTH = 960
DPI = 96
#: Steps the heatmap keeps; older columns are dropped (the scalars keep everything).
MAX_STEPS = 400
#: Module names on the heatmap's axis at most (every k-th module past that: 1,600 px hold ~110).
MAX_LABELS = 100
#: Share of the wall time since the first logged step that drawing may take.
DRAW_BUDGET = 0.02


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def image_height(modules: int) -> int:
    """Pixels: 180 plus 14 per module, between 320 and 1600."""
    return min(max(180 + 14 * modules, 320), 1600)


class GradientFlow:
    """RMS of each module's ``grad_output`` per logged step, drawn as heatmap plus bars."""

    def __init__(self) -> None:
        self.modules: list[str] = []  # forward order
        self.steps: list[int] = []
        self.rms: list[dict[str, float]] = []
        #: The last step drawn, and the time spent drawing so far.
        self.drawn: int | None = None
        self.draw_seconds = 0.0
        self._started: float | None = None

    def due(self) -> bool:
        """Whether the latest step should be drawn now: the first one always, later ones while
        the drawing time stays within :data:`DRAW_BUDGET` of the time since the first."""
        if not self.steps or self.drawn == self.steps[-1]:
            return False
        return self._started is None or self.draw_seconds <= DRAW_BUDGET * (time.perf_counter() - self._started)

    def add(self, step: int, record: GradientRecord) -> None:
        """Take in a logged step's record (its ``grad_output`` entries, in backward order)."""
        values = {}
        for entry in record.entries:
            if entry.kind == "grad_output" and entry.count > 0:
                values[entry.name] = entry.stats["norm"] / math.sqrt(entry.count)
        if not values:
            return
        order = list(reversed(list(values)))
        if any(n not in self.modules for n in order):  # this step's order, then modules not in it
            self.modules = order + [n for n in self.modules if n not in values]
        self.steps.append(step)
        self.rms.append(values)
        del self.steps[:-MAX_STEPS], self.rms[:-MAX_STEPS]

    def image(self) -> Any:
        """The picture of the latest step as an ``(height, WIDTH, 3)`` uint8 numpy array (needs
        matplotlib); the time it takes counts against :data:`DRAW_BUDGET`."""
        begin = time.perf_counter()
        self._started = begin if self._started is None else self._started
        try:
            return self._draw()
        finally:
            self.drawn = self.steps[-1]
            self.draw_seconds += time.perf_counter() - begin

    def _draw(self) -> Any:
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        n = len(self.modules)
        height = image_height(n)
        grid = np.full((n, len(self.steps)), np.nan)
        for j, values in enumerate(self.rms):
            for i, name in enumerate(self.modules):
                value = values.get(name)
                if value is not None and value > 0 and math.isfinite(value):
                    grid[i, j] = math.log10(value)
        figure = Figure(figsize=(WIDTH / DPI, height / DPI), dpi=DPI)
        FigureCanvasAgg(figure)
        heat, bars = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1]})
        shown = heat.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=(-0.5, len(self.steps) - 0.5, n - 0.5, -0.5))
        figure.colorbar(shown, ax=bars, label="log10 RMS of grad_output")
        every = -(-n // MAX_LABELS)  # more labels than fit would overlap, and cost seconds to lay out
        heat.set_yticks(range(0, n, every), self.modules[::every], fontsize=max(5, min(9, 700 // max(n, 1))))
        ticks = sorted({0, len(self.steps) - 1, *range(0, len(self.steps), max(1, len(self.steps) // 8))})
        heat.set_xticks(ticks, [str(self.steps[t]) for t in ticks], fontsize=8)
        heat.set_xlabel("logged step")
        heat.set_title("gradient flow (modules in forward order)", fontsize=10)
        current = np.nan_to_num(10 ** grid[:, -1], nan=0.0) if n else np.zeros(0)
        bars.barh(range(n), np.where(current > 0, current, np.nan), color="tab:blue")
        if (current > 0).any():
            bars.set_xscale("log")
        bars.set_xlabel(f"RMS at step {self.steps[-1]}")
        figure.subplots_adjust(left=0.2, right=0.97, bottom=max(0.06, 60 / height), top=1 - max(0.04, 40 / height), wspace=0.05)
        figure.canvas.draw()
        return np.asarray(figure.canvas.buffer_rgba())[:, :, :3].copy()


def custom_scalars_layout(statistics: list[str], kinds: tuple[str, ...] = ("grad_output", "grad_input", "param_grad")) -> dict:
    """A layout for ``SummaryWriter.add_custom_scalars``: one multi-line chart per statistic and
    kind with every module on it, and one each for the update ratio and the parameter norm."""
    charts = {f"{kind}_{stat}": ["Multiline", [rf"^{kind}_{stat}/"]] for kind in kinds for stat in STATISTICS if stat in statistics}
    for stat, tag in (("update_ratio", "param_update_ratio"), ("param_norm", "param_norm")):
        if stat in statistics:
            charts[tag] = ["Multiline", [rf"^{tag}/"]]
    return {"GradHooks": charts}
