import logging
import math

import pytest
import torch

from lightning_gradhooks.core import stats
from lightning_gradhooks.core.stats import SIZES, Reducer, reduce
from lightning_gradhooks.summary.statistics import STATISTICS, histogram_edges, merge_histograms, pool_stats

#: A tensor read in place on the CPU, block by block, but for its padded last row.
BIG = (1 << 20) + 3


@pytest.fixture(params=["cpu", "accelerator"])
def blocks(request, monkeypatch):
    """The block sizes a test reduces with: the CPU's (cache-sized blocks, big tensors read in
    place), or an accelerator's (a block is the whole batch), run here on the CPU. The ops are
    the same."""
    if request.param == "accelerator":
        monkeypatch.setattr(stats, "SIZES", {})
    return request.param


def reference(t: torch.Tensor) -> dict[str, float]:
    finite = t[torch.isfinite(t)].double()
    std = finite.std().item() if finite.numel() > 1 else 0.0
    return {
        "norm": finite.norm().item(),
        "mean": finite.mean().item(),
        "std": std,
        "absmax": finite.abs().max().item(),
        "nonfinite": float((~torch.isfinite(t)).sum()),
        "zero_fraction": (t == 0).double().mean().item(),  # independent reference
    }


def stats_of(t: torch.Tensor) -> dict[str, float]:
    return dict(zip(STATISTICS, reduce([t])[0][0]))


def counts_of(t: torch.Tensor, bins: int) -> list[float]:
    return reduce([t], bins)[0][1]


# Small tensors are batched, big ones reduced alone (the last fills its rows: read in place).
SHAPES = [(1000,), (7, 13, 5), (2, 1), (BIG,), (2 * SIZES["cpu"].batch,)]


@pytest.mark.parametrize("shape", SHAPES)
def test_statistics_match_reference(shape, blocks):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    got = stats_of(t)
    for name, value in reference(t).items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_a_batch_of_many_shapes_matches_each_tensor_alone(blocks):
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g) * (k + 1) + k for k, n in enumerate([1, 3, 1023, 1024, 1025, 5000, 64])]
    tensors[3][7] = float("inf")
    tensors[4][:] = float("nan")  # a tensor with no finite element, inside a batch
    together = reduce(tensors, bins=16)
    for t, (row, counts) in zip(tensors, together):
        alone = reduce([t], bins=16)[0]
        assert row == pytest.approx(alone[0], rel=1e-6, abs=1e-9)
        assert counts == alone[1]
        want = reference(t) if torch.isfinite(t).any() else {"norm": 0.0, "mean": 0.0, "std": 0.0, "absmax": 0.0}
        for name, value in want.items():
            assert dict(zip(STATISTICS, row))[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
        assert sum(counts) == torch.isfinite(t).sum().item()


@pytest.mark.parametrize("count", [100, 700])  # one batch's bins fit int16 indices, or need int32
def test_histograms_of_a_batch_of_many_tensors_equal_each_alone(count, blocks):
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(64, generator=g) * (k % 7 + 1) for k in range(count)]
    for t, (row, counts) in zip(tensors, reduce(tensors, bins=64)):
        alone = torch.histc(t, bins=64, min=t.min().item(), max=t.max().item())
        assert sum(counts) == 64 and (torch.tensor(counts) - alone).abs().sum() <= 2
        assert row[3] == t.abs().max().item()


def test_mean_far_from_zero_keeps_the_std_exact(blocks):
    t = 1000.0 + torch.randn(BIG, generator=torch.Generator().manual_seed(6)) * 1e-3
    assert stats_of(t)["std"] == pytest.approx(t.double().std().item(), rel=1e-4)
    assert stats_of(t[:100])["std"] == pytest.approx(t[:100].double().std().item(), rel=1e-4)


def test_the_std_stays_exact_when_every_row_starts_with_an_outlier(blocks):
    # The pivot of a row is its first element: the worst case for the one-pass sums is a first
    # element far from every other (here 1,000 standard deviations), on every row.
    t = 1000.0 + torch.randn(BIG, generator=torch.Generator().manual_seed(7)) * 1e-3
    t[:: stats.ROW] += 1.0
    for x in (t, t[:3000]):
        assert stats_of(x)["std"] == pytest.approx(x.double().std().item(), rel=1e-4)
        assert stats_of(x)["mean"] == pytest.approx(x.double().mean().item(), rel=1e-7)


