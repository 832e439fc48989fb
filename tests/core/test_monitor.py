import collections
import dataclasses
import functools
import warnings

import pytest
import torch
from torch import nn

from lightning_gradhooks import STATISTICS, GradientMonitor
from lightning_gradhooks.core.monitor import Read, select_modules

from conftest import calls_into_the_library, graph_nodes, hook_snapshot


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
        "zero_fraction": (t == 0).double().mean().item(),  # independent reference
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
        with monitor.arm():  # the first armed backward settles which hooks to use
            (net(x) ** 2).sum().backward()
        net.zero_grad()
        monitor.arm()
        (net(x) ** 2).sum().backward()
        record = monitor.collect()
    got = {(e.kind, e.name): e.stats._asdict() for e in record.entries}

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
    for n in names:  # the outputs (activations=True, the default), batched with the gradients
        assert_stats(got[("output", n)], ref_stats(captured[n][1].detach()))
    assert len(record.entries) == 3 * len(names) + len(list(net.parameters()))


class Residual(nn.Module):
    """An input used twice (a module and a skip), a module called twice, a two-input module."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.shared, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Bilinear(6, 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x)) + x  # x also feeds the skip
        h = self.shared(self.shared(h))
        return self.head(h, h * 2)


def test_grad_input_and_grad_output_equal_what_full_backward_hooks_receive():
    torch.manual_seed(3)
    net, x = Residual(), torch.randn(5, 6, requires_grad=True)
    monitor = GradientMonitor(net, parameters=False, activations=False)
    with monitor.attach():
        for _ in range(2):  # the probe step, then the planned hooks
            monitor.arm()
            (net(x) ** 2).sum().backward()
            record = monitor.collect()
    total, = torch.autograd.grad((net(x) ** 2).sum(), x)  # through inner and through the skip
    # The reference: what full backward hooks on the same modules receive.
    seen = collections.defaultdict(list)
    for name in ("inner", "shared", "head"):
        getattr(net, name).register_full_backward_hook(
            lambda m, gi, go, name=name: seen[name].append((gi, go))
        )
    (net(x) ** 2).sum().backward()

    def pooled(tensors):  # the monitor pools the calls of one module as if concatenated
        return ref_stats(torch.cat([t.flatten() for t in tensors]))

    got = {(e.kind, e.name): e for e in record.entries}
    for name, calls in seen.items():
        outputs = [go[0] for _, go in calls]
        assert got["grad_output", name].calls == len(calls)
        assert_stats(got["grad_output", name].stats._asdict(), pooled(outputs))
        n_inputs = len(calls[0][0])
        for i in range(n_inputs):
            label = name if n_inputs == 1 else f"{name}/{i}"
            assert_stats(got["grad_input", label].stats._asdict(), pooled([gi[i] for gi, _ in calls]))
    # inner's share, not the input's total gradient (which a hook on x itself would see)
    assert got["grad_input", "inner"].stats.norm != pytest.approx(total.norm().item(), rel=1e-2)
    assert {k for k, _ in got} == {"grad_output", "grad_input"}


class Doubled(nn.Linear):
    """A subclass of Linear whose forward makes two nodes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class Mixed(nn.Module):
    """A Linear, a Linear on 3-D input (a view, addmm and a view), a subclass, and a Linear that
    gets a 3-D input only when ``wide`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.flat, self.seq, self.sub, self.late = nn.Linear(6, 6), nn.Linear(6, 6), Doubled(6, 6), nn.Linear(6, 6)
        self.wide = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sub(self.seq(self.flat(x).tanh().unsqueeze(1).expand(-1, 3, -1)))
        late = self.late(h if self.wide else h.sum(1))
        return late.sum(1) if self.wide else late


def full_hook_reference(net: nn.Module, x: torch.Tensor, names: list[str]) -> dict[tuple[str, str], torch.Tensor]:
    seen = {}
    handles = [
        getattr(net, n).register_full_backward_hook(
            lambda m, gi, go, n=n: seen.update({("grad_output", n): go[0], ("grad_input", n): gi[0]})
        )
        for n in names
    ]
    (net(x) ** 2).sum().backward()
    for h in handles:
        h.remove()
    net.zero_grad()
    return seen


def test_every_planned_module_reads_grad_input_as_a_full_backward_hook_would():
    """A Linear on 2-D input (read from the edge of its ``addmm`` node: no view, no pre-hook),
    one on 3-D input (a view, addmm and a view), a subclass (both read through a view of their
    input: one forward pre-hook, one ``ViewBackward0`` node per input), and a Linear whose input
    becomes 3-D after two logged steps: that step reads its grad_output alone, says so, and reads
    it through a view from the next one. Each gives what ``register_full_backward_hook`` receives."""
    torch.manual_seed(4)
    net, x = Mixed(), torch.randn(5, 6, requires_grad=True)
    names = ["flat", "seq", "sub", "late"]
    monitor = GradientMonitor(net, parameters=False, activations=False, attention_logits=False)  # (their hooks: test_forward_stats)
    assert {p.read for p in monitor.plan.values()} == {Read.PROBE}
    pre_hooks = [[1, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    with monitor.attach():
        for step, wide in enumerate((False, False, True, True)):  # the probe step, then the planned hooks
            net.wide = wide
            want = full_hook_reference(net, x, names)
            monitor.arm()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                loss = (net(x) ** 2).sum()
            nodes = graph_nodes(loss)
            assert [len(getattr(net, n)._forward_pre_hooks) for n in names] == pre_hooks[step]
            assert [str(w.message).split(":")[0] for w in said] == (["late"] if step == 2 else [])
            loss.backward()
            got = {(e.kind, e.name): e.stats._asdict() for e in monitor.collect().entries}
            expected = {k for k in want if k[0] == "grad_output" or (step > 0 and (step != 2 or k[1] != "late"))}
            assert set(got) == expected
            for key in expected:
                assert_stats(got[key], ref_stats(want[key]))
            if step == 1:
                assert {n: p.read for n, p in monitor.plan.items()} == {
                    "flat": Read.EDGE, "seq": Read.VIEWS, "sub": Read.VIEWS, "late": Read.EDGE}
        assert {n: p.read for n, p in monitor.plan.items()} == {
            "flat": Read.EDGE, "seq": Read.VIEWS, "sub": Read.VIEWS, "late": Read.VIEWS}
        assert "not one op" in monitor.plan["late"].reason
        assert nodes["ViewBackward0"] == graph_nodes((net(x) ** 2).sum())["ViewBackward0"] + 3


def test_parametrized_linear_is_still_read_exactly():
    """weight_norm makes the Linear a ``ParametrizedLinear`` (a subclass, whose weight is made by
    nodes of its own on every call): it is read through a view, and equals a full hook."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), torch.nn.utils.parametrizations.weight_norm(nn.Linear(6, 4)))
    x = torch.randn(5, 6, requires_grad=True)
    monitor = GradientMonitor(net, parameters=False)
    with monitor.attach():
        for _ in range(2):
            monitor.arm()
            (net(x) ** 2).sum().backward()
            record = monitor.collect()
    want = full_hook_reference(net, x, ["2"])
    got = {(e.kind, e.name): e.stats._asdict() for e in record.entries}
    assert_stats(got["grad_input", "2"], ref_stats(want["grad_input", "2"]))
    assert_stats(got["grad_output", "2"], ref_stats(want["grad_output", "2"]))


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
        if e.kind in ("grad_input", "output"):
            assert e.histogram is None
        else:
            assert len(e.histogram.counts) == 16
            assert sum(e.histogram.counts) == pytest.approx(e.stats.norm * 0 + sum(e.histogram.counts))
    first_input = [e for e in record.entries if e.kind == "grad_input"]
    assert "0" not in [e.name for e in first_input]  # its input needs no grad


