"""Turning a :class:`GradientRecord` into TensorBoard tags, scalars and raw histograms.

Tag scheme: ``<section>/<name>``, and TensorBoard shows one section per ``<section>``. Sections
of ours are numbered, in the order a person reads them: ``∇1 overview`` (the total gradient norm,
the non-finite total, the gradient-flow picture), ``∇2 grad_output_norm``, ``∇3 grad_input_norm``,
``∇4 param_grad_norm``, ``∇5 param_update_ratio``, ``∇6 histograms`` (``<kind>/<name>``), and
``∇7 <kind>_<statistic>`` for the statistics charted only by option (``∇7 grad_output_mean``).

Why the ``∇``: TensorBoard's Time Series dashboard groups cards by the tag up to its first
``/`` and orders the groups by their first tag, compared digit runs as numbers first, then
character by character (``compareTagNames`` in its frontend); only the first two groups are open.
A section named with a letter or a digit would sort among (or above) the user's own ``train_loss``;
``∇`` (U+2207) sorts after every ASCII character, so the user's metrics come first and ours
after, in the order of their numbers.

A logged step is written as a single event holding every scalar and histogram of the step: the
same ``simple_value`` and ``HistogramProto`` records that ``SummaryWriter.add_scalar`` and
``add_histogram_raw`` write, but serialised once instead of once per tag (~85 us each).

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
import socket
import struct
import time
import weakref
from collections.abc import Collection
from typing import Any

import google_crc32c
from tensorboard.compat.proto import types_pb2
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, SummaryMetadata
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

from lightning_gradhooks.records import FORWARD_KINDS, GRADIENT_KINDS, GradientEntry, GradientRecord, Key, Kind, Summary
from lightning_gradhooks.stats import STATISTICS, histogram_edges


#: The first section of ours: the total gradient norm, the non-finite total, the flow picture.
OVERVIEW = "∇1 overview"
#: The image of :class:`~lightning_gradhooks.flow.GradientFlow`.
FLOW_TAG = f"{OVERVIEW}/gradient_flow"
#: Every histogram, ``∇6 histograms/<kind>/<name>``.
HISTOGRAMS = "∇6 histograms"
#: The numbered sections of the default statistics; every other statistic is in a ``∇7`` one.
_NUMBERS = {(Kind.GRAD_OUTPUT, "norm"): 2, (Kind.GRAD_INPUT, "norm"): 3, (Kind.PARAM_GRAD, "norm"): 4, (Kind.PARAM, "update_ratio"): 5}


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


def _masked_crc32c(data: bytes) -> int:
    """TensorBoard's record checksum: CRC-32C of ``data``, rotated right by 15 bits, plus a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


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
    ``weights``) are not charted: :func:`stats_value` carries them.
    """
    metrics = {}
    nonfinite_total, squares, params = 0.0, 0.0, False
    for entry in record.entries:
        if entry.kind in FORWARD_KINDS:
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


#: The tag of the compact summary that every logged step writes: every statistic of every entry,
#: what the health report reads (``python -m lightning_gradhooks report`` reads it back).
STATS_TAG = "gradhooks/stats"
_STATS_PLUGIN = "gradhooks"  # a plugin no TensorBoard dashboard shows: no chart, no Text card


def stats_value(stats: Summary) -> SummaryProto.Value:
    """One step's :data:`~lightning_gradhooks.records.Summary` as one summary value: a JSON
    string tensor under :data:`STATS_TAG` (the report rounds what it reads to float32, as scalar
    events hold them, so the report of the log is the printed one)."""
    rows = [[key.kind, key.label, {k: float(v) for k, v in values.items()}] for key, values in stats.items()]
    text = json.dumps(rows, separators=(",", ":"), allow_nan=True).encode()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=_STATS_PLUGIN))
    tensor = TensorProto(dtype=types_pb2.DT_STRING, string_val=[text], tensor_shape=TensorShapeProto())
    return SummaryProto.Value(tag=STATS_TAG, tensor=tensor, metadata=metadata)


def read_stats_value(value: Any) -> Summary | None:
    """What :func:`stats_value` wrote, from a summary value read back; None for other values.
    The optimizer index of a name, written as its ``optimizer_<i>/`` prefix, is read back into
    its field here, the one place that reads names."""
    if value.tag != STATS_TAG or value.metadata.plugin_data.plugin_name != _STATS_PLUGIN:
        return None
    rows = json.loads(value.tensor.string_val[0])
    kinds = Kind._value2member_map_
    return {Key.of_label(kinds.get(kind, kind), label): values for kind, label, values in rows}


def histogram_values(record: GradientRecord) -> list[SummaryProto.Value]:
    """The histograms of ``record`` as summary values (entries with no finite value are skipped)."""
    values = []
    for entry in record.entries:
        hist = entry.histogram
        num = sum(hist.counts) if hist is not None else 0
        if num == 0:
            continue
        proto = HistogramProto(
            min=hist.low,
            max=hist.high,
            num=num,
            sum=entry.stats.mean * num,
            sum_squares=entry.stats.norm**2,
            bucket_limit=histogram_edges(hist.low, hist.high, len(hist.counts)),
            bucket=hist.counts,
        )
        values.append(SummaryProto.Value(tag=histogram_tag(entry), histo=proto))
    return values


def _record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its checksum, the data, its checksum."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc32c(header)) + data + struct.pack("<I", _masked_crc32c(data))


#: The event file of ours beside each SummaryWriter's own (a path: no file stays open).
_EVENT_FILES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def event_file(writer: Any) -> str:
    """The path of our event file in ``writer``'s folder; the file is created (holding the
    ``file_version`` event that every event file starts with) the first time."""
    path = _EVENT_FILES.get(writer)
    if path is None:
        folder = writer.get_logdir()
        os.makedirs(folder, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.gradhooks"
        path = _EVENT_FILES[writer] = os.path.join(folder, name)
        with open(path, "ab") as f:
            f.write(_record(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()))
    return path


def write_step(writer: Any, metrics: dict[str, float], record: GradientRecord | None, step: int,
               stats: Summary | None = None) -> None:
    """Write the scalars (the histograms of ``record`` and the compact ``stats``, if given) of
    one step as one event, to our event file in ``writer``'s folder (:func:`event_file`).

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (``TensorBoardLogger.experiment``).
    """
    values = [SummaryProto.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
    if record is not None:
        values += histogram_values(record)
    if stats:
        values.append(stats_value(stats))
    event = Event(wall_time=time.time(), step=step, summary=SummaryProto(value=values))
    with open(event_file(writer), "ab") as f:  # one write: a record is whole or cut short, never mixed
        f.write(_record(event.SerializeToString()))