@pytest.mark.parametrize("big", [False, True])
def test_nonfinite_values_are_counted_and_left_out(big, blocks):
    t = torch.tensor([1.0, float("nan"), -3.0, float("inf"), 2.0, float("-inf")])
    if big:  # read in place, a block at a time on the CPU
        t = torch.cat([t, torch.zeros(BIG)])
    got = stats_of(t)
    assert got["nonfinite"] == 3
    assert got["norm"] == pytest.approx(math.sqrt(14))
    assert got["mean"] == pytest.approx(0.0, abs=1e-6)
    assert got["absmax"] == 3
    assert sum(counts_of(t, 4)) == t.numel() - 3


def test_all_nonfinite_tensor_gives_zero_statistics_and_empty_histogram(blocks):
    t = torch.full((5,), float("nan"))
    (row, counts), = reduce([t], bins=8)
    assert row[:4] == (0.0, 0.0, 0.0, 0.0)
    assert row.nonfinite == 5
    assert sum(counts) == 0


@pytest.mark.parametrize("n", [10_000, BIG])
def test_histogram_matches_torch_histc(n, blocks):
    t = torch.randn(n, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor(counts_of(t, 30))
    expected = torch.histc(t, bins=30, min=t.min().item(), max=t.max().item())
    # Elements on a bin edge may fall either side by float rounding.
    assert (counts - expected).abs().sum().item() <= 4 * n / 10_000
    assert counts.sum().item() == t.numel()
    edges = histogram_edges(t.min().item(), t.max().item(), 30)
    assert len(edges) == 30 and edges[-1] == pytest.approx(t.max().item())


@pytest.mark.parametrize("n", [100, BIG])
def test_denormal_and_constant_gradients(n, blocks):
    """A deep stack's vanishing gradients: spans of 1e-42 and runs of equal values."""
    tiny = torch.linspace(0, 1, n) * 1e-42
    for t in (tiny, torch.full((n,), 1e-40), torch.zeros(n)):
        (row, counts), = reduce([t], bins=8)
        assert sum(counts) == n and max(counts) < n or t.max() == t.min()
        assert row[3] == t.abs().max().item()  # squares underflow in float32: std and norm may not


@pytest.fixture
def flush_denormal():
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("n", [100, BIG])
def test_histograms_count_every_element_when_the_user_flushes_denormals(n, flush_denormal, blocks):
    """Under ``torch.set_flush_denormal(True)`` a denormal span reads as 0: one full bin, no NaN."""
    g = torch.Generator().manual_seed(3)
    for t in (torch.linspace(0, 1, n) * 1e-42, torch.randn(n, generator=g) * 1e-39, torch.randn(n, generator=g)):
        together = reduce([t, torch.randn(50, generator=g)], bins=8)
        assert [sum(counts) for _, counts in together] == [n, 50]


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 3])
@pytest.mark.parametrize("bins", [7, 64, 65, 129])
def test_big_histograms_of_gradients_crowded_in_a_few_bins(n, bins, blocks):
    """Half zeros and a heavy tail (a ReLU layer's gradient): most elements in a few bins."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(n, generator=g) * (torch.rand(n, generator=g) > 0.5) * torch.randn(n, generator=g).exp()
    counts = torch.tensor(counts_of(t, bins))
    low, high = t.min().double(), t.max().double()
    expected = torch.bincount(((t.double() - low) / (high - low) * bins).long().clamp(max=bins - 1), minlength=bins)
    assert counts.sum().item() == n
    assert (counts - expected).abs().sum().item() <= 4 * n / 10_000  # elements on a bin edge may fall either side


def test_constant_tensor_histogram_has_one_full_bin(blocks):
    counts = counts_of(torch.zeros(100), 10)
    assert sum(counts) == 100 and max(counts) == 100


def test_half_precision_is_reduced_in_float32(blocks):
    t = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert stats_of(t)["norm"] == pytest.approx(t.float().norm().item(), rel=1e-5)


@pytest.mark.parametrize("n", [4097, BIG])
def test_narrow_range_far_from_zero_keeps_every_element_in_range(n, blocks):
    t = 1000.0 + torch.linspace(0, 1e-3, n)
    counts = counts_of(t, 64)
    assert sum(counts) == t.numel()
    assert counts[0] > 0 and counts[-1] > 0


def test_pooled_rows_equal_the_statistics_of_the_concatenation():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(50, generator=g) * 2 + 1, torch.randn(7, 3, generator=g) - 4, torch.tensor([5.0])]
    parts.append(torch.tensor([float("nan"), 2.0, float("inf")]))
    parts.append(torch.tensor([float("nan")]))  # no finite element at all
    pooled = dict(zip(STATISTICS, pool_stats([row for row, _ in reduce(parts)])))
    for name, value in reference(torch.cat([p.flatten() for p in parts])).items():
        assert pooled[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_merged_histograms_keep_every_count_and_equal_ranges_merge_exactly():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1000, generator=g), torch.randn(300, generator=g) * 3 + 2
    whole = torch.cat([a, b])
    parts = []
    for row, counts in reduce([a, b], bins=16):
        parts.append((row.low, row.high, counts))
    low, high, counts = merge_histograms(parts, 16)
    assert (low, high) == (whole.min().item(), whole.max().item())
    assert sum(counts) == pytest.approx(1300)
    reference_counts = torch.tensor(counts_of(whole, 16))
    # Spreading counts across bins moves mass by at most a bin: the CDFs stay close.
    assert (torch.tensor(counts).cumsum(0) - reference_counts.cumsum(0)).abs().max() < 1300 * 0.05
    # The same range twice merges exactly.
    assert merge_histograms([parts[0], parts[0]], 16)[2] == [2 * c for c in parts[0][2]]
    assert merge_histograms([(2.0, 2.0, [3.0, 0.0]), (2.0, 2.0, [1.0, 0.0])], 2) == (2.0, 2.0, [4.0, 0.0])
    assert merge_histograms([], 3) == (0.0, 0.0, [0.0, 0.0, 0.0])


def test_float64_and_strided_gradients():
    g = torch.Generator().manual_seed(8)
    for n in (100, BIG):
        t = torch.randn(n, dtype=torch.float64, generator=g)
        (row, counts), = reduce([t], bins=16)
        assert row[0] == pytest.approx(t.norm().item(), rel=1e-12) and sum(counts) == n
        strided = torch.randn(2 * n, generator=g)[::2]  # flat but not dense: copied, never read wrong
        (row, counts), = reduce([strided], bins=16)
        assert row[0] == pytest.approx(strided.double().norm().item(), rel=1e-5) and sum(counts) == n


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 4, 5, 6), (8, 64, 16, 16)])  # the last: 131 k elements
def test_channels_last_expanded_and_sparse_gradients_give_what_their_contiguous_copy_gives(shape, blocks):
    """A channels-last gradient is read in place (order does not matter to statistics), an
    expanded one from a dense copy; a sparse one is reduced as its dense tensor."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    expanded = torch.randn(shape[-1], generator=torch.Generator().manual_seed(10)).expand(shape)
    sparse = (t * (t > 1)).to_sparse()
    for x in (t.to(memory_format=fmt), expanded, sparse):
        (row, counts), = reduce([x], bins=16)
        (ref_row, ref_counts), = reduce([x.to_dense().contiguous()], bins=16)
        assert counts == ref_counts
        assert row[3:] == ref_row[3:]
        assert row[:3] == pytest.approx(ref_row[:3], rel=1e-5)