def test_unarmed_hooks_do_nothing_and_collect_is_empty():
    net = model()
    monitor = GradientMonitor(net)
    with monitor.attach():
        net(torch.randn(4, 6)).sum().backward()
        assert not monitor.pending
        assert monitor.collect().entries == []


def test_collect_parameters_leaves_the_armed_steps_hook_statistics_pending():
    net = model()
    monitor = GradientMonitor(net, noise_scale=False, compile_statistics=False)
    with monitor.attach():
        monitor.arm()
        net(torch.randn(4, 6)).sum().backward()
        alone = monitor.collect_parameters()
        assert {e.kind for e in alone.entries} == {"param_grad"}
        assert monitor.pending and monitor.armed
        record = monitor.collect()
    kinds = collections.Counter(e.kind for e in record.entries)
    assert kinds["grad_output"] > 0 and kinds["param_grad"] == len(alone.entries)
    assert not monitor.pending


def test_handle_restores_every_hook_and_flag():
    net = model()
    net[2].register_forward_hook(lambda *a: None)
    before = hook_snapshot(net)
    monitor = GradientMonitor(net, noise_scale=False, attention_logits=False)  # the probe's hooks: test_noise; attention's: test_forward_stats
    handle = monitor.attach()
    assert hook_snapshot(net) == before  # nothing is registered until the monitor is armed
    for step in range(2):  # the probe step, then a step with the planned hooks
        monitor.arm()
        loss = net(torch.randn(2, 6)).sum()
        # One forward hook per chosen module (net[1] owns no parameter) and, in the probe's
        # forward, one forward pre-hook; nothing else. The planned layers, one op each, are read
        # from their edge: no pre-hook (the probe's backward puts the planned hooks in).
        assert [len(net[i]._forward_pre_hooks) for i in (0, 1, 2, 3, 4)] == [1 - step, 0, 1 - step, 1 - step, 1 - step]
        loss.backward()
        assert monitor.attach() is handle  # attaching twice does not double the hooks
        assert not any(m._forward_pre_hooks for m in net)
        assert [len(net[i]._forward_hooks) for i in (0, 1, 2, 3, 4)] == [1, 0, 2, 1, 1]
        assert not any(m._backward_hooks or m._backward_pre_hooks for m in net)
        monitor.collect()
        assert hook_snapshot(net) == before  # parked between logged steps
    monitor.arm()
    handle.remove()
    handle.remove()
    assert hook_snapshot(net) == before
    net[0].register_backward_hook(lambda *a: None)  # legacy hooks are allowed again


