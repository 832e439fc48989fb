"""The gradient-flow picture and the custom-scalars layout, for TensorBoard.

:class:`GradientFlow` keeps, for every module, the RMS of its ``grad_output`` at each logged
step (:func:`~lightning_gradhooks.summary.records.rms`, over the non-zero elements: the health report's
RMS, so the picture and the report agree), and draws one image of two panels that share one
colour scale, ``log10`` of the RMS:

- left, a heatmap: modules in forward order (top to bottom) by logged steps so far (left to
  right); a module that vanishes is a dark row, an explosion a bright column; black is a
  gradient that is all zero, grey no gradient at that step;
- right, the current step as bars: each bar ends at the module's ``log10`` RMS, on a linear axis
  that is the colour bar itself (drawn under the bars, labelled "log10 RMS of grad_output"),
  and is coloured like the heatmap's last column. A bar one unit longer is 10x the RMS, as one
  colour step is: the two panels cannot disagree. :func:`flow_data` computes the numbers both
  panels are drawn from.

The image is :data:`WIDTH` x :data:`HEIGHT` pixels (3:2) with fonts :data:`FONT_PX` pixels
high, for TensorBoard's Time Series card, which shows an image at most ~370 x 215 pixels (the
card's height is fixed; ``object-fit: contain``, scaled without smoothing): a wide image is
shown bigger there than a square one (215 x 215), and its fonts stay ~10 pixels high. Module
names longer than :data:`LABEL_CHARS` keep their last dotted parts (``…42.linear``), and every
k-th one is written when they do not all fit.

Drawing needs matplotlib (``pip install lightning-gradhooks[plots]``); :func:`have_matplotlib`
says whether it is there. Drawing is host work of ~0.1 s, so the picture is not drawn at every
logged step: :meth:`GradientFlow.due` allows a drawing while the time spent drawing stays within
:data:`DRAW_BUDGET` of the time since the first logged step, and
:meth:`~lightning_gradhooks.log.GradientLog.close` draws the last logged step (at the end of fit
with the callback). The heatmap holds every logged step, so a skipped drawing loses no data.

:func:`custom_scalars_layout` is the Custom Scalars tab: per statistic, charts of at most
:data:`MAX_LINES` modules each, a block of the model per chart (modules grouped by their name's
prefix, ``blocks.3``, ``encoder.layers.0``: neighbours in depth, whose lines are worth
comparing). One chart with every module on it was unreadable (150 lines on a ViT, all one
colour); the gradient-flow picture already shows every module at once, so the charts are for
reading values within a block. ``*_nonfinite`` charts are left out: a module's non-finite count
is only written once it is non-zero, so on a healthy run they were empty; the overview charts
hold the run's total instead.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from lightning_gradhooks.log._tensorboard import FORWARD, FORWARD_CHARTS, OVERVIEW, UPDATE_SECTIONS, forward_chart, section
from lightning_gradhooks.summary.records import GRADIENT_KINDS, GradientRecord, Kind, rms
from lightning_gradhooks.summary.statistics import STATISTICS

WIDTH = 720
HEIGHT = 400
DPI = 100
#: Font height in pixels: ~12 pixels on TensorBoard's card, which shows the image at ~0.5x.
FONT_PX = 24
_FONT = FONT_PX * 72 / DPI  # in points
#: Longer module names keep their last dotted parts that fit (``…11.mlp.c_proj``).
LABEL_CHARS = 14
#: Steps the heatmap keeps; older columns are dropped (the scalars keep everything).
MAX_STEPS = 400
#: Share of the wall time since the first logged step that drawing may take.
DRAW_BUDGET = 0.02
#: Lines per Custom Scalars chart at most.
MAX_LINES = 12


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class FlowData(NamedTuple):
    """The numbers the picture is drawn from.

    Attributes:
        grid: ``log10`` RMS, one row per module (forward order), one column per step; ``-inf``
            for an RMS of zero, ``nan`` where the module has no finite value at that step.
        bars: the bars' ends: the grid's last column.
        limits: the colour scale and the bars' axis, ``(low, high)``, with room below the
            smallest value so that its bar shows.
    """

    grid: Any
    bars: Any
    limits: tuple[float, float]


def flow_data(modules: Sequence[str], rms: Sequence[dict[str, float]]) -> FlowData:
    """The heatmap, the bars and their common scale, from each step's RMS per module."""
    import numpy as np

    nan = math.nan
    grid = np.array([[values.get(name, nan) for values in rms] for name in modules], dtype=float).reshape(len(modules), len(rms))
    with np.errstate(divide="ignore", invalid="ignore"):
        grid = np.where(np.isfinite(grid) & (grid >= 0), np.log10(grid), nan)  # log10(0) = -inf
    finite = grid[np.isfinite(grid)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 0.0)
    if high - low < 0.5:  # one value, or nearly: half a decade around it
        low, high = (low + high) / 2 - 0.25, (low + high) / 2 + 0.25
    low -= 0.05 * (high - low)  # the smallest bar has a length
    bars = grid[:, -1].copy() if len(rms) else np.zeros(0)
    return FlowData(grid, bars, (low, high))


