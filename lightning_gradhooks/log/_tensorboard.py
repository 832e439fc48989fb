"""Turning a :class:`GradientRecord` into TensorBoard tags, scalars and raw histograms.

Tag scheme: ``<section>/<name>``, and TensorBoard shows one section per ``<section>``. Sections
of ours are numbered, in the order a person reads them: ``∇1 overview`` (the total gradient norm,
the non-finite total, the gradient-flow picture), ``∇2 grad_output_norm``, ``∇3 grad_input_norm``,
``∇4 param_grad_norm``, ``∇5 param_update_ratio``, ``∇6 histograms`` (``<kind>/<name>``), and
``∇7 <kind>_<statistic>`` for the statistics charted only by option (``∇7 grad_output_mean``), and
``∇8 forward`` for the forward statistics (``∇8 forward/output_rms/<name>``,
``∇8 forward/attention_logit_max/<name>``).

Why the ``∇``: TensorBoard's Time Series dashboard groups cards by the tag up to its first
``/`` and orders the groups by their first tag, compared digit runs as numbers first, then
character by character (``compareTagNames`` in its frontend); only the first two groups are open.
A section named with a letter or a digit would sort among (or above) the user's own ``train_loss``;
``∇`` (U+2207) sorts after every ASCII character, so the user's metrics come first and ours
after, in the order of their numbers.

A logged step is written as a single event holding every scalar and histogram of the step: the
same ``simple_value`` and ``HistogramProto`` records that ``SummaryWriter.add_scalar`` and
``add_histogram_raw`` write, but serialised once instead of once per tag (~85 us each).

Every logged step also writes its compact summary
(:data:`~lightning_gradhooks.summary.events.STATS_TAG`: every statistic of every
entry, what the health report and the ``report`` command read) as an event of its own, written
before the step's charts: packed float64 numbers, whose names (each entry's kind, name and
statistics: its *layout*) are written once per file, the first time a layout is used, and named
by a number after. The ``report`` command reads those events alone and skips the rest unparsed.
Histograms are written on the first logged step of each window of ``histogram_every_n_steps``
steps (:class:`~lightning_gradhooks.log.GradientLog`), with each run of empty buckets written as
one bucket, as TensorFlow writes them: the chart is the same.

These events go to an event file of our own in the writer's folder
(``events.out.tfevents.<time>.<host>.<pid>.gradhooks``), which TensorBoard reads like the
writer's own. TensorBoard's writer (without TensorFlow) checksums every record with a CRC-32C
written in Python, ~80 ns a byte, holding the GIL: on 500 modules a logged step's event is ~2 MB,
~150 ms. Our file's records are checksummed with ``google-crc32c``'s C code instead, and
TensorBoard's writer is left as it is. The file is opened, appended to and closed at each logged
step: nothing of ours stays open between steps, and every step is on disk once written.
"""

from __future__ import annotations

import json
import os
import sys
from array import array
import socket
import struct
import time
import weakref
from collections.abc import Collection
from typing import Any

from tensorboard.compat.proto import types_pb2
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, SummaryMetadata
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

from lightning_gradhooks.summary.events import OVERVIEW, PACKED, STATS_PLUGIN, STATS_TAG, SummaryLayout, masked_crc32c
from lightning_gradhooks.summary.records import (
    ACTIVATION_KINDS, FORWARD_KINDS, GRADIENT_KINDS, GradientEntry, GradientRecord, Kind, Summary, forward_values,
)
from lightning_gradhooks.summary.statistics import STATISTICS, histogram_edges

_BIG_ENDIAN = sys.byteorder == "big"  # a TensorProto's tensor_content is little-endian


#: The image of :class:`~lightning_gradhooks.log.flow.GradientFlow`.
FLOW_TAG = f"{OVERVIEW}/gradient_flow"
#: Every histogram, ``∇6 histograms/<kind>/<name>``.
HISTOGRAMS = "∇6 histograms"
#: The numbered sections of the default statistics; every other statistic is in a ``∇7`` one.
_NUMBERS = {(Kind.GRAD_OUTPUT, "norm"): 2, (Kind.GRAD_INPUT, "norm"): 3, (Kind.PARAM_GRAD, "norm"): 4, (Kind.PARAM, "update_ratio"): 5}