def test_modules_with_legacy_or_full_backward_hooks_of_their_own_are_monitored_too():
    net = model()
    fired = []
    net[0].register_backward_hook(lambda m, gi, go: fired.append("legacy"))
    net[2].register_full_backward_hook(lambda m, gi, go: fired.append(("full", go[0].clone())))
    monitor = GradientMonitor(net)
    with monitor.attach():
        for _ in range(2):  # the probe step, then the planned hooks
            monitor.arm()
            net(torch.randn(2, 6)).sum().backward()
            record = monitor.collect()
    assert {e.name for e in record.entries if e.kind == "grad_output"} == {"0", "2", "3", "4"}
    assert {e.name for e in record.entries if e.kind == "grad_input"} == {"2", "3", "4"}
    assert [f if isinstance(f, str) else f[0] for f in fired] == ["full", "legacy"] * 2
    entry = next(e for e in record.entries if e.kind == "grad_output" and e.name == "2")
    assert entry.stats.norm == pytest.approx(fired[-2][1].norm().item(), rel=1e-6)


def test_no_warning_when_first_input_needs_no_grad_and_no_filter_is_added():
    net = model()
    monitor = GradientMonitor(net)
    filters = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = monitor.attach()
        for _ in range(3):
            monitor.arm()
            net(torch.randn(4, 6)).sum().backward()
            monitor.collect()
        handle.remove()
    assert warnings.filters == filters


def test_default_selection_is_modules_owning_trainable_parameters():
    net = model()
    net[2].requires_grad_(False)
    assert list(select_modules(net)) == ["0", "3", "4"]
    assert list(select_modules(net, include=["*"], exclude=["", "1"])) == ["0", "2", "3", "4"]


