import warnings

import pytest
import torch
from torch import nn

from lightning_gradhooks import STATISTICS, GradientMonitor
from lightning_gradhooks.monitor import select_modules

from conftest import hook_snapshot


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.LayerNorm(10), nn.Linear(10, 2))


def ref_stats(t: torch.Tensor) -> dict[str, float]:
    t = t.double()
    return {
        "norm": t.norm().item(),
        "mean": t.mean().item(),
        "std": t.std().item(),
        "absmax": t.abs().max().item(),
        "nonfinite": 0.0,
    }


def assert_stats(got: dict[str, float], want: dict[str, float]) -> None:
    # rel 1e-5; a mean that cancels to ~0 is compared on the scale of the tensor instead.
    scale = 1e-6 * want["absmax"]
    for name in STATISTICS:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=scale), name


def test_statistics_equal_autograd_reference():
    net = model()
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    names = ["0", "1", "2", "3", "4"]
    monitor = GradientMonitor(net, include=names)
    with monitor.attach():
        (net(x) ** 2).sum().backward()  # the first backward settles which hooks to use
        net.zero_grad()
        monitor.arm()
        (net(x) ** 2).sum().backward()
        record = monitor.collect()
    got = {(e.kind, e.name): e.stats for e in record.entries}

    # Independent reference: capture each module's input and output, differentiate the same loss.
    captured = {}
    handles = [
        net[int(n)].register_forward_hook(lambda m, i, o, n=n: captured.__setitem__(n, (i[0], o))) for n in names
    ]
    loss = (net(x) ** 2).sum()
    for h in handles:
        h.remove()
    tensors = [t for n in names for t in captured[n]]
    grads = torch.autograd.grad(loss, tensors + list(net.parameters()))
    for i, n in enumerate(names):
        assert_stats(got[("grad_input", n)], ref_stats(grads[2 * i]))
        assert_stats(got[("grad_output", n)], ref_stats(grads[2 * i + 1]))
    for (pname, _), grad in zip(net.named_parameters(), grads[len(tensors) :]):
        assert_stats(got[("param_grad", pname)], ref_stats(grad))
    assert len(record.entries) == 2 * len(names) + len(list(net.parameters()))


def test_backward_order_and_histograms():
    net = model()
    monitor = GradientMonitor(net, bins=16)
    with monitor.attach():
        monitor.arm()
        net(torch.randn(4, 6)).sum().backward()
        record = monitor.collect()
    outputs = [e.name for e in record.entries if e.kind == "grad_output"]
    assert outputs == ["4", "3", "2", "0"]  # backward order; Tanh owns no parameter
    for e in record.entries:
        if e.kind == "grad_input":
            assert e.histogram is None
        else:
            assert len(e.histogram.counts) == 16
            assert sum(e.histogram.counts) == pytest.approx(e.stats["norm"] * 0 + sum(e.histogram.counts))
    first_input = [e for e in record.entries if e.kind == "grad_input"]
    assert "0" not in [e.name for e in first_input]  # its input needs no grad


def test_unarmed_hooks_do_nothing_and_collect_is_empty():
    net = model()
    monitor = GradientMonitor(net)
    with monitor.attach():
        net(torch.randn(4, 6)).sum().backward()
        assert monitor._pending == []
        assert monitor.collect().entries == []


def test_handle_restores_every_hook_and_flag():
    net = model()
    net[2].register_forward_hook(lambda *a: None)
    before = hook_snapshot(net)
    monitor = GradientMonitor(net)
    handle = monitor.attach()
    net(torch.randn(2, 6)).sum().backward()
    assert monitor.attach() is handle  # attaching twice does not double the hooks
    assert all(len(net[i]._backward_hooks) == 1 for i in (0, 2, 3, 4))
    assert len(net[2]._forward_hooks) == 1 and not net[0]._forward_hooks  # the probe is gone
    handle.remove()
    handle.remove()
    assert hook_snapshot(net) == before
    net[0].register_backward_hook(lambda *a: None)  # legacy hooks are allowed again


def test_modules_with_legacy_hooks_are_skipped_with_a_warning():
    net = model()
    net[0].register_backward_hook(lambda *a: None)
    monitor = GradientMonitor(net)
    handle = monitor.attach()
    with pytest.warns(UserWarning, match="legacy.*: 0$"):
        net(torch.randn(2, 6)).sum().backward()
    assert len(net[0]._backward_hooks) == 1
    handle.remove()


def test_no_torch_warning_when_first_input_needs_no_grad():
    net = model()
    monitor = GradientMonitor(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = monitor.attach()
        for _ in range(3):
            monitor.arm()
            net(torch.randn(4, 6)).sum().backward()
            monitor.collect()
        handle.remove()
    assert not [f for f in warnings.filters if "Full backward hook" in str(f[1])]


def test_default_selection_is_modules_owning_trainable_parameters():
    net = model()
    net[2].requires_grad_(False)
    assert list(select_modules(net)) == ["0", "3", "4"]
    assert list(select_modules(net, include=["*"], exclude=["", "1"])) == ["0", "2", "3", "4"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(include=["encoder.*"]), "'encoder.\\*' matches no module.*'0'"),
        (dict(exclude=["nope"]), "`exclude` pattern 'nope'"),
        (dict(include="0"), "expected a list of glob patterns"),
        (dict(include=["1"]), None),
        (dict(bins=0), "`bins` expected a positive int, got 0"),
    ],
)
def test_selection_errors(kwargs, message):
    if message is None:
        assert list(GradientMonitor(model(), **kwargs).modules) == ["1"]
        return
    with pytest.raises(ValueError, match=message):
        GradientMonitor(model(), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(ValueError, match="expected a torch.nn.Module, got function"):
        GradientMonitor(lambda x: x)


def test_modules_called_twice_keep_every_call():
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.Tanh(), lin)
    monitor = GradientMonitor(net)
    with monitor.attach():
        monitor.arm()
        net(torch.randn(2, 3)).sum().backward()
        names = [e.name for e in monitor.collect().entries if e.kind == "grad_output"]
    assert names == ["0", "0#2"]


def test_core_modules_never_import_lightning():
    import subprocess
    import sys

    code = (
        "import sys; from lightning_gradhooks import GradientMonitor, save_on_disk, STATISTICS;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    from lightning_gradhooks import GradHooks  # the callback is still one import away

    assert GradHooks.__module__ == "lightning_gradhooks.callback"
