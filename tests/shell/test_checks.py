"""Argument checks: ``GradHooks``, ``GradientMonitor`` and
``save_on_disk`` refuse a bad argument at construction with a ValueError that names the
argument, what is accepted and the value received."""

import pytest
import torch
from torch import nn

from lightning_gradhooks import GradHooks, GradientMonitor, save_on_disk
from lightning_gradhooks.core.monitor import select_modules


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def patterns():  # noqa: ANN201
    yield "0"


CALLBACK_CASES = [
    (dict(include=patterns()), r"`include` expected a non-empty list of glob patterns \(str\) or None, got <generator"),
    (dict(exclude=patterns()), r"`exclude` expected a list of glob patterns \(str\) or None, got <generator"),
    (dict(include={"net.0"}), r"`include` expected .* got \{'net.0'\}"),
    (dict(include=[]), r"`include` expected a non-empty list of glob patterns \(str\) or None, got \[\]"),
    (dict(statistics=5), r"`statistics` expected a list drawn from \['norm', .*'param_norm'\], got 5"),
    (dict(statistics=iter(["norm"])), r"`statistics` expected a list drawn from .* got <list_iterator"),
    (dict(histogram_bins=10**12), "`histogram_bins` expected an int from 1 to 4096, got 1000000000000"),
    (dict(histograms="no"), r"`histograms` expected a bool \(True or False\), got 'no'"),
    (dict(histograms=None), r"`histograms` expected a bool \(True or False\), got None"),
    (dict(compile_statistics="eager"), r"`compile_statistics` expected a bool \(True or False\), got 'eager'"),
    (dict(every_n_steps=3.0), "`every_n_steps` expected a positive int or None, got 3.0"),
    (dict(offload_threshold_bytes=-1), "`offload_threshold_bytes` expected a positive int or None, got -1"),
]


@pytest.mark.parametrize("kwargs, message", CALLBACK_CASES)
def test_gradhooks_refuses_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradHooks(**kwargs)


MONITOR_CASES = [
    (dict(include=patterns()), r"`include` expected a non-empty list of glob patterns \(str\) or None, got <generator"),
    (dict(exclude=patterns()), r"`exclude` expected a list of glob patterns \(str\) or None, got <generator"),
    (dict(include="0"), r"`include` expected .* got '0'"),
    (dict(include=[]), r"`include` expected a non-empty list of glob patterns \(str\) or None, got \[\]"),
    (dict(bins=10**12), "`bins` expected an int from 1 to 4096, got 1000000000000"),
    (dict(bins=4097), "`bins` expected an int from 1 to 4096, got 4097"),
    (dict(bins=True), "`bins` expected an int from 1 to 4096, got True"),
    (dict(histograms="no"), r"`histograms` expected a bool \(True or False\), got 'no'"),
    (dict(parameters="no"), r"`parameters` expected a bool \(True or False\), got 'no'"),
    (dict(forward_checks="no"), r"`forward_checks` expected a bool \(True or False\), got 'no'"),
    (dict(forward_checks=1), r"`forward_checks` expected a bool \(True or False\), got 1"),
    (dict(compile_statistics=None), r"`compile_statistics` expected a bool \(True or False\), got None"),
]


@pytest.mark.parametrize("kwargs, message", MONITOR_CASES)
def test_gradient_monitor_refuses_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientMonitor(model(), **kwargs)


def test_select_modules_shares_the_pattern_checks():
    with pytest.raises(ValueError, match=r"`include` expected a non-empty list .* got \[\]"):
        select_modules(model(), include=[])
    with pytest.raises(ValueError, match=r"`exclude` expected .* got <generator"):
        select_modules(model(), exclude=patterns())


def test_accepted_forms_keep_their_meaning():
    # None: the default selection; a tuple is as good as a list; exclude=[] excludes nothing.
    assert list(GradientMonitor(model()).modules) == ["0", "2", "4"]
    assert list(GradientMonitor(model(), include=("0", "4"), exclude=[]).modules) == ["0", "4"]
    assert list(GradientMonitor(model(), bins=4096, histograms=False).modules) == ["0", "2", "4"]
    callback = GradHooks(include=("net.0",), exclude=(), statistics=("norm",), histogram_bins=4096)
    assert callback.include == ["net.0"] and callback.exclude == [] and callback.statistics == ["norm"]
    assert GradHooks().include is None  # the default selection


def test_a_monitor_arm_when_must_be_a_bool():
    monitor = GradientMonitor(model())
    with pytest.raises(ValueError, match=r"`when` expected a bool \(True or False\), got 0"):
        monitor.arm(when=0)
    assert not monitor.armed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(threshold_bytes="1M"), "`threshold_bytes` expected a non-negative int, got '1M'"),
        (dict(threshold_bytes=1, max_bytes_in_flight=None), "`max_bytes_in_flight` expected a positive int, got None"),
        (dict(threshold_bytes=1, prefetch_bytes=1.0), "`prefetch_bytes` expected a non-negative int, got 1.0"),
        (dict(threshold_bytes=1, segment_bytes=0), "`segment_bytes` expected a positive int, got 0"),
        (dict(threshold_bytes=1, fix_mmap_threshold="no"), r"`fix_mmap_threshold` expected a bool \(True or False\), got 'no'"),
        (dict(threshold_bytes=1, directory=b"/tmp"), r"`directory` expected a str, os.PathLike or None, got b'/tmp'"),
    ],
)
def test_save_on_disk_refuses_at_construction_with_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        save_on_disk(**kwargs)