def test_a_batch_is_reduced_in_a_fixed_number_of_ops_reading_the_host_once_per_block(blocks):
    """The same ops whatever the number of tensors in a batch (with an accelerator's blocks; the
    CPU's add a fixed number per cache-sized block), and no value read to the host before
    finish (``.item()`` would wait for the device) but, in the eager sequence, which rows are
    whole and finite: one ``nonzero`` per block and pass (the compiled kernels read nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # views launch nothing
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(11)
    counted = []
    for count in (10, 100):
        tensors = [torch.randn(k % 5 * 300 + 1, generator=g) for k in range(count)]
        tensors[3][0] = float("nan")
        reducer = Reducer(16)
        for k, t in enumerate(tensors):
            reducer.add(t, histogram=k % 2 == 0)
        stats.reduce_batch(tensors, 16, compiled=False)  # layouts are cached per model
        ops = []
        with Ops():  # the eager ops: compiled, each row function is one kernel
            stats.reduce_batch(tensors, 16, compiled=False)
        counted.append(ops)
        (row, counts), *_ = reducer.finish()
        assert row[0] == pytest.approx(tensors[0].norm().item(), rel=1e-5) and sum(counts) == tensors[0].numel()
    assert counted[0] == counted[1]
    assert not [op for op in counted[0] if "local_scalar" in op or op.startswith("item")], counted[0]
    assert counted[0].count("nonzero.default") == 2  # one block, two passes


@pytest.mark.parametrize("bins", [None, 8, 64])
def test_the_cpu_blocks_give_what_an_accelerators_give(monkeypatch, bins):
    """On the CPU big tensors are read in place, a cache-sized block at a time; with an
    accelerator's sizes (a block is the whole batch, run here on the CPU) the same ops give the
    same statistics and histograms."""
    block = SIZES["cpu"].block
    g = torch.Generator().manual_seed(12)
    big = block * 2 + 5  # blocks in place, a padded tail copied
    tensors = [
        torch.randn(big, generator=g) * (torch.rand(big, generator=g) > 0.5),
        torch.randn(4 * block, generator=g) * 1e-3 + 1000.0,  # far from 0
        torch.randn(big, generator=g),
        torch.randn(1023, generator=g),
        torch.randn(1024, generator=g).double(),
        torch.randn(1025, generator=g),
        torch.linspace(0, 1, 3000) * 1e-42,  # a denormal span: the exact 2**64 step
        torch.full((70,), -2.5),
        torch.zeros(0),
        torch.randn(5, generator=g),
    ]
    tensors[2][block + 7] = float("nan")  # in a block read in place
    tensors[2][-1] = float("inf")  # and in the copied tail
    tensors[5][::100] = float("-inf")
    on_cpu = reduce(tensors, bins)
    monkeypatch.setattr(stats, "SIZES", {})
    accelerator = reduce(tensors, bins)
    for t, (row, counts), (expected_row, expected_counts) in zip(tensors, on_cpu, accelerator):
        assert counts == expected_counts
        assert row[3:] == expected_row[3:]  # absmax, nonfinite, zero fraction, count, low, high
        assert row[:3] == pytest.approx(expected_row[:3], rel=1e-6, abs=1e-30)
        finite = t[torch.isfinite(t)].double()
        if finite.numel():
            assert dict(zip(STATISTICS, row))["norm"] == pytest.approx(finite.norm().item(), rel=1e-5)


def _zero_heavy(n: int, share: float, first_zero: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    t[torch.rand(n, generator=g) < share] = 0.0
    t[0] = 0.0 if first_zero else 1.5
    return t


def test_zero_fraction_equals_reference_whatever_the_padding(blocks):
    # Sizes that pad their last row, a NaN, an all-zero tensor.
    tensors = [_zero_heavy(n, s, fz, i) for i, (n, s, fz) in enumerate(
        [(5, 0.5, True), (1000, 0.3, True), (1024, 0.9, False), (40_000, 0.7, True), (3, 0.0, False)]
    )]
    tensors.append(torch.zeros(17))
    with_nan = _zero_heavy(300, 0.5, True, 9)
    with_nan[7] = float("nan")
    tensors.append(with_nan)
    rows = reduce(tensors, bins=8)
    for t, (row, _) in zip(tensors, rows):
        assert row.zero_fraction == pytest.approx((t == 0).double().mean().item(), abs=1e-12)
    pooled = pool_stats([row for row, _ in rows[:4]])
    whole = torch.cat(tensors[:4])
    assert pooled.zero_fraction == pytest.approx((whole == 0).double().mean().item(), abs=1e-12)


# -- compiled and eager ---------------------------------------------------------------------


def _awkward(dtype: torch.dtype) -> list[torch.Tensor]:
    """NaN, Inf and zeros, empty and one-element tensors, non-contiguous and channels-last."""
    g = torch.Generator().manual_seed(13)
    special = torch.randn(3000, generator=g) * 4
    special[::7] = 0.0
    special[5], special[77], special[1500] = float("nan"), float("inf"), float("-inf")
    return [t.to(dtype) for t in (
        special,
        torch.zeros(0),
        torch.tensor([2.5]),
        torch.tensor([float("nan")]),
        torch.randn(40, 30, generator=g).t(),  # non-contiguous
        torch.randn(4, 8, 6, 5, generator=g).to(memory_format=torch.channels_last),
        torch.randn(BIG, generator=g) * 1e-3 + 3.0,  # read in place, far from zero
        torch.zeros(1025),
    )]


def _harder(dtype: torch.dtype) -> list[torch.Tensor]:
    """:func:`_awkward`, and what splits the eager sequence's rows into whole finite rows and the
    others: NaN in a block read in place, Inf in a copied tail, a big tensor with no finite
    element, a denormal span, constant tensors (a whole row and a padded one), a ReLU layer's
    gradient crowded in one bin, a row exactly full, rows across several cache-sized chunks."""
    g = torch.Generator().manual_seed(14)
    holes = torch.randn(BIG, generator=g)
    holes[700], holes[-1], holes[3 * SIZES["cpu"].block + 5] = float("nan"), float("inf"), float("-inf")
    relu = torch.randn(5000, generator=g) * (torch.rand(5000, generator=g) > 0.5)
    extra = (holes, torch.full((SIZES["cpu"].block,), float("nan")), torch.linspace(0, 1, 3000) * 1e-42,
             torch.full((2048,), 0.1), torch.full((70,), -2.5), relu, torch.randn(1024, generator=g) * 1e-30)
    return _awkward(dtype) + [t.to(dtype) for t in extra]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_eager_sequence_gives_the_compiled_numbers(dtype, blocks):
    """compile_statistics=False runs other ops than the compiled kernels (fewer and bigger, fast
    without a compiler): the same statistics, and exactly the same counts."""
    tensors = _harder(dtype)
    compiled, eager = reduce(tensors, bins=32), reduce(tensors, bins=32, compiled=False)
    assert stats._kernels._compiled[stats.row_moments, "cpu"] is not stats.row_moments  # it did compile
    for t, (row, counts), (want_row, want_counts) in zip(tensors, compiled, eager):
        assert counts == want_counts
        assert row[3:] == want_row[3:]  # absmax, nonfinite, zero fraction, count, low, high: exact
        # Summation order: a mean near zero is exact to a small part of the spread.
        assert row[:3] == pytest.approx(want_row[:3], rel=1e-5, abs=1e-5 * want_row[2] + 1e-30)
        assert sum(counts) == torch.isfinite(t).sum().item()
    finite = tensors[0][torch.isfinite(tensors[0])].double()
    assert eager[0][0][0] == pytest.approx(finite.norm().item(), rel=1e-5)
    assert list(eager[1][0][:5]) == [0.0] * 5 and eager[2][0][:2] == pytest.approx([2.5, 2.5], rel=1e-3)


def test_a_monitor_without_compiled_statistics_records_what_a_compiled_one_does():
    from torch import nn

    from lightning_gradhooks import GradientMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10))
    x = torch.randn(4, 3, 32, 32)
    records = []
    for compiled in (True, False):
        monitor = GradientMonitor(model, compile_statistics=compiled, noise_scale=False)
        with monitor.attach(), monitor.arm():
            model(x).square().mean().backward()
            records.append(monitor.collect())
        model.zero_grad(set_to_none=True)
    compiled, eager = records
    assert [e.key for e in compiled.entries] == [e.key for e in eager.entries] and len(eager.entries) > 8
    for a, b in zip(compiled.entries, eager.entries):
        assert a.stats[3:] == b.stats[3:] and a.histogram == b.histogram, a.key
        assert a.stats[:3] == pytest.approx(b.stats[:3], rel=1e-5, abs=1e-5 * b.stats[2] + 1e-30), a.key


def test_compiles_stay_bounded_over_a_loop_of_a_model_with_many_shapes():
    """One kernel per row function whatever the shapes: the row count is dynamic."""
    from torch import nn

    from lightning_gradhooks import GradientMonitor

    widths = [3, 17, 64, 5, 300, 1, 1025, 9, 48, 2000, 7]
    model = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())])
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    monitor = GradientMonitor(model)
    with monitor.attach():
        for batch in (1, 8, 33):  # and different gradient shapes every step
            with monitor.arm():
                model(torch.randn(batch, 3)).sum().backward()
                record = monitor.collect()
    assert len(record.entries) > 30
    assert counters["unique_graphs"] - before <= 2  # both row functions, at most once each (float32)
    for function in (stats.row_moments, stats.row_histograms):
        assert stats._kernels._compiled[function, "cpu"] is not function



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_collect_inside_autocast_compiles_nothing_new_and_gives_the_same_numbers(dtype):
    """collect() inside the caller's autocast block: autocast's state is part of what a compiled
    kernel is guarded on, so without care every kernel would compile again."""
    from torch import nn

    from lightning_gradhooks import GradientMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    monitor = GradientMonitor(model, noise_scale=False)

    def step(inside: bool):
        with monitor.attach(), monitor.arm():
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().square().mean()
                if inside:
                    loss.backward()
                    record = monitor.collect()
            if not inside:
                loss.backward()
                record = monitor.collect()
        model.zero_grad(set_to_none=True)
        return {e.key: (e.stats, e.histogram) for e in record.entries}

    step(False)  # the probe step, and the kernels compiled
    outside = step(False)
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    inside = step(True)
    assert counters["unique_graphs"] == before
    assert inside == outside and len(inside) > 5

@pytest.fixture
def fresh_kernels(monkeypatch):
    """No kernel compiled and nothing said yet in this process, restored afterwards."""
    monkeypatch.setattr(stats._kernels, "_compiled", {})
    monkeypatch.setattr(stats._kernels, "_said", set())


def test_the_eager_ops_run_where_compiling_is_unavailable_said_once(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setattr(stats._kernels, "unavailable", lambda device_type: "no C++ compiler (g++) on PATH")
    tensors = _awkward(torch.float32)
    with caplog.at_level("INFO", logger="lightning_gradhooks"):
        first, second = reduce(tensors, bins=16), reduce(tensors, bins=16)
    said = [r for r in caplog.records if "eager" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO" and "no C++ compiler" in said[0].getMessage()
    assert stats._kernels._compiled[stats.row_moments, "cpu"] is stats.row_moments
    assert first == second == reduce(tensors, bins=16, compiled=False)


def test_a_compile_that_raises_falls_back_to_the_eager_ops_said_once(fresh_kernels, monkeypatch, caplog):
    def broken(function):
        def kernel(*args, **kwargs):
            raise RuntimeError("InductorError: CppCompileError: no such header\nmore lines")
        return kernel

    monkeypatch.setattr(stats._kernels, "_compile", broken)
    tensors = _awkward(torch.float32)
    with caplog.at_level("INFO", logger="lightning_gradhooks"):
        got = reduce(tensors, bins=16)
        reduce(tensors, bins=16)
    said = [r.getMessage() for r in caplog.records if "eager" in r.getMessage()]
    assert said == ["lightning_gradhooks: gradient statistics run as eager torch ops: torch.compile raised "
                    "RuntimeError: InductorError: CppCompileError: no such header"]
    assert got == reduce(tensors, bins=16, compiled=False)


def test_disabled_torch_compile_is_respected(fresh_kernels, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert "disabled" in stats._kernels.unavailable("cpu")
    reduce([torch.randn(10)])
    assert stats._kernels._compiled[stats.row_moments, "cpu"] is stats.row_moments


def test_a_dispatch_mode_of_the_users_runs_the_eager_ops_once_and_leaves_compiling_on(fresh_kernels, caplog):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    seen: list[str] = []
    tensors = _awkward(torch.float32)
    with caplog.at_level("INFO", logger="lightning_gradhooks"), Seen():
        inside = reduce(tensors, bins=16)
    assert any("scatter_add" in name for name in seen)  # the eager ops, visible to the mode
    assert not [r for r in caplog.records if "eager" in r.getMessage()]
    assert inside == reduce(tensors, bins=16, compiled=False)
    reduce(tensors, bins=16)
    assert stats._kernels._compiled[stats.row_moments, "cpu"] is not stats.row_moments


def test_the_first_compile_is_announced_once_before_it_starts(fresh_kernels, caplog):
    from torch import nn

    from lightning_gradhooks import GradientMonitor

    compiled_when_said = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            compiled_when_said.append(dict(stats._kernels._compiled))

    watch = Watch()
    logging.getLogger("lightning_gradhooks").addHandler(watch)
    try:
        with caplog.at_level("INFO", logger="lightning_gradhooks"):
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            monitor = GradientMonitor(model)
            with monitor.attach():
                for _ in range(3):
                    with monitor.arm():
                        model(torch.randn(16, 4)).sum().backward()
                        assert monitor.collect().entries
            reduce(_awkward(torch.float32), bins=16)
    finally:
        logging.getLogger("lightning_gradhooks").removeHandler(watch)
    said = [r for r in caplog.records if r.name == "lightning_gradhooks"]
    assert len(said) == 1 and said[0].levelname == "INFO", [r.getMessage() for r in said]
    assert "compiling" in said[0].getMessage() and "10-30 s" in said[0].getMessage()
    assert compiled_when_said == [{}]  # said before the first kernel was made, let alone run
    assert stats._kernels._compiled[stats.row_moments, "cpu"] is not stats.row_moments
