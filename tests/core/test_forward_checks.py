"""forward_checks.py: the tensors of a module's inputs and outputs (``tensor_leaves``), and the sums
that say where NaN/Inf are born in the forward pass (``ForwardChecks``), driven by hand."""

import dataclasses
import math
from typing import NamedTuple

import torch
from torch import nn

from lightning_gradhooks.core.forward_checks import ForwardChecks, tensor_leaves
from lightning_gradhooks.summary.records import Kind


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: dict


def test_tensor_leaves_walks_every_container_with_key_paths():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    value = {"x": [a, (b, "text")], "pair": Pair(c, 7), "out": Output(d, {"n": None})}
    assert [(path, t.item()) for path, t in tensor_leaves(value)] == [
        (("x", "0"), 0.0), (("x", "1", "0"), 1.0), (("pair", "first"), 2.0), (("out", "logits"), 3.0)]
    assert list(tensor_leaves(Output)) == []  # a dataclass type is opaque, not walked
    assert [p for p, _ in tensor_leaves(a)] == [()]


class Sums:
    """What the checks hand the monitor's reducer: (kind, label, values)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Kind, str, list[float]]] = []
        self.armed = True

    def reduce(self, kind: Kind, label: str, tensor: torch.Tensor, histogram: bool) -> None:
        assert not histogram
        self.calls.append((kind, label, tensor.tolist()))


def checks_of(model: nn.Module, unmonitored: dict[str, nn.Module] | None = None) -> tuple[ForwardChecks, Sums]:
    sums = Sums()
    return ForwardChecks(model, unmonitored or {}, sums.reduce, lambda: sums.armed, "(weights)"), sums


def test_the_first_check_of_a_step_takes_each_weights_norm_then_sums_inputs_and_outputs_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    checks, sums = checks_of(model)
    x = torch.randn(4, 3)
    h = model[0](x)
    checks.check("0", (x,), h)
    checks.check("1", (h,), model[1](h))  # h was summed as module 0's output: not again as an input
    (kind, label, norms), *rest = sums.calls
    assert (kind, label) == (Kind.WEIGHTS, "(weights)")
    assert norms == [model[0].weight.norm().item(), model[0].bias.norm().item()]
    assert [(k, n) for k, n, _ in rest] == [(Kind.FORWARD_INPUT, "0"), (Kind.FORWARD, "0"), (Kind.FORWARD, "1")]
    assert rest[0][2] == [x.sum().item()] and rest[1][2] == [h.sum().item()]

    checks.reset()  # the next armed step checks the weights and every tensor again
    sums.calls.clear()
    checks.check("1", (h,), model[1](h))
    assert [k for k, _, _ in sums.calls] == [Kind.WEIGHTS, Kind.FORWARD_INPUT, Kind.FORWARD]


def test_a_tensor_changed_in_place_since_it_was_summed_is_summed_again_and_integers_never():
    checks, sums = checks_of(nn.Linear(1, 1))
    x = torch.ones(2, 2)
    checks.check("a", (x, torch.arange(3)), x)  # the output is the input: summed once
    x.mul_(float("inf"))
    checks.check("b", (x,), {"ids": torch.arange(2)})
    assert [(k, n, v) for k, n, v in sums.calls[1:]] == [(Kind.FORWARD_INPUT, "a", [4.0]),
                                                        (Kind.FORWARD_INPUT, "b", [math.inf])]


def test_unmonitored_modules_get_hooks_that_check_only_on_armed_training_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    checks, sums = checks_of(model, {"1": model[1]})
    assert [(m, pre) for m, pre, _ in checks.hooks] == [(model[1], False)]
    module, _, hook = checks.hooks[0]
    handle = module.register_forward_hook(hook)
    try:
        x = torch.randn(3, 2)
        model(x)
        assert [n for _, n, _ in sums.calls] == ["(weights)", "1", "1"]
        sums.calls.clear()
        checks.reset()
        sums.armed = False
        model(x)  # not armed
        sums.armed = True
        with torch.no_grad():
            model(x)  # no gradients: not a training step
        model.eval()
        model(x)
        assert sums.calls == []
    finally:
        handle.remove()


def test_a_nan_in_a_weight_shows_in_its_norm():
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    checks, sums = checks_of(model)
    checks.check("", (torch.ones(1, 2),), torch.ones(1, 2))
    norms = sums.calls[0][2]
    assert math.isnan(norms[0]) and math.isfinite(norms[1])


def test_with_output_statistics_the_outputs_are_not_summed_again_and_a_nan_still_names_its_module():
    from lightning_gradhooks import GradientMonitor
    from lightning_gradhooks.health import nonfinite_origin

    class Log(nn.Module):  # a watched module (it has a parameter) whose forward can make NaN
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.poison = False

        def forward(self, x):  # noqa: ANN001, ANN201
            return (x.log() if self.poison else (x.abs() + 1).log()) * self.scale  # log of a negative: NaN

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), Log(), nn.Linear(4, 2))
    monitor = GradientMonitor(net, forward_checks=True, noise_scale=False)
    with monitor.attach():
        for poison in (False, True):
            net[3].poison = poison
            with monitor.arm():
                net(torch.randn(8, 4)).sum().backward()
                record = monitor.collect()
            net.zero_grad()
            kinds = [e.key for e in record.entries if e.kind in (Kind.FORWARD, Kind.FORWARD_INPUT)]
            assert {e.key.label for e in record.entries if e.kind == Kind.OUTPUT} >= {"0", "2", "3", "4"}
            # The batch and the output of the Tanh (not watched: a check of its own) are summed; the
            # watched modules' outputs are read from their statistics, without a sum or an entry ...
            summed = [(Kind.FORWARD_INPUT, "0"), (Kind.FORWARD, "1")]
            if not poison:
                assert [(k.kind, k.label) for k in kinds] == summed
            else:  # ... but where they hold NaN/Inf: an entry where the check's sum would have been
                assert [(k.kind, k.label) for k in kinds] == [*summed, (Kind.FORWARD, "3"), (Kind.FORWARD, "4")]
                labels = [(e.kind, e.key.label) for e in record.entries]
                assert labels.index((Kind.FORWARD, "3")) + 1 == labels.index((Kind.OUTPUT, "3"))
                summary = {e.key: e.stats._asdict() for e in record.entries}
                assert nonfinite_origin(summary)[:2] == ("3", "born in the forward of `3`")
