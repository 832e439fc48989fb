"""What a run leaves on disk: the compact summary packed, its layout written once per file and read
back exactly, histograms on a cadence of their own
that TensorBoard reads, and the report command reading what it needs."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from tensorboard.compat.proto.event_pb2 import Event
from torch.utils.tensorboard import SummaryWriter

from lightning_gradhooks import GradHooks, GradientLog, GradientMonitor
from lightning_gradhooks.__main__ import main, read_folder
from lightning_gradhooks.log._tensorboard import _record, histogram_values, write_step
from lightning_gradhooks.summary.events import STATS_TAG
from lightning_gradhooks.summary.records import GradientEntry, GradientRecord, Histogram, Key, Kind
from lightning_gradhooks.summary.statistics import StatsRow, histogram_edges

from conftest import read_events
from report_panel import without_noise


def bits(summary: dict) -> dict:
    """A summary with each number as its 8 bytes: equal only when every value is (NaN included)."""
    return {key: {name: struct.pack("<d", value) for name, value in stats.items()} for key, stats in summary.items()}


def summaries() -> list[dict]:
    odd = {"norm": math.nan, "mean": -0.0, "std": math.inf, "absmax": 5e-324, "nonfinite": 1e308, "zero_fraction": 0.1}
    first = {Key(Kind.GRAD_OUTPUT, "net.0", 1): odd, Key(Kind.PARAM, "net.0.weight", 1): {"update_ratio": 1 / 3, "param_norm": 2.0}}
    again = {Key(Kind.GRAD_OUTPUT, "net.0", 1): {**odd, "norm": 0.1}, Key(Kind.PARAM, "net.0.weight", 1): {"update_ratio": 0.7, "param_norm": 3.0}}
    pooled = {Key(Kind.GRAD_OUTPUT, "net.0", 1): {**odd, "calls": 2.0}, Key(Kind.NOISE, "gradient"): {"trace": 1e-9}}
    return [first, again, pooled, {Key(Kind.CAUGHT, "net.0.weight"): {"nonfinite": 1.0, "checked": 2.0}}]


def test_the_packed_summary_reads_back_exactly_and_its_layout_is_written_once(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    written = summaries()
    for step, summary in enumerate(written):
        write_step(writer, {"∇1 overview/total_norm": 1.0}, None, step, summary)
    writer.close()
    run = read_folder(tmp_path)
    assert run.gradhooks and not run.damage
    assert {step: bits(s) for step, s in run.steps.items()} == {step: bits(s) for step, s in enumerate(written)}
    assert [type(k.kind) for s in run.steps.values() for k in s] == [Kind] * 7
    events = read_events(str(tmp_path))
    stats = events.Tensors(STATS_TAG)
    assert [t.step for t in stats] == [0, 1, 2, 3] and [e.step for e in events.Scalars("∇1 overview/total_norm")] == [0, 1, 2, 3]
    (path,) = tmp_path.glob("*.gradhooks")
    headers = [json.loads(v.metadata.plugin_data.content) for e in events_of(path) for v in e.summary.value if v.tag == STATS_TAG]
    # Steps 0 and 1 share a layout: its names are written once; steps 2 and 3 have their own.
    assert [(h["id"], "keys" in h) for h in headers] == [(0, True), (0, False), (1, True), (2, True)]


def events_of(path: Path) -> list[Event]:
    data, offset, events = path.read_bytes(), 0, []
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        events.append(Event.FromString(data[offset + 12 : offset + 12 + length]))
        offset += length + 16
    return events


def test_a_run_resumed_from_an_older_checkpoint_replaces_the_steps_it_logs_again(tmp_path):
    """A run resumed from its step 1 writes a new file, whose steps replace the old file's from there on."""
    old, new = summaries()[:2], summaries()[2:]
    writer = SummaryWriter(str(tmp_path))
    for step, summary in enumerate(old):
        write_step(writer, {"∇1 overview/total_norm": 1.0}, None, step, summary)
    writer.close()
    for path in tmp_path.glob("events.*"):  # an earlier process's files: named for an earlier time
        path.rename(tmp_path / f"events.out.tfevents.0000000001.{path.name.split('.', 4)[-1]}")
    assert {s: bits(v) for s, v in read_folder(tmp_path).steps.items()} == {0: bits(old[0]), 1: bits(old[1])}
    writer = SummaryWriter(str(tmp_path))
    for step, summary in enumerate(new, start=1):
        write_step(writer, {}, None, step, summary)
    writer.close()
    assert {s: bits(v) for s, v in read_folder(tmp_path).steps.items()} == {0: bits(old[0]), 1: bits(new[0]), 2: bits(new[1])}


def test_a_packed_summary_without_its_layout_is_not_misread(tmp_path):
    """A file that lost the event naming a layout (written, then cut by hand) gives no summary
    for the steps that use it, rather than numbers under the wrong names."""
    writer = SummaryWriter(str(tmp_path))
    first, again = summaries()[:2]
    write_step(writer, {}, None, 0, first)
    write_step(writer, {}, None, 1, again)  # the same layout, by its number
    writer.close()
    (path,) = tmp_path.glob("*.gradhooks")
    events = events_of(path)
    kept = [e for e in events if not (e.step == 0 and e.summary.value)]  # the file version, step 1
    path.write_bytes(b"".join(_record(e.SerializeToString()) for e in kept))
    assert read_folder(tmp_path).steps == {}