def test_exclude_matching_nothing_is_one_warning_and_excludes_nothing():
    with pytest.warns(UserWarning, match=r"`exclude` pattern '\*.dropout' matches no module.*excludes nothing") as caught:
        monitor = GradientMonitor(model(), exclude=["*.dropout"])
    assert len([w for w in caught if "matches no module" in str(w.message)]) == 1
    assert list(monitor.modules) == ["0", "2", "3", "4"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(include=["encoder.*"]), "'encoder.\\*' matches no module.*'0'"),
        (dict(include="0"), "expected a non-empty list of glob patterns"),
        (dict(include=["1"]), None),
        (dict(bins=0), "`bins` expected an int from 1 to 4096, got 0"),
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


class Looped(nn.Module):
    """A cell applied three times per forward, to inputs of different shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(3, 3)
        self.outputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.outputs = []
        for rows in (4, 2, 4):
            self.outputs.append(self.cell(x[:rows]))
            x = torch.tanh(self.outputs[-1])
        return x


def test_modules_called_several_times_give_one_pooled_entry_with_the_call_count():
    net = Looped()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    monitor = GradientMonitor(net, histograms=True, bins=8)
    with monitor.attach():
        for _ in range(2):  # the first step after attach logs grad_output only
            monitor.arm()
            net(x).square().sum().backward()
            record = monitor.collect()
    entries = {(e.kind, e.name): e for e in record.entries}
    assert set(entries) == {("grad_output", "cell"), ("grad_input", "cell"), ("param_grad", "cell.weight"),
                            ("param_grad", "cell.bias"), ("output", "cell")}
    out = entries["grad_output", "cell"]
    assert out.calls == 3 and entries["param_grad", "cell.weight"].calls == 1 and entries["output", "cell"].calls == 3
    assert entries["grad_input", "cell"].calls == 2  # the first call's input needs no grad
    # Reference: the gradients of the three outputs, concatenated.
    loss = net(x).square().sum()
    grads = torch.autograd.grad(loss, net.outputs)
    assert_stats(out.stats._asdict(), ref_stats(torch.cat([g.flatten() for g in grads])))
    assert sum(out.histogram.counts) == pytest.approx(sum(g.numel() for g in grads))


class Structured(nn.Module):
    """Returns a dict holding a tensor, a nested tuple, a dataclass, a list and non-tensors."""

    @dataclasses.dataclass
    class Output:
        hidden: torch.Tensor
        note: str = "not a tensor"

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.proj = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        out, (h, c) = self.lstm(x)
        logits = self.proj(out)
        return {"logits": logits, "state": (h, [c, None]), "extra": self.Output(out * 2), "step": 3}


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Structured()
        self.head = nn.Linear(2, 1)  # owns a parameter, so the root is selected too

    def forward(self, x: torch.Tensor) -> dict:
        return self.body(x)


def test_every_output_tensor_of_nested_outputs_is_labelled_by_key_or_position():
    net = Wrapper()
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(5))

    def loss_of(out: dict) -> torch.Tensor:
        h, (c, _) = out["state"]
        return out["logits"].square().sum() + h.sum() + 2 * c.sum() + out["extra"].hidden.pow(3).sum()

    monitor = GradientMonitor(net, include=["body", "body.lstm", "body.proj"])
    with monitor.attach():
        for _ in range(2):  # the first step chooses the mechanism, the second uses it
            monitor.arm()
            loss_of(net(x)).backward()
            record = monitor.collect()
    got = {e.name: e.stats._asdict() for e in record.entries if e.kind == "grad_output"}
    assert set(got) == {
        "body/logits", "body/state/0", "body/state/1/0", "body/extra/hidden", "body.lstm/0", "body.lstm/1/0",
        "body.lstm/1/1", "body.proj",
    }
    assert monitor.fallback == ["body", "body.lstm"]
    assert monitor.plan["body.proj"].read is Read.VIEWS  # a Linear on 3-D input
    assert all("not a tensor" in monitor.plan[name].reason for name in monitor.fallback)

    captured = {}
    net.body.register_forward_hook(lambda m, i, o: captured.update(body=o))
    net.body.lstm.register_forward_hook(lambda m, i, o: captured.update(lstm=o))
    out = net(x)
    body, (lstm_out, (h, c)) = captured["body"], captured["lstm"]
    tensors = {
        "body/logits": body["logits"], "body/state/0": body["state"][0], "body/state/1/0": body["state"][1][0],
        "body/extra/hidden": body["extra"].hidden, "body.lstm/0": lstm_out, "body.lstm/1/0": h, "body.lstm/1/1": c,
    }
    grads = torch.autograd.grad(loss_of(out), list(tensors.values()))
    for name, grad in zip(tensors, grads):
        assert_stats(got[name], ref_stats(grad))


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

    assert GradHooks.__module__ == "lightning_gradhooks.shell.callback"


class LateBranch(nn.Module):
    """`late` runs from the second forward on, and its output is then modified in place."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.early(x)
        if self.calls > 1:
            h = self.late(h).relu_()
        return h