def _shortened(name: str) -> str:
    """``name``, or its last dotted parts that fit in :data:`LABEL_CHARS` after an ellipsis."""
    if len(name) <= LABEL_CHARS:
        return name
    tail = name[-(LABEL_CHARS - 1) :]
    cut = re.search(r"[./]", tail)
    return "…" + (tail[cut.end() :] if cut and len(tail) - cut.end() >= LABEL_CHARS // 2 else tail)


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
            if entry.kind != Kind.GRAD_OUTPUT or entry.count == 0:
                continue
            value = rms(entry.stats._asdict())
            if value is not None or entry.stats.absmax == 0:  # all zero: drawn black
                values[entry.key.label] = value or 0.0
        if not values:
            return
        order = list(reversed(list(values)))
        if any(n not in self.modules for n in order):  # this step's order, then modules not in it
            self.modules = order + [n for n in self.modules if n not in values]
        self.steps.append(step)
        self.rms.append(values)
        del self.steps[:-MAX_STEPS], self.rms[:-MAX_STEPS]

    def state_dict(self) -> dict[str, Any]:
        """The history the picture is drawn from (plain Python values, for a checkpoint)."""
        return {"modules": list(self.modules), "steps": list(self.steps), "rms": [dict(v) for v in self.rms]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: later steps are drawn after the history it holds."""
        self.modules, self.steps = list(state["modules"]), [int(s) for s in state["steps"]]
        self.rms = [dict(v) for v in state["rms"]]

    def image(self) -> Any:
        """The picture of the latest step as a ``(HEIGHT, WIDTH, 3)`` uint8 numpy array (needs
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

        figure = self.figure()
        figure.canvas.draw()
        return np.asarray(figure.canvas.buffer_rgba())[:, :, :3].copy()

    def figure(self) -> Any:
        """The matplotlib ``Figure`` of the latest step (not yet rendered)."""
        import matplotlib
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure

        data = flow_data(self.modules, self.rms)
        n, columns = data.grid.shape
        figure = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
        FigureCanvasAgg(figure)
        labels = [_shortened(m) for m in self.modules]
        heat, bars, strip_axes, plot_height = _axes(figure, labels)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85", under="black")
        norm = Normalize(*data.limits)
        shown = heat.imshow(
            np.where(np.isneginf(data.grid), data.limits[0] - 1, data.grid),  # a zero RMS: "under", not masked
            aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
            extent=(-0.5, columns - 0.5, n - 0.5, -0.5),
        )
        _bars(bars, data, cmap, norm, self.steps[-1])
        _colour_bar(figure, shown, strip_axes)
        _heat_ticks(heat, labels, [self.steps[t] for t in range(columns)], plot_height)
        return figure


def _axes(figure: Any, labels: list[str]) -> tuple[Any, Any, Any, float]:
    """The heatmap's, the bars' and the colour bar's axes, placed in pixels: labels on the left,
    heatmap, bars; under the bars, the colour bar is their axis; under everything, the two axis
    titles on one line. Also the plots' height in pixels."""
    left = 12 + 0.6 * FONT_PX * max((len(s) for s in labels), default=1)
    bottom, top, gap, right = 2.6 * FONT_PX + 14, FONT_PX + 12, 10, 16
    strip = 0.7 * FONT_PX
    bars_width = 0.3 * (WIDTH - left - right)
    heat_width = WIDTH - left - right - gap - bars_width
    plot_bottom = bottom + strip + 4
    plot_height = HEIGHT - plot_bottom - top

    def box(x: float, y: float, w: float, h: float) -> list[float]:
        return [x / WIDTH, y / HEIGHT, w / WIDTH, h / HEIGHT]

    heat = figure.add_axes(box(left, plot_bottom, heat_width, plot_height))
    bars = figure.add_axes(box(left + heat_width + gap, plot_bottom, bars_width, plot_height), sharey=heat)
    strip_axes = figure.add_axes(box(left + heat_width + gap, bottom, bars_width, strip))
    return heat, bars, strip_axes, plot_height


def _bars(bars: Any, data: FlowData, cmap: Any, norm: Any, step: int) -> None:
    """The bars, on the colour scale: from its low end to log10 RMS, coloured alike."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    n = len(data.bars)
    low = data.limits[0]
    ends = np.where(np.isfinite(data.bars), data.bars, low)
    x0, y = low, np.arange(n)[:, None]
    boxes = np.stack([np.broadcast_to(x0, (n, 4)), y + [-0.4, 0.4, 0.4, -0.4]], axis=2)
    boxes[:, 2:, 0] = ends[:, None]  # one collection: 500 bar patches take ~0.5 s to draw
    bars.add_collection(PolyCollection(boxes, facecolors=cmap(norm(ends)), linewidths=0))
    bars.set_xlim(*data.limits)
    bars.tick_params(left=False, labelleft=False, bottom=False, labelbottom=False)
    bars.set_title(f"step {step}", fontsize=_FONT, pad=4, loc="right")


def _colour_bar(figure: Any, shown: Any, strip_axes: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    bar = figure.colorbar(shown, cax=strip_axes, orientation="horizontal")
    bar.set_label("log10 RMS of grad_output", fontsize=_FONT, loc="right", labelpad=2)
    strip_axes.xaxis.set_major_locator(MaxNLocator(nbins=3, steps=[1, 2, 5, 10]))
    strip_axes.tick_params(labelsize=_FONT, length=3, pad=2)


def _heat_ticks(heat: Any, labels: list[str], steps: list[int], plot_height: float) -> None:
    """The heatmap's module labels (as many as fit) and a few logged steps."""
    from matplotlib.ticker import MaxNLocator

    n, columns = len(labels), len(steps)
    rows = max(1, int(plot_height // (1.25 * FONT_PX)))
    every = -(-n // rows)  # more labels than fit would overlap
    heat.set_yticks(range(0, n, every), labels[::every], fontsize=_FONT)
    heat.tick_params(axis="y", length=2, pad=2)
    ticks = MaxNLocator(nbins=3, integer=True, min_n_ticks=1).tick_values(0, columns - 1)
    ticks = [int(t) for t in ticks if 0 <= t <= columns - 1] or [0]
    heat.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=_FONT)
    heat.tick_params(axis="x", length=3, pad=2)
    heat.set_xlabel("logged step", fontsize=_FONT, loc="left", labelpad=2)
    heat.set_xlim(-0.5, columns - 0.5)


def _parts(name: str) -> list[str]:
    return re.split(r"[./]", name)


def _split(group: list[str], depth: int, limit: int) -> list[list[str]]:
    """``group`` cut into pieces of at most ``limit`` names, along the hierarchy from ``depth``."""
    if len(group) <= limit:
        return [group]
    runs: list[list[str]] = []
    key: object = object()
    for name in group:
        p = _parts(name)
        here = p[depth] if len(p) > depth + 1 else None  # a name ending here: on its own
        if here is None or here != key or not runs:
            runs.append([])
        runs[-1].append(name)
        key = here
    if len(runs) == 1:
        if all(len(_parts(n)) <= depth + 1 for n in group):  # nothing deeper: cut
            return [group[i : i + limit] for i in range(0, len(group), limit)]
        return _split(group, depth + 1, limit)
    packed: list[list[str]] = []
    target = -(-len(group) // -(-len(group) // limit))  # as few charts as fit, evenly filled
    whole = False  # whether packed[-1] holds whole subtrees only, so may take another
    for run in runs:
        pieces = _split(run, depth + 1, limit)
        # A container's own entry comes after its last child's: it joins that chart.
        parent = len(run) == 1 and packed and packed[-1][-1].startswith((run[0] + ".", run[0] + "/"))
        if len(pieces) == 1 and (whole or parent) and len(packed[-1]) + len(run) <= target:
            packed[-1].extend(run)
        else:
            packed.extend(list(piece) for piece in pieces)
            whole = len(pieces) == 1
    return packed


def _common_prefix(group: list[str]) -> list[str]:
    """The parts of the dotted path that every name of ``group`` starts with."""
    common = _parts(group[0])
    for name in group[1:]:
        p = _parts(name)
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return common


def _titled(groups: list[list[str]]) -> list[tuple[str, list[str]]]:
    """Each group with its title: its subtree, its children's range, or its first and last names."""
    commons = [_common_prefix(group) for group in groups]
    prefixes = [".".join(common) for common in commons]
    titled: list[tuple[str, list[str]]] = []
    used: set[str] = set()
    for group, prefix, common in zip(groups, prefixes, commons):
        title = group[0] if len(group) == 1 else prefix or f"{group[0]} … {group[-1]}"
        if len(group) > 1 and prefix and prefixes.count(prefix) > 1:  # a subtree cut in pieces:
            first, last = (".".join(_parts(n)[: len(common) + 1]) for n in (group[0], group[-1]))  # its children
            title = first if first == last else f"{first} … {last}"
        while title in used:
            title += " "
        used.add(title)
        titled.append((title, group))
    return titled


def chart_groups(names: Sequence[str], limit: int = MAX_LINES) -> list[tuple[str, list[str]]]:
    """``names`` (in order) cut into consecutive groups of at most ``limit``, each titled.

    A group is a subtree of the module hierarchy (the names that share a prefix of their dotted
    path, ``blocks.3``) where it fits, else an even piece of one, titled by its first and last
    children (``blocks.3.norm1 … blocks.3.attn``); small neighbouring subtrees are packed
    together (``net.0 … net.2``).
    """
    groups: list[list[str]] = []
    for group in _split(list(names), 0, limit) if names else []:
        if groups and len(groups[-1]) <= 2 and len(group) <= 2:  # lone leftovers of two subtrees
            groups[-1].extend(group)
        else:
            groups.append(group)
    return _titled(groups)


def _escape(text: str) -> str:
    """``re.escape`` without escaping spaces (a JavaScript RegExp in unicode mode refuses ``\\ ``)."""
    return re.escape(text).replace("\\ ", " ")


def _exact(tag_prefix: str, names: Sequence[str]) -> str:
    """One regular expression matching exactly the tags ``<tag_prefix>/<name>`` of ``names``."""
    return f"^{_escape(tag_prefix)}/(" + "|".join(_escape(n) for n in names) + ")$"


def custom_scalars_layout(
    statistics: Collection[str],
    record: GradientRecord | None = None,
    kinds: tuple[str, ...] = GRADIENT_KINDS,
) -> dict:
    """A layout for ``SummaryWriter.add_custom_scalars``, from a logged step's record.

    Categories, named as the sections of the Time Series dashboard: ``∇1 overview`` (the total
    gradient norm and the non-finite total), then one per kind and statistic
    (``∇2 grad_output_norm``), ``∇5 param_update_ratio`` and ``∇7 param_norm`` for the
    parameters of ``record``'s ``param_grad`` entries, and ``∇8 forward`` for its forward
    statistics (one chart per group of modules and forward kind). Each holds the charts of
    :func:`chart_groups`: at most :data:`MAX_LINES` lines each. No per-module ``nonfinite``
    charts (empty on healthy runs). Without a record, only the overview.

    Args:
        statistics: the statistics that are logged.
        record: the first logged step's record, whose entry names are the charts' lines.
        kinds: the kinds of gradient to make charts for.

    Example:
        >>> from lightning_gradhooks.summary.records import GradientEntry, GradientRecord, Kind
        >>> from lightning_gradhooks.summary.statistics import StatsRow
        >>> stats = StatsRow(*[0.0] * 6, count=4.0, low=0.0, high=0.0)
        >>> record = GradientRecord([GradientEntry(Kind.GRAD_OUTPUT, "net.0", stats)])
        >>> custom_scalars_layout(["norm"], record)["∇2 grad_output_norm"]
        {'net.0': ['Multiline', ['^∇2 grad_output_norm/(net\\\\.0)$']]}
    """
    overview = {name: ["Multiline", [f"^{_escape(OVERVIEW)}/{name}"]] for name in ("total_norm", "nonfinite_total")}
    layout: dict[str, dict[str, list]] = {OVERVIEW: overview}
    if record is None:
        return layout
    names: dict[str, dict[str, None]] = {}  # kind: names, in order, once each
    for entry in record.entries:
        names.setdefault(entry.kind, {})[entry.key.label] = None
    ordered = {kind: list(reversed(n)) if kind != Kind.PARAM_GRAD else list(n) for kind, n in names.items()}
    # Hook entries come in backward order: reversed, the charts follow the forward order.
    tags = [(section(kind, stat), kind) for kind in kinds for stat in STATISTICS if stat in statistics and stat != "nonfinite"]
    tags += [(tag, Kind.PARAM_GRAD) for option, tag in UPDATE_SECTIONS.items() if option in statistics]
    for tag, kind in sorted(tags):  # in the order of the Time Series sections (one-digit numbers)
        if ordered.get(kind):
            layout[tag] = {title: ["Multiline", [_exact(tag, group)]] for title, group in chart_groups(ordered[kind])}
    forward = {f"{kind} {title}": ["Multiline", [_exact(forward_chart(kind), group)]]
               for kind in FORWARD_CHARTS for title, group in chart_groups(list(names.get(kind, ())))}  # in forward order
    if forward:
        layout[FORWARD] = forward
    return layout