#: The section of the forward statistics: what is charted of each ``output`` and ``attention_logit`` entry.
FORWARD = "∇8 forward"
#: The charted statistic of each forward kind (:func:`~lightning_gradhooks.summary.records.forward_values`).
FORWARD_CHARTS = {Kind.OUTPUT: "rms", Kind.ATTENTION_LOGIT: "max"}


def forward_chart(kind: str) -> str:
    """The tags of a forward kind, before the name: ``∇8 forward/output_rms``, ``∇8 forward/attention_logit_max``."""
    return f"{FORWARD}/{kind}_{FORWARD_CHARTS[kind]}"


def section(kind: str, stat: str) -> str:
    """The section of a per-module statistic: ``∇2 grad_output_norm``, ``∇7 grad_output_mean``,
    ``∇5 param_update_ratio``, ``∇7 param_norm`` (kind ``param``: the optimizer step's)."""
    return f"∇{_NUMBERS.get((kind, stat), 7)} {kind}_{stat}"


#: The sections of the per-module gradient norms (what a table of columns, CSV, gets).
NORM_SECTIONS = tuple(section(kind, "norm") for kind in GRADIENT_KINDS)
#: The sections of the optimizer step's per-parameter statistics, by their ``statistics`` name.
UPDATE_SECTIONS = {"update_ratio": section(Kind.PARAM, "update_ratio"), "param_norm": section(Kind.PARAM, "norm")}


def histogram_tag(entry: GradientEntry) -> str:
    """``∇6 histograms/<kind>/<name>``."""
    return f"{HISTOGRAMS}/{entry.kind}/{entry.key.label}"


def scalar_metrics(
    record: GradientRecord, statistics: Collection[str], nonfinite_seen: set[str] | None = None, suffix: str = ""
) -> dict[str, float]:
    """The scalars of ``record`` under their tags, for the chosen statistics only.

    With ``nonfinite_seen`` (a set kept across steps, updated here), a ``*_nonfinite`` tag is
    written from the first step where it is non-zero on, and the overview section holds the
    run-level ``∇1 overview/nonfinite_total`` every step instead. The overview also holds
    ``∇1 overview/total_norm``: the L2 norm of all parameter gradients of the record, what
    ``torch.nn.utils.clip_grad_norm_`` computes; the overview tags end with ``suffix`` (with
    several optimizers, one per optimizer: ``total_norm_optimizer_<i>``). The overview is
    written whatever the statistics; the forward checks (kinds ``forward``, ``forward_input``,
    ``weights``) are not charted: :func:`stats_value` carries them; of the forward statistics,
    the RMS of each output and the largest attention logit are, in ``∇8 forward``, whatever the
    statistics.
    """
    metrics = {}
    nonfinite_total, squares, params = 0.0, 0.0, False
    for entry in record.entries:
        if entry.kind in FORWARD_KINDS:
            continue
        if entry.kind in ACTIVATION_KINDS:
            metrics[f"{forward_chart(entry.kind)}/{entry.key.label}"] = forward_values(entry.kind, entry.stats)[FORWARD_CHARTS[entry.kind]]
            continue
        if entry.kind == Kind.PARAM_GRAD:
            squares, params = squares + entry.stats.norm**2, True
        nonfinite_total += entry.stats.nonfinite
        for stat, value in zip(STATISTICS, entry.stats):
            if stat in statistics:
                tag = f"{section(entry.kind, stat)}/{entry.key.label}"
                if stat == "nonfinite" and nonfinite_seen is not None:
                    if value == 0 and tag not in nonfinite_seen:
                        continue
                    nonfinite_seen.add(tag)
                metrics[tag] = value
    if params:
        metrics[f"{OVERVIEW}/total_norm{suffix}"] = squares**0.5
    if nonfinite_seen is not None:
        metrics[f"{OVERVIEW}/nonfinite_total{suffix}"] = nonfinite_total
    return metrics


