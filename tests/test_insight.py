"""zero_fraction, the gradient-health report and its CLI."""

from __future__ import annotations

import pytest
import torch

from lightning_gradhooks.stats import STATISTICS, branch_free, pool_stats, reduce


def _zero_heavy(n: int, share: float, first_zero: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    t[torch.rand(n, generator=g) < share] = 0.0
    t[0] = 0.0 if first_zero else 1.5
    return t


@pytest.mark.parametrize("batched", [False, True])
def test_zero_fraction_equals_reference_whatever_the_padding(batched):
    # Sizes that pad their last row (the CPU path pads with the first element), big ones reduced
    # alone, a NaN that sends the batch through the masked path, an all-zero tensor.
    tensors = [_zero_heavy(n, s, fz, i) for i, (n, s, fz) in enumerate(
        [(5, 0.5, True), (1000, 0.3, True), (1024, 0.9, False), (40_000, 0.7, True), (3, 0.0, False)]
    )]
    tensors.append(torch.zeros(17))
    with_nan = _zero_heavy(300, 0.5, True, 9)
    with_nan[7] = float("nan")
    tensors.append(with_nan)
    with branch_free() if batched else torch.no_grad():
        rows = reduce(tensors, bins=8)
    index = STATISTICS.index("zero_fraction")
    for t, (row, _) in zip(tensors, rows):
        assert row[index] == pytest.approx((t == 0).double().mean().item(), abs=1e-12)
    pooled = pool_stats([row for row, _ in rows[:4]])
    whole = torch.cat(tensors[:4])
    assert pooled[index] == pytest.approx((whole == 0).double().mean().item(), abs=1e-12)
