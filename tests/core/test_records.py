"""The record of a step: kinds, statistics rows, pooling, unscaling and the step summary."""

import json

import pytest
import torch

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

from lightning_gradhooks.log._tensorboard import section, stats_value
from lightning_gradhooks.summary.events import SummaryReader, read_event
from lightning_gradhooks.summary.records import (
    GRADIENT_KINDS, GradientEntry, GradientRecord, Histogram, Key, Kind, pool_entries, single_entry, step_summary,
)
from lightning_gradhooks.core.stats import reduce
from lightning_gradhooks.summary.statistics import STATISTICS, StatsRow


def _entries(kind: Kind, name: str, tensors: list[torch.Tensor], bins: int = 8) -> GradientEntry:
    return pool_entries(kind, name, reduce(tensors, bins), bins)


def test_kinds_are_written_as_their_values():
    assert [str(k) for k in GRADIENT_KINDS] == ["grad_output", "grad_input", "param_grad"]
    assert json.dumps([Kind.PARAM_GRAD]) == '["param_grad"]'
    assert section(Kind.GRAD_OUTPUT, "norm") == "∇2 grad_output_norm"
    assert Key("grad_output", "a") == Key(Kind.GRAD_OUTPUT, "a")  # equal, and hashed alike
    assert Key("grad_output", "a") in {Key(Kind.GRAD_OUTPUT, "a"): 1}


def test_a_statistics_row_is_named_in_the_order_of_the_statistics():
    (row, counts), = reduce([torch.tensor([3.0, -4.0, 0.0, float("inf")])], bins=2)
    assert isinstance(row, StatsRow) and row._fields[: len(STATISTICS)] == STATISTICS
    assert row.norm == pytest.approx(5.0) and (row.absmax, row.nonfinite, row.count, row.low, row.high) == (4.0, 1.0, 3.0, -4.0, 3.0)
    assert row.zero_fraction == 0.25 and sum(counts) == 3


def test_pooled_entries_are_those_of_the_concatenated_gradients():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(50, generator=g), torch.randn(7, generator=g) * 5, torch.tensor([float("nan"), 0.0])]
    pooled = _entries(Kind.GRAD_OUTPUT, "m", parts)
    whole = single_entry(Kind.GRAD_OUTPUT, "m", *reduce([torch.cat(parts)], 8)[0])
    assert pooled.calls == 3 and whole.calls == 1 and pooled.count == whole.count == 58
    assert list(pooled.stats) == pytest.approx(list(whole.stats), rel=1e-5)  # float32 sums
    assert sum(pooled.histogram.counts) == sum(whole.histogram.counts) == 58
    assert (pooled.histogram.low, pooled.histogram.high) == (whole.stats.low, whole.stats.high)
    # Without a histogram in one part, the pooled entry has none.
    mixed = pool_entries(Kind.GRAD_INPUT, "m", [reduce(parts[:1], 8)[0], (reduce(parts[1:2])[0][0], None)], 8)
    assert mixed.histogram is None and mixed.calls == 2


def test_unscaled_divides_what_scales_with_the_gradient_and_only_for_the_kinds_asked():
    g = torch.tensor([1.0, -2.0, 0.0, float("nan")]) * 1024
    out = single_entry(Kind.GRAD_OUTPUT, "m", *reduce([g], 4)[0])
    param = single_entry(Kind.PARAM_GRAD, "m.weight", *reduce([g], 4)[0])
    record = GradientRecord([out, param], bins=4)
    unscaled = record.unscaled(1024.0)
    want = single_entry(Kind.GRAD_OUTPUT, "m", *reduce([g / 1024], 4)[0])
    assert list(unscaled.entries[0].stats) == pytest.approx(list(want.stats))
    assert unscaled.entries[0].histogram == Histogram(want.stats.low, want.stats.high, out.histogram.counts)
    assert unscaled.entries[1] == param  # parameter gradients are unscaled by the scaler itself
    assert record.entries[0] == out  # a copy: the record is unchanged


def test_the_step_summary_holds_every_statistic_and_what_the_log_adds():
    parts = [torch.ones(3), torch.zeros(2)]
    record = GradientRecord([_entries(Kind.GRAD_OUTPUT, "m", parts), _entries(Kind.PARAM_GRAD, "m.weight", parts[:1])])
    summary = step_summary(record.for_optimizer(1), optimizer=1, unowned=["m.bias"], noise={"trace": 2.0})
    assert list(summary) == [Key(Kind.GRAD_OUTPUT, "m", 1), Key(Kind.PARAM_GRAD, "m.weight", 1),
                             Key(Kind.PARAM, "m.bias", 1), Key(Kind.NOISE, "gradient")]
    assert summary[Key(Kind.GRAD_OUTPUT, "m", 1)] == {**dict(zip(STATISTICS, record.entries[0].stats)), "calls": 2}
    assert "calls" not in summary[Key(Kind.PARAM_GRAD, "m.weight", 1)]
    assert summary[Key(Kind.PARAM, "m.bias", 1)] == {"in_optimizer": 0.0}
    updates = step_summary(updates={"m.weight": (0.1, 2.0)}, caught=["m.weight"], checked=2)
    assert updates == {Key(Kind.PARAM, "m.weight"): {"update_ratio": 0.1, "param_norm": 2.0},
                       Key(Kind.CAUGHT, "m.weight"): {"nonfinite": 1.0, "checked": 2.0}}


def test_the_optimizer_index_is_a_field_written_as_a_prefix_and_read_back():
    key = Key(Kind.GRAD_OUTPUT, "lstm/0", 3)
    assert (key.label, key.module) == ("optimizer_3/lstm/0", "optimizer_3/lstm")
    assert Key(Kind.PARAM_GRAD, "net.2.bias").module == "net.2" and Key(Kind.PARAM, "scale").module == "(model)"
    summary = {key: {"norm": 1.0}, Key(Kind.PARAM, "w"): {"update_ratio": 0.5}}
    value = stats_value(summary)
    assert json.loads(value.metadata.plugin_data.content)["keys"] == [["grad_output", "optimizer_3/lstm/0", ["norm"]],
                                                                     ["param", "w", ["update_ratio"]]]
    step, (read,) = read_event(Event(step=7, summary=SummaryProto(value=[value])).SerializeToString())
    assert step == 7 and SummaryReader().read(read) == summary
    assert Key.of_label("grad_output", "optimizer_x/m") == Key(Kind.GRAD_OUTPUT, "optimizer_x/m")
