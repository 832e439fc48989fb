"""The event files read back, without TensorBoard: the records of a TFRecord file, checked against
their CRC-32C, and the compact summary each logged step writes (``gradhooks/stats``), decoded from
the protocol buffers' wire format for the few fields it uses. What the writer
(:mod:`lightning_gradhooks.log._tensorboard`) and the reader share is declared here once: the tags,
the plugin's name, the packed summary's version and the checksum.

The compact summary: one step's :data:`~lightning_gradhooks.summary.records.Summary` as one
summary value under :data:`STATS_TAG`, its numbers a float64 tensor (little-endian), and in the
plugin data (JSON) the number of its layout (``{"v": 2, "id": n}``), with the layout itself
(``"keys": [[kind, label, [statistic, ...]], ...]``) the first time a file holds it.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import google_crc32c

from lightning_gradhooks.summary.records import Key, Kind, Summary
from lightning_gradhooks.summary.text import counted

__all__ = [
    "OVERVIEW", "PACKED", "STATS_PLUGIN", "STATS_TAG", "Damage", "SummaryLayout", "SummaryReader", "Value",
    "masked_crc32c", "read_event", "read_records",
]

#: The first section of ours: the total gradient norm, the non-finite total, the flow picture.
OVERVIEW = "∇1 overview"
#: The tag of the compact summary that every logged step writes: every statistic of every entry,
#: what the health report reads.
STATS_TAG = "gradhooks/stats"
#: Its plugin: one that no TensorBoard dashboard shows (no chart, no Text card).
STATS_PLUGIN = "gradhooks"
#: The version of the packed summary (``"v"`` in the plugin data).
PACKED = 2
#: A summary's layout: ``(kind, label, statistics)`` per entry, in order.
SummaryLayout = tuple[tuple[str, str, tuple[str, ...]], ...]
_BIG_ENDIAN = sys.byteorder == "big"  # a TensorProto's tensor_content is little-endian


def masked_crc32c(data: bytes) -> int:
    """TensorBoard's record checksum: CRC-32C of ``data``, rotated right by 15 bits, plus a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclass
class Damage:
    """Where an event file stops being readable, and what was read before."""

    path: Path
    offset: int
    reason: str
    events: int = 0
    steps: int = 0  # logged steps with GradHooks data among the events read


def read_records(path: Path) -> Iterator[bytes | Damage]:
    """The records of a TFRecord file (an event file), each checked against its CRC-32C; a
    :class:`Damage` last where the file is cut short or damaged."""
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        if len(data) - offset < 12:
            yield Damage(path, offset, f"cut short: {counted(len(data) - offset, 'byte')} of a record header")
            return
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        if masked_crc32c(header) != crc:
            yield Damage(path, offset, "damaged record header (CRC mismatch)")
            return
        end = offset + 12 + length + 4
        if end > len(data):
            yield Damage(path, offset, f"cut short: a record of {counted(length, 'byte')}, {len(data) - offset - 12} left")
            return
        payload = data[offset + 12 : offset + 12 + length]
        if masked_crc32c(payload) != struct.unpack("<I", data[end - 4 : end])[0]:
            yield Damage(path, offset, "damaged record (CRC mismatch)")
            return
        yield payload
        offset = end


# -- the protocol buffers' wire format, for the fields read ------------------------------------
# Event: step = 2 (varint), summary = 5. Summary: value = 1 (repeated). Summary.Value: tag = 1,
# tensor = 8, metadata = 9. SummaryMetadata: plugin_data = 1. PluginData: plugin_name = 1,
# content = 2. TensorProto: tensor_content = 4. Other fields are skipped by their wire type.


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _fields(data: bytes) -> dict[int, list[int | bytes]]:
    """The fields of one message, by number: varints as ints, length-delimited ones as bytes
    (fixed-width ones are skipped: no field read has them)."""
    found: dict[int, list[int | bytes]] = {}
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at : at + length], at + length
            if at > end:
                raise ValueError("a field runs past the end of its message")
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            continue
        else:
            raise ValueError(f"wire type {wire} is not read")
        found.setdefault(number, []).append(value)
    return found


def _one(fields: dict[int, list[int | bytes]], number: int, default: int | bytes = b"") -> int | bytes:
    values = fields.get(number)
    return values[-1] if values else default


class Value(NamedTuple):
    """What the report reads of one summary value."""

    tag: str
    plugin_name: str
    content: bytes
    tensor_content: bytes


def read_event(record: bytes) -> tuple[int, list[Value]]:
    """The step and the summary values of one event record.

    Raises:
        ValueError: the bytes are no event.
    """
    event = _fields(record)
    values = []
    for raw in _fields(_one(event, 5)).get(1, []):
        value = _fields(raw)
        plugin = _fields(_one(_fields(_one(value, 9)), 1))
        values.append(Value(_one(value, 1).decode(), _one(plugin, 1).decode(), bytes(_one(plugin, 2)),
                            bytes(_one(_fields(_one(value, 8)), 4))))
    return int(_one(event, 2, 0)), values


class SummaryReader:
    """Reads back the compact summaries of one file (it keeps the file's layouts). The optimizer
    index of a name, written as its ``optimizer_<i>/`` prefix, is read back into its field here,
    the one place that reads names."""

    def __init__(self) -> None:
        # Per layout number: (key, statistics) per entry, in the order of the numbers, and how many.
        self._layouts: dict[int, tuple[list[tuple[Key, tuple[str, ...]]], int]] = {}

    def read(self, value: Value) -> Summary | None:
        """The summary of a summary value; None for other values (and for a summary whose layout
        the file never gave, or whose numbers do not fit it)."""
        found = self.read_packed(value)
        if found is None:
            return None
        plan, numbers = found
        it = iter(numbers.tolist())  # zip takes a name first: each entry takes its own numbers, no more
        return {key: dict(zip(names, it)) for key, names in plan}

    def read_packed(self, value: Value) -> tuple[list[tuple[Key, tuple[str, ...]]], array] | None:
        """:meth:`read`, the summary left as it is: its layout (``(key, statistics)`` per entry, the
        same list for every summary of the layout) and its numbers, in order."""
        if value.tag != STATS_TAG or value.plugin_name != STATS_PLUGIN or not value.content:
            return None
        header = json.loads(value.content)
        if header.get("v") != PACKED:  # another version's: not guessed at
            return None
        if "keys" in header:
            plan = [(Key.of_label(_kind(k), label), tuple(names)) for k, label, names in header["keys"]]
            self._layouts[header["id"]] = plan, sum(len(names) for _, names in plan)
        plan, size = self._layouts.get(header["id"], (None, -1))
        numbers = array("d", value.tensor_content)
        if len(numbers) != size:
            return None
        if _BIG_ENDIAN:
            numbers.byteswap()
        return plan, numbers


def _kind(kind: str) -> str:
    return Kind._value2member_map_.get(kind, kind)
