import math

import pytest
import torch

from lightning_gradhooks.stats import (
    STATISTICS,
    histogram_edges,
    merge_histograms,
    pool_stats,
    tensor_histogram,
    tensor_stats,
)


def reference(t: torch.Tensor) -> dict[str, float]:
    finite = t[torch.isfinite(t)].double()
    std = finite.std().item() if finite.numel() > 1 else 0.0
    return {
        "norm": finite.norm().item(),
        "mean": finite.mean().item(),
        "std": std,
        "absmax": finite.abs().max().item(),
        "nonfinite": float((~torch.isfinite(t)).sum()),
    }


@pytest.mark.parametrize("shape", [(1000,), (7, 13, 5), (2, 1)])
def test_statistics_match_reference(shape):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    got = dict(zip(STATISTICS, tensor_stats(t)[: len(STATISTICS)].tolist()))
    for name, value in reference(t).items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_nonfinite_values_are_counted_and_left_out():
    t = torch.tensor([1.0, float("nan"), -3.0, float("inf"), 2.0, float("-inf")])
    got = dict(zip(STATISTICS, tensor_stats(t)[: len(STATISTICS)].tolist()))
    assert got["nonfinite"] == 3
    assert got["norm"] == pytest.approx(math.sqrt(14))
    assert got["mean"] == pytest.approx(0.0)
    assert got["absmax"] == 3
    counts = tensor_histogram(t, tensor_stats(t), bins=4)
    assert counts.sum().item() == 3


def test_all_nonfinite_tensor_gives_zero_statistics_and_empty_histogram():
    t = torch.full((5,), float("nan"))
    stats = tensor_stats(t)
    assert stats[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert stats[4].item() == 5
    assert tensor_histogram(t, stats, bins=8).sum().item() == 0


def test_histogram_matches_torch_histc():
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    counts = tensor_histogram(t, tensor_stats(t), bins=30)
    expected = torch.histc(t, bins=30, min=t.min().item(), max=t.max().item())
    # Elements on a bin edge may fall either side by float rounding.
    assert (counts - expected).abs().sum().item() <= 4
    assert counts.sum().item() == t.numel()
    edges = histogram_edges(t.min().item(), t.max().item(), 30)
    assert len(edges) == 30 and edges[-1] == pytest.approx(t.max().item())


def test_constant_tensor_histogram_has_one_full_bin():
    t = torch.zeros(100)
    counts = tensor_histogram(t, tensor_stats(t), bins=10)
    assert counts.sum().item() == 100 and counts.max().item() == 100


def test_half_precision_is_reduced_in_float32():
    t = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = tensor_stats(t)
    assert got.dtype == torch.float32
    assert got[0].item() == pytest.approx(t.float().norm().item(), rel=1e-5)


def test_narrow_range_far_from_zero_keeps_every_element_in_range():
    t = 1000.0 + torch.linspace(0, 1e-3, 4097)
    counts = tensor_histogram(t, tensor_stats(t), bins=64)
    assert counts.sum().item() == t.numel()
    assert counts[0].item() > 0 and counts[-1].item() > 0


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_branch_free_accelerator_path_agrees_with_cpu_path(poison):
    """The path used on GPUs (no host reads) must give what the CPU fast path gives."""
    from lightning_gradhooks.stats import _histogram_host_range, _histogram_on_device, _masked_stats

    t = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 2 - 0.3
    if poison is not None:
        t[::100] = poison
    fast, masked = tensor_stats(t), _masked_stats(t)
    assert torch.allclose(fast, masked, rtol=1e-5, atol=1e-6)
    assert torch.equal(_histogram_host_range(t, fast, 32), _histogram_on_device(t, masked, 32))


def test_pooled_rows_equal_the_statistics_of_the_concatenation():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(50, generator=g) * 2 + 1, torch.randn(7, 3, generator=g) - 4, torch.tensor([5.0])]
    parts.append(torch.tensor([float("nan"), 2.0, float("inf")]))
    parts.append(torch.tensor([float("nan")]))  # no finite element at all
    pooled = dict(zip(STATISTICS, pool_stats([tensor_stats(p).tolist() for p in parts])))
    for name, value in reference(torch.cat([p.flatten() for p in parts])).items():
        assert pooled[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_merged_histograms_keep_every_count_and_equal_ranges_merge_exactly():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1000, generator=g), torch.randn(300, generator=g) * 3 + 2
    whole = torch.cat([a, b])
    parts = []
    for t in (a, b):
        s = tensor_stats(t)
        parts.append((s[6].item(), s[7].item(), tensor_histogram(t, s, 16).tolist()))
    low, high, counts = merge_histograms(parts, 16)
    assert (low, high) == (whole.min().item(), whole.max().item())
    assert sum(counts) == pytest.approx(1300)
    reference_counts = tensor_histogram(whole, tensor_stats(whole), 16)
    # Spreading counts across bins moves mass by at most a bin: the CDFs stay close.
    assert (torch.tensor(counts).cumsum(0) - reference_counts.cumsum(0)).abs().max() < 1300 * 0.05
    # The same range twice merges exactly.
    assert merge_histograms([parts[0], parts[0]], 16)[2] == [2 * c for c in parts[0][2]]
    assert merge_histograms([(2.0, 2.0, [3.0, 0.0]), (2.0, 2.0, [1.0, 0.0])], 2) == (2.0, 2.0, [4.0, 0.0])
    assert merge_histograms([], 3) == (0.0, 0.0, [0.0, 0.0, 0.0])