def test_a_module_first_run_after_the_first_step_is_safe_from_in_place_use():
    net = LateBranch()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    monitor = GradientMonitor(net)
    with monitor.attach():
        for _ in range(3):
            monitor.arm()
            net(x).sum().backward()  # with a full backward hook on `late`, relu_ would raise
            names = {(e.kind, e.name) for e in monitor.collect().entries}
    assert monitor.fallback == ["late"]
    assert monitor.plan["late"].read is Read.OUTPUT_ONLY
    assert "did not run in the first logged step" in monitor.plan["late"].reason
    assert {("grad_output", "late"), ("grad_output", "early"), ("grad_input", "early")} <= names


def test_named_tuple_outputs_are_labelled_by_field():
    Pair = collections.namedtuple("Pair", ["mean", "logvar"])  # noqa: PYI024

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> Pair:
            h = self.fc(x)
            return Pair(h[:, :4], h[:, 4:])

    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mean, logvar = self.encoder(x)
            return (mean * self.scale).sum() + logvar.exp().sum()

    vae = VAE()
    monitor = GradientMonitor(vae, include=["encoder"])
    with monitor.attach():
        monitor.arm()
        vae(torch.randn(2, 4)).backward()
        names = [e.name for e in monitor.collect().entries if e.kind == "grad_output"]
    assert sorted(names) == ["encoder/logvar", "encoder/mean"]


def test_steps_that_are_not_logged_run_exactly_as_without_the_monitor():
    net = model()
    before = hook_snapshot(net)
    bare = graph_nodes(net(torch.randn(4, 6)).sum())
    assert "BackwardHookFunctionBackward" not in bare
    monitor = GradientMonitor(net)
    with monitor.attach():
        for logged in (True, False, True, True, False):  # probe, idle, planned hooks, again, idle
            if logged:
                monitor.arm()
            else:
                assert hook_snapshot(net) == before

            def step() -> collections.Counter:
                loss = net(torch.randn(4, 6)).sum()
                nodes = graph_nodes(loss)
                loss.backward()
                return nodes

            calls, nodes = calls_into_the_library(step)
            assert "BackwardHookFunctionBackward" not in nodes
            # A step that is not logged adds no node; a logged one a view per module input at most.
            assert nodes == bare if not logged else set(nodes - bare) <= {"ViewBackward0"}
            assert bool(calls) == logged  # not logged: no Python call of ours in forward or backward
            record = monitor.collect()
            assert bool(record.entries) == logged
            assert hook_snapshot(net) == before


def test_an_exception_between_arm_and_collect_leaves_nothing_registered():
    net = model()
    before = hook_snapshot(net)
    monitor = GradientMonitor(net)
    handle = monitor.attach()
    for _ in range(2):  # the probe step, then a step with full hooks
        with pytest.raises(RuntimeError, match="boom"), monitor.arm():
            out = net(torch.randn(4, 6))
            assert hook_snapshot(net) != before
            out.sum().backward()
            raise RuntimeError("boom")
        assert hook_snapshot(net) == before and not monitor.armed and not monitor.pending
    monitor.arm()
    with pytest.raises(RuntimeError, match="boom"), handle:  # the attach handle cleans up too
        net(torch.randn(4, 6)).sum().backward()
        raise RuntimeError("boom")
    assert hook_snapshot(net) == before


