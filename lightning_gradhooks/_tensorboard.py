"""Turning a :class:`GradientRecord` into TensorBoard tags, scalars and raw histograms.

Tag scheme: ``<kind>_<statistic>/<name>`` for scalars (``grad_output_norm/encoder.0.linear1``)
and ``<kind>_hist/<name>`` for histograms, so TensorBoard groups one section per statistic.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from lightning_gradhooks.monitor import GradientRecord
from lightning_gradhooks.stats import histogram_edges


def scalar_metrics(record: GradientRecord, statistics: Collection[str]) -> dict[str, float]:
    """The scalars of ``record`` under their tags, for the chosen statistics only."""
    return {
        f"{entry.kind}_{stat}/{entry.name}": value
        for entry in record.entries
        for stat, value in entry.stats.items()
        if stat in statistics
    }


def write_histograms(writer: Any, record: GradientRecord, step: int) -> None:
    """Write every histogram of ``record`` with ``SummaryWriter.add_histogram_raw``."""
    for entry in record.entries:
        hist = entry.histogram
        if hist is None:
            continue
        num = sum(hist.counts)
        if num == 0:  # nothing finite to show
            continue
        bins = len(hist.counts)
        writer.add_histogram_raw(
            tag=f"{entry.kind}_hist/{entry.name}",
            min=hist.low,
            max=hist.high,
            num=num,
            sum=entry.stats["mean"] * num,
            sum_squares=entry.stats["norm"] ** 2,
            bucket_limits=histogram_edges(hist.low, hist.high, bins),
            bucket_counts=hist.counts,
            global_step=step,
        )
