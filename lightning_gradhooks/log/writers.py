"""``Writers``: the one way a logged step reaches every writer of a :class:`~lightning_gradhooks.log.GradientLog`.

Every step the log writes, a record's, the update ratios measured after it, or a step that
:class:`~lightning_gradhooks.core.sentinel.NonfiniteSentinel` caught, goes through :meth:`Writers.send`
as the same three things: the scalars to chart, the step's compact summary and, when it has
them, the record (for the histograms and the custom-scalars layout). What each kind of writer
takes of them is decided here, once:

- a ``torch.utils.tensorboard.SummaryWriter``: everything, in one event per step
  (:func:`~lightning_gradhooks.log._tensorboard.write_step`), the layout at the first record;
- a Lightning ``WandbLogger``: the scalars, under the TensorBoard tags, and the histograms as
  ``wandb.Histogram`` values;
- any other object with ``log_metrics(metrics, step)`` (CSV, MLflow, ...): a table of columns,
  the overview, the norms and the forward charts, named without the ``∇<n> `` (ASCII names,
  which MLflow requires and a CSV file in a non-UTF-8 locale can write); nothing on a step
  that has none of those.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from lightning_gradhooks.log._tensorboard import FORWARD, NORM_SECTIONS, OVERVIEW, histogram_tag, write_step
from lightning_gradhooks.log.flow import custom_scalars_layout
from lightning_gradhooks.summary.records import GradientRecord, Summary
from lightning_gradhooks.summary.statistics import histogram_edges

#: The tag of the health report in TensorBoard's Text tab and in W&B.
REPORT_TAG = "gradhooks/health_report"


def _is_tensorboard(writer: Any) -> bool:
    from torch.utils.tensorboard import SummaryWriter

    return isinstance(writer, SummaryWriter)


def _is_wandb(writer: Any) -> bool:
    """A Lightning ``WandbLogger``: its ``log_metrics`` takes W&B objects too (histograms, HTML)."""
    return any(c.__name__ == "WandbLogger" for c in type(writer).__mro__)


def _wandb_histograms(record: GradientRecord) -> dict[str, Any]:
    """The record's histograms as ``wandb.Histogram`` values, under the TensorBoard tags."""
    import wandb

    values = {}
    for entry in record.entries:
        hist = entry.histogram
        if hist is None or sum(hist.counts) == 0:
            continue
        edges = [hist.low, *histogram_edges(hist.low, hist.high, len(hist.counts))]  # TensorBoard's right edges
        values[histogram_tag(entry)] = wandb.Histogram(np_histogram=(hist.counts, edges))
    return values


def _table_columns(metrics: dict[str, float]) -> dict[str, float]:
    """The overview, the norms and the forward charts (``forward/output_rms/net.0``), named
    without the ``∇<n> `` (``grad_output_norm/net.0``)."""
    return {tag.split(" ", 1)[1]: value for tag, value in metrics.items()
            if tag.partition("/")[0] in (OVERVIEW, *NORM_SECTIONS, FORWARD)}


class Writers:
    """The writers of a log, sorted once by kind; see the module docstring for what each takes.

    Args:
        writers: a ``SummaryWriter``, an object with ``log_metrics(metrics, step)``, a list of
            those, or None.
        statistics: the statistics charted per module (for TensorBoard's custom-scalars layout).

    Raises:
        ValueError: a writer of another type.
    """

    def __init__(self, writers: Any, statistics: Sequence[str]) -> None:
        writers = [] if writers is None else list(writers) if isinstance(writers, (list, tuple)) else [writers]
        for w in writers:
            if not (_is_tensorboard(w) or hasattr(w, "log_metrics")):
                raise ValueError(
                    "`writer` expected a SummaryWriter, an object with `log_metrics(metrics, step)`, a list of "
                    f"those or None, got {type(w).__name__}"
                )
        #: The ``SummaryWriter`` among them (they get the flow picture and the report too).
        self.tensorboards = [w for w in writers if _is_tensorboard(w)]
        self._wandbs = [w for w in writers if not _is_tensorboard(w) and _is_wandb(w)]
        self._tables = [w for w in writers if not _is_tensorboard(w) and not _is_wandb(w)]
        self._statistics = list(statistics)
        self._layout_written = False

    def send(self, step: int, metrics: dict[str, float], stats: Summary, record: GradientRecord | None = None,
             histograms: bool = False) -> None:
        """Write one step to every writer: ``metrics`` (charted), ``stats`` (the compact summary)
        and, for a logged record, ``record`` (its histograms when ``histograms``)."""
        hists = record if histograms else None
        for w in self._wandbs:
            w.log_metrics({**metrics, **(_wandb_histograms(hists) if hists is not None else {})}, step=step)
        columns = _table_columns(metrics)
        if columns:
            for w in self._tables:
                w.log_metrics(columns, step=step)
        for w in self.tensorboards:
            write_step(w, metrics, hists, step, stats)
            if record is not None and not self._layout_written:
                w.add_custom_scalars(custom_scalars_layout(self._statistics, record))
        if record is not None:
            self._layout_written = True

    def image(self, tag: str, image: Any, step: int) -> None:
        """An ``HWC`` image, to TensorBoard's Images tab."""
        for w in self.tensorboards:
            w.add_image(tag, image, step, dataformats="HWC")

    def report(self, table: str, markdown: str, step: int) -> None:
        """The health report: ``markdown`` to TensorBoard's Text tab, ``table`` to W&B as HTML."""
        for w in self.tensorboards:
            w.add_text(REPORT_TAG, markdown, step)
            w.flush()
        if self._wandbs:
            import wandb

            text = wandb.Html(f"<pre>{html.escape(table)}</pre>")
            for w in self._wandbs:
                w.log_metrics({REPORT_TAG: text}, step=step)