def test_hooks_stay_in_through_every_backward_until_collect():
    """Accumulation: every micro-batch of a logged step is seen, and pooled."""
    net = model()
    monitor = GradientMonitor(net, include=["2"])
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(2))
    with monitor.attach():
        with monitor.arm():
            net(x[0]).sum().backward()
        monitor.arm()
        outputs = []
        net[2].register_forward_hook(lambda m, i, o: outputs.append(o))
        losses = [net(chunk).sum() for chunk in x]
        grads = torch.autograd.grad(sum(losses), outputs)
        for loss in [net(chunk).sum() for chunk in x]:
            loss.backward()
        entry = next(e for e in monitor.collect().entries if e.kind == "grad_output")
    want = torch.cat([g.flatten() for g in grads]).double()
    assert entry.calls == 3
    assert entry.stats.norm == pytest.approx(want.norm().item(), rel=1e-5)
    assert entry.stats.std == pytest.approx(want.std().item(), rel=1e-5)


def test_forward_checks_name_the_module_where_nan_is_born():
    from lightning_gradhooks.summary.records import step_summary
    from lightning_gradhooks.health import nonfinite_origin

    net = model()
    net[2].register_forward_hook(lambda m, i, o: o.index_fill(1, torch.tensor([0]), float("nan")))
    for checks in (False, True):
        monitor = GradientMonitor(net, forward_checks=checks)
        with monitor.attach():
            for _ in range(2):  # the probe step, then the planned hooks
                monitor.arm()
                net(torch.randn(4, 6)).sum().backward()
                record = monitor.collect()
        forward = [e.name for e in record.entries if e.kind == "forward"]
        first = record.first_nonfinite
        if checks:
            # Every module, parameterless ones included, in the order their forward ends; the
            # weights and the inputs too. A tensor is summed once: the root's output is the last
            # module's, and an input that is the output of the module before it is not summed
            # again (a view made to read grad_input is a tensor of its own: "2"). A watched
            # module's outputs are read from their statistics (kind "output"): an entry only
            # where they hold NaN/Inf (not "0", whose output is finite).
            assert forward == ["1", "2", "3", "4"]
            assert [e.name for e in record.entries if e.kind == "forward_input"] in (["0"], ["0", "2"])
            assert [e.kind for e in record.entries if e.kind != "output"][:3] == ["weights", "forward_input", "forward"]
            assert (first.kind, first.name) == ("forward", "2")
            assert nonfinite_origin(step_summary(record))[:2] == (
                "2", "born in the forward of `2`"
            )
        else:
            assert forward == [] and first.kind != "forward"  # backward names a later module


