"""_kernels.py: a row function compiled (one kernel for every row count, a lone row included), or
its eager counterpart; a compiled source run eagerly a block of rows at a time; why a compile
cannot happen. (The fallbacks of a compile
that raises or is unavailable: test_stats.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradhooks.core import _kernels, stats


def scaled(x: torch.Tensor, scale: torch.Tensor, *, power: int) -> torch.Tensor:
    return x.pow(power).sum(1) * scale


def test_run_without_compiling_calls_the_eager_counterpart_with_the_whole_block():
    calls = []

    def eager(x: torch.Tensor, scale: torch.Tensor, *, power: int) -> torch.Tensor:
        calls.append((len(x), len(scale), power))
        return scaled(x, scale, power=power)

    x, scale = torch.randn(7, 5), torch.rand(7)
    got = _kernels.run(scaled, eager, False, x, scale, power=2)
    assert calls == [(7, 7, 2)]
    torch.testing.assert_close(got, scaled(x, scale, power=2))
    assert not got.requires_grad


def test_a_compiled_source_runs_eagerly_a_block_of_rows_at_a_time_with_its_per_row_tensors_and_constants():
    blocks = []

    def recorded(x: torch.Tensor, scale: torch.Tensor, *, power: int) -> torch.Tensor:
        blocks.append((len(x), len(scale)))
        return scaled(x, scale, power=power)

    rows = 2 * _kernels.EAGER_ROWS + 3
    x, scale = torch.randn(rows, 5), torch.rand(rows)
    got = _kernels.rows_at_a_time(recorded, x, scale, power=2)
    assert blocks == [(_kernels.EAGER_ROWS, _kernels.EAGER_ROWS)] * 2 + [(3, 3)]
    torch.testing.assert_close(got, scaled(x, scale, power=2))


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_of_the_callers_the_eager_ops_run_where_it_sees_them():
    x, scale = torch.randn(4, 3), torch.ones(4)
    with Ops() as mode:
        got = _kernels.run(scaled, scaled, True, x, scale, power=3)
    assert "pow.Tensor_Scalar" in mode.ops and "mul.Tensor" in mode.ops
    torch.testing.assert_close(got, scaled(x, scale, power=3))


@pytest.mark.skipif(_kernels.unavailable("cpu") is not None, reason="no torch.compile for the CPU here")
@pytest.mark.parametrize("rows", [1, 3])
def test_a_compiled_run_agrees_with_the_eager_one_for_a_lone_row_too(rows):
    # row_moments: the kernel the monitor compiles anyway, once per process.
    x = torch.randn(rows, 33)
    x[0, 0] = float("nan")
    torch.testing.assert_close(_kernels.run(stats.row_moments, stats.eager_moments, True, x),
                               _kernels.run(stats.row_moments, stats.eager_moments, False, x), equal_nan=True)


def test_unavailable_says_why_torch_compile_cannot_be_used(monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert "torch.compile is disabled" in _kernels.unavailable("cpu")
    monkeypatch.delenv("TORCH_COMPILE_DISABLE")
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setenv("PATH", "")
    assert _kernels.unavailable("cpu") == "no C++ compiler (no-such-c++) on PATH"


def histograms(x: torch.Tensor, ranges: torch.Tensor, bins: int) -> torch.Tensor:
    return stats.row_histograms(x, ranges, bins)


@pytest.mark.skipif(_kernels.unavailable("cpu") is not None, reason="no torch.compile for the CPU here")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_scatter_runs_on_pieces_of_a_block_in_parallel_cpu_code_with_the_same_counts(monkeypatch, threads):
    """With more than one thread, the histogram's compiled code (a scatter) is called on at most
    SCATTER_ROWS rows at a time; with one, on the whole block. The counts are the eager ones."""
    assert stats.row_histograms in _kernels._scatters
    calls = []
    call = _kernels._call
    monkeypatch.setattr(_kernels, "_call", lambda kernel, x, *rows, **constants: calls.append(len(x)) or call(kernel, x, *rows, **constants))
    monkeypatch.setattr(_kernels, "SCATTER_ROWS", 4)
    # A row function of its own (the histogram's, inlined): compiled here, whatever this process's
    # earlier tests compiled of row_histograms or made it fall back from.
    monkeypatch.setattr(_kernels, "_scatters", {histograms})
    monkeypatch.setattr(_kernels, "_compiled", {})
    x = torch.randn(10, 1024, generator=torch.Generator().manual_seed(0)) ** 3
    x[3, 7] = float("nan")
    finite = torch.where(x.isfinite(), x, 0.0)
    low, high = finite.amin(), finite.amax()
    ranges = torch.stack([low.expand(10), torch.ones(10), (8 * (1 - 1e-6) / (high - low)).expand(10),
                          x.isfinite().sum(1).float()], 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kernels.run(histograms, stats.eager_histograms, True, x, ranges, bins=8)
    finally:
        torch.set_num_threads(previous)
    assert calls == ([4, 4, 2] if threads > 1 else [10])
    expected = _kernels.run(stats.row_histograms, stats.eager_histograms, False, x, ranges, bins=8)
    assert torch.equal(got, expected) and got[3].sum() == 1024 and got[3, 8] == 1  # the NaN: the last bin