def entry(kind: Kind, name: str, counts: list[float]) -> GradientEntry:
    row = StatsRow(norm=2.0, mean=0.5, std=1.0, absmax=3.0, nonfinite=0.0, zero_fraction=0.0, count=sum(counts), low=-1.0, high=3.0)
    return GradientEntry(kind, name, row, Histogram(-1.0, 3.0, counts))


def test_runs_of_empty_buckets_are_written_as_one_and_tensorboard_reads_the_same_histogram(tmp_path):
    counts = [2.0, 0.0, 0.0, 0.0, 1.0, 0.0, 3.0, 0.0]
    (value,) = histogram_values(GradientRecord([entry(Kind.GRAD_OUTPUT, "net.0", counts)]))
    edges = histogram_edges(-1.0, 3.0, len(counts))
    assert list(value.histo.bucket) == [2.0, 0.0, 1.0, 0.0, 3.0, 0.0]
    assert list(value.histo.bucket_limit) == [edges[0], edges[3], edges[4], edges[5], edges[6], edges[7]]
    writer = SummaryWriter(str(tmp_path))
    write_step(writer, {}, GradientRecord([entry(Kind.GRAD_OUTPUT, "net.0", counts)]), 0)
    writer.close()
    (read,) = read_events(str(tmp_path)).Histograms("∇6 histograms/grad_output/net.0")
    assert read.histogram_value.num == sum(counts) and list(read.histogram_value.bucket) == list(value.histo.bucket)
    assert (read.histogram_value.min, read.histogram_value.max) == (-1.0, 3.0)


def test_histograms_are_written_on_their_cadence_and_the_rest_every_logged_step(tmp_path):
    """Logged every 2 steps with histograms every 3: the first logged step of each window of 3
    steps (0-2, 3-5, 6-8, 9-11) has them; the scalars and the summary are there every time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(model)
    writer = SummaryWriter(str(tmp_path))
    log = GradientLog(writer, optimizers=[optimizer], histogram_every_n_steps=3, echo=None)
    due = []
    with monitor.attach():
        for step in range(0, 12, 2):
            due.append(log.histograms_due(step))
            with monitor.arm():
                model(torch.randn(16, 4)).square().mean().backward()
                log.write(monitor.collect(), step)
            optimizer.step()
            optimizer.zero_grad()
    log.close()
    writer.close()
    assert due == [True, False, True, True, False, True]  # steps 0, 4, 6, 10
    events = read_events(str(tmp_path))
    assert [e.step for e in events.Histograms("∇6 histograms/grad_output/0")] == [0, 4, 6, 10]
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/0")] == [0, 2, 4, 6, 8, 10]
    assert sorted(read_folder(tmp_path).steps) == [0, 2, 4, 6, 8, 10]


def test_a_monitor_armed_by_the_log_counts_histograms_on_their_steps_only(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    monitor = GradientMonitor(model)
    log = GradientLog(None, histogram_every_n_steps=2, echo=None)
    counted = []
    with monitor.attach():
        for step in range(4):
            with log.arm(monitor, step):
                model(torch.randn(16, 4)).square().mean().backward()
                record = monitor.collect()
            counted.append(any(e.histogram is not None for e in record.entries))
            log.write(record, step)
    log.close()
    assert counted == [True, False, True, False]
    assert monitor.histograms  # the cadence is the step's, given to arm(): the monitor's own choice stays


def test_arm_histograms_false_leaves_them_out_of_that_step_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    monitor = GradientMonitor(model)
    counted = []
    with monitor.attach():
        for histograms in (False, None, True):
            with monitor.arm(histograms=histograms):
                model(torch.randn(16, 4)).square().mean().backward()
                counted.append(any(e.histogram is not None for e in monitor.collect().entries))
    assert counted == [False, True, True]
    with pytest.raises(ValueError, match="`histograms` expected True, False or None, got 1"):
        monitor.arm(histograms=1)


@pytest.mark.parametrize("value", [0, -5, 1.5, True, None, "10"])
def test_histogram_every_n_steps_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"`histogram_every_n_steps` expected a positive int, got {value!r}"):
        GradientLog(None, histogram_every_n_steps=value)
    with pytest.raises(ValueError, match=rf"`histogram_every_n_steps` expected a positive int, got {value!r}"):
        GradHooks(histogram_every_n_steps=value)


def test_the_report_command_reads_the_summaries_alone(tmp_path, capsys):
    """In a file of packed summaries, the chart events (histograms, scalars) are not parsed: an
    event that is no event, its checksum right, is passed over; the report is the printed one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, writer = GradientMonitor(model), SummaryWriter(str(tmp_path))
    log = GradientLog(writer, optimizers=[optimizer], histogram_every_n_steps=1, echo=None)
    with monitor.attach():
        for step in range(3):
            with monitor.arm():
                model(torch.randn(16, 4)).square().mean().backward()
                log.write(monitor.collect(), step)
            optimizer.step()
            optimizer.zero_grad()
    printed = log.close().table()
    writer.close()
    (path,) = tmp_path.glob("*.gradhooks")
    with open(path, "ab") as f:
        f.write(_record(b"\xff" * 100))  # no event, but not a summary either
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    # the table as printed, then the noise scale's sentence (compared with fit's in test_noise)
    assert without_noise(out) == f"== {tmp_path}\n{printed}\n" and err == ""
    assert out.splitlines()[-1].startswith("GradHooks: gradient noise scale ~ ")
    assert sorted(read_folder(tmp_path).steps) == [0, 1, 2]