def stats_value(stats: Summary, layouts: dict[SummaryLayout, int] | None = None) -> SummaryProto.Value:
    """One step's :data:`~lightning_gradhooks.summary.records.Summary` as one summary value under
    :data:`STATS_TAG`: its numbers as a float64 tensor, and in the plugin data the number of its
    layout (``{"v": 2, "id": n}``), with the layout itself (``"keys": [[kind, label,
    [statistic, ...]], ...]``) the first time.

    Args:
        stats: the summary.
        layouts: the layouts written so far to the file the value goes to, with their numbers
            (updated here); None: the layout is written with the value.
    """
    layout = tuple((key.kind, key.label, tuple(values)) for key, values in stats.items())
    numbers = array("d", [v for values in stats.values() for v in values.values()])
    if _BIG_ENDIAN:
        numbers.byteswap()
    known = layouts is not None and layout in layouts
    if known:
        header = {"v": PACKED, "id": layouts[layout]}
    else:
        number = len(layouts) if layouts is not None else 0
        header = {"v": PACKED, "id": number, "keys": [[str(k), label, list(names)] for k, label, names in layout]}
        if layouts is not None:
            layouts[layout] = number
    content = json.dumps(header, separators=(",", ":")).encode()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=STATS_PLUGIN, content=content))
    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=len(numbers))])
    tensor = TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_shape=shape, tensor_content=numbers.tobytes())
    return SummaryProto.Value(tag=STATS_TAG, tensor=tensor, metadata=metadata)


def histogram_values(record: GradientRecord) -> list[SummaryProto.Value]:
    """The histograms of ``record`` as summary values (entries with no finite value are skipped).
    Each run of empty buckets is written as one bucket, reaching to the last one's right edge
    (as TensorFlow's writer does): TensorBoard draws the same histogram from fewer bytes."""
    values = []
    for entry in record.entries:
        hist = entry.histogram
        num = sum(hist.counts) if hist is not None else 0
        if num == 0:
            continue
        limits, counts = [], []
        for limit, count in zip(histogram_edges(hist.low, hist.high, len(hist.counts)), hist.counts):
            if count == 0 and counts and counts[-1] == 0:
                limits[-1] = limit
            else:
                limits.append(limit)
                counts.append(count)
        proto = HistogramProto(
            min=hist.low,
            max=hist.high,
            num=num,
            sum=entry.stats.mean * num,
            sum_squares=entry.stats.norm**2,
            bucket_limit=limits,
            bucket=counts,
        )
        values.append(SummaryProto.Value(tag=histogram_tag(entry), histo=proto))
    return values


def _record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its checksum, the data, its checksum."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


class _EventFile:
    """Our event file in a writer's folder: its path, and the summary layouts written to it."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.gradhooks"
        self.path = os.path.join(folder, name)
        self.layouts: dict[SummaryLayout, int] = {}
        with open(self.path, "ab") as f:
            f.write(_record(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()))


#: The event file of ours beside each SummaryWriter's own (a path: no file stays open).
_EVENT_FILES: weakref.WeakKeyDictionary[Any, _EventFile] = weakref.WeakKeyDictionary()


def event_file(writer: Any) -> _EventFile:
    """Our event file in ``writer``'s folder; the file is created (holding the ``file_version``
    event that every event file starts with) the first time."""
    file = _EVENT_FILES.get(writer)
    if file is None:
        file = _EVENT_FILES[writer] = _EventFile(writer.get_logdir())
    return file


def write_step(writer: Any, metrics: dict[str, float], record: GradientRecord | None, step: int,
               stats: Summary | None = None) -> None:
    """Write one step to our event file in ``writer``'s folder (:func:`event_file`): the compact
    ``stats``, if given, as an event of its own, then the scalars (and the histograms of
    ``record``, if given) as one event.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (``TensorBoardLogger.experiment``).
    """
    file = event_file(writer)
    now, data = time.time(), b""
    if stats:
        summary = SummaryProto(value=[stats_value(stats, file.layouts)])
        data += _record(Event(wall_time=now, step=step, summary=summary).SerializeToString())
    values = [SummaryProto.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
    if record is not None:
        values += histogram_values(record)
    if values:
        data += _record(Event(wall_time=now, step=step, summary=SummaryProto(value=values)).SerializeToString())
    with open(file.path, "ab") as f:  # one write: a record is whole or cut short, never mixed
        f.write(data)