def test_later_logged_steps_make_no_new_gradient_hooks():
    """The hooks put on autograd nodes live as long as the step's graph, so the cyclic collector
    walks whatever a logged step makes for them while the loss is held: from the second planned
    step on (the first is the probe's), a monitor without the noise probe reuses the hooks it
    made, read the same, and histograms switched off for one step get hooks of their own."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))
    monitor = GradientMonitor(model, noise_scale=False)
    x = torch.randn(4, 8)
    with monitor.attach():
        records, young = [], []
        for histograms in (None, None, None, False, None):
            gc.collect()  # what earlier steps made is old now
            with monitor.arm(histograms=histograms):
                loss = model(x).sum()  # held, as a loop holds it: its graph keeps the node hooks
                loss.backward()
                young.append([o for o in gc.get_objects(generation=0) if isinstance(o, functools.partial)])
                records.append(monitor.collect())
            model.zero_grad()
    assert all(young[1]) and len(young[1]) >= 6  # the first planned step makes them
    assert young[2] == [] and young[4] == []
    assert len(young[3]) >= 6  # without histograms: other hooks
    same = [(e.kind, e.name, e.stats, e.histogram) for e in records[1].entries]
    assert same == [(e.kind, e.name, e.stats, e.histogram) for e in records[2].entries]
    assert [e.histogram for e in records[3].entries if e.kind == "grad_output"] == [None] * 6
    assert all(e.histogram is not None for e in records[4].entries if e.kind == "grad_output")


def test_a_with_arm_block_pauses_the_cyclic_garbage_collector_and_always_restores_it():
    """Python's GC is off inside `with monitor.arm():` up to collect(), back on after, also when
    the step raises; a bare arm() leaves it on (nothing could switch it back on if the step
    raised); a collector the user switched off stays off."""
    import gc

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    monitor = GradientMonitor(model)
    assert gc.isenabled()
    with monitor.attach():
        with monitor.arm():
            assert not gc.isenabled()
            model(torch.randn(3, 4)).sum().backward()
            assert monitor.collect().entries
            assert gc.isenabled()
        with pytest.raises(RuntimeError, match="mid-step"):
            with monitor.arm():
                assert not gc.isenabled()
                raise RuntimeError("mid-step")
        assert gc.isenabled() and not monitor.armed
        with monitor.arm(when=False):
            assert gc.isenabled() and not monitor.armed
        monitor.arm()
        assert gc.isenabled() and monitor.armed
    assert gc.isenabled() and not monitor.armed  # leaving attach() removes and disarms
    gc.disable()
    try:
        with monitor.attach(), monitor.arm():
            model(torch.randn(3, 4)).sum().backward()
            monitor.collect()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_scratch_memory_is_reused_between_logged_steps_bounded_and_freed_on_remove():
    """Buffers outlive a logged step only up to SCRATCH_KEPT elements each; reusing them changes
    no statistic; removing the hooks frees them."""
    from lightning_gradhooks.core.stats import SCRATCH_KEPT, reduce

    class Big(nn.Module):  # a parameter reduced alone, into buffers too big to keep
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(SCRATCH_KEPT + 4096))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum() * (self.weight * torch.linspace(-1, 1, self.weight.numel())).sum()

    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)), "big": Big()})
    monitor = GradientMonitor(model)
    handle = monitor.attach()
    assert monitor.scratch_bytes == 0
    for step in range(3):
        with monitor.arm():
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            (model["mlp"](x).sum() + model["big"](x)).backward()
            record = monitor.collect()
        # Buffers of at most SCRATCH_KEPT elements are kept: the batch of all these gradients is bigger.
        assert 0 < monitor.scratch_bytes <= 4 * SCRATCH_KEPT
        params = dict(model.named_parameters())
        assert {e.name for e in record.entries if e.kind == "param_grad"} == set(params)
        for e in record.entries:
            if e.kind == "param_grad":
                (row, counts), = reduce([params[e.name].grad], bins=monitor.bins)
                assert e.stats == row
                assert e.histogram.counts == counts
        model.zero_grad()
    handle.remove()
    assert monitor.scratch_bytes == 0


@pytest.mark.parametrize("blocks", ["cpu", "accelerator"])
def test_an_armed_step_dispatches_at_most_5_extra_aten_ops_per_reduced_tensor(monkeypatch, blocks):
    """On accelerators a logged step is bound by kernel launches: the hooks, the reductions and
    collect together add at most 5 aten ops per reduced tensor to a bare step (a 100-module MLP,
    its grad_output, grad_input, parameter gradients and outputs: an output costs two, batched
    with the gradients), with an accelerator's block sizes and
    with the CPU's; a step that is not armed adds none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_gradhooks.core import stats

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    if blocks == "accelerator":
        monkeypatch.setattr(stats, "SIZES", {})
    torch.manual_seed(0)
    net = nn.Sequential(*(m for _ in range(50) for m in (nn.Linear(32, 32), nn.Tanh())))
    x = torch.randn(16, 32)
    monitor = GradientMonitor(net)

    def step(armed: bool) -> tuple[int, int]:
        net.zero_grad(set_to_none=True)
        Count.ops = 0
        with Count(), monitor.arm(when=armed):
            net(x).pow(2).mean().backward()
            record = monitor.collect()
        return Count.ops, sum(e.calls for e in record.entries)

    bare, _ = step(False)
    with monitor.attach():
        step(True)  # the probe step
        step(True)  # layouts are cached
        assert step(False)[0] == bare
        ops, reduced = step(True)
    # grad_output, grad_input (not of the first: x needs no grad), weight, bias, output
    assert reduced == 50 * 5 - 1
    print(f"{blocks}: {(ops - bare) / reduced:.2f} extra ops per reduced tensor")
    assert (ops - bare) / reduced <= 5, (ops - bare) / reduced
