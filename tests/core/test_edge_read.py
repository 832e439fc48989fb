"""Read.EDGE: grad_input from the edge of the node that made a layer's output, for torch.nn
layers whose forward is one autograd op on their input: the same numbers as the read through a
view (Read.VIEWS) and as a full backward hook, and never where the input reaches the output another way."""

import pytest
import torch
from torch import nn

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.core.planning import Read

from conftest import graph_nodes
from test_monitor import assert_stats, ref_stats


def _subclass(cls: type) -> type:
    """``cls`` under another name: the same forward, but not one of the exact types read from the edge."""
    return type(f"Sub{cls.__name__}", (cls,), {})


class Layers(nn.Module):
    """One op on a leaf input (a convolution), a norm, activations, a Linear on 2-D input, a
    dropout, an embedding (an input without grad), a Linear on 3-D input (a view, addmm, a view:
    not one op), and a Linear whose forward hook adds its input to its output (the input reaches
    the output two ways: not one op either)."""

    NAMES = ["conv", "bn", "act", "fc", "norm", "tanh", "drop", "seq", "emb", "skip", "head"]

    def __init__(self, sub: bool = False) -> None:
        super().__init__()
        kind = _subclass if sub else (lambda cls: cls)
        self.conv, self.bn, self.act = kind(nn.Conv2d)(2, 3, 3, padding=1), kind(nn.BatchNorm2d)(3), kind(nn.GELU)()
        self.fc, self.norm, self.tanh = kind(nn.Linear)(48, 8), kind(nn.LayerNorm)(8), kind(nn.Tanh)()
        self.drop, self.seq, self.emb = kind(nn.Dropout)(0.25), kind(nn.Linear)(8, 8), kind(nn.Embedding)(5, 8)
        self.skip, self.head = kind(nn.Linear)(8, 8), kind(nn.Linear)(8, 2)
        self.skip.register_forward_hook(lambda module, args, out: out + args[0])

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x))).flatten(1)
        h = self.drop(self.tanh(self.norm(self.fc(h))))
        h = self.seq(h[:, None].expand(-1, 3, -1)).mean(1) + self.emb(tokens)
        return self.head(self.skip(h))


def _loss(net: nn.Module, x: torch.Tensor, tokens: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    torch.manual_seed(7)  # the same dropout mask in every run
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the forward only, as torch advises
        return net(x, tokens).float().square().sum()


@pytest.mark.parametrize("autocast", [False, True])
def test_one_op_layers_read_from_the_edge_give_what_views_and_full_backward_hooks_give(autocast):
    """Under CPU autocast (bfloat16) the input of a Linear or a convolution is cast inside its
    forward: the op's edge leads to the input through that cast, whose backward widens the
    gradient exactly, so the layer is still read from its edge, with the same numbers."""
    torch.manual_seed(0)
    plain = Layers()
    viewed = Layers(sub=True)
    viewed.load_state_dict(plain.state_dict())
    x, tokens = torch.randn(4, 2, 4, 4, requires_grad=True), torch.tensor([0, 3, 1, 4])  # x: a leaf
    records, plans = {}, {}
    for key, net in (("edge", plain), ("views", viewed)):
        bare = graph_nodes(_loss(net, x, tokens, autocast))["ViewBackward0"]
        monitor = GradientMonitor(net, include=Layers.NAMES, histograms=False, parameters=False, activations=False)
        with monitor.attach():
            for _ in range(2):  # the probe step, then the planned hooks
                monitor.arm()
                loss = _loss(net, x, tokens, autocast)
                if monitor.plan["head"].read is not Read.PROBE:  # a view per input read through one
                    views = graph_nodes(loss)["ViewBackward0"] - bare
                    assert views == (2 if key == "edge" else len(Layers.NAMES) - 1)
                loss.backward()
                records[key] = {(e.kind, e.name): e.stats for e in monitor.collect().entries}
        plans[key] = monitor.plan
    edge = {n for n in Layers.NAMES if n not in ("seq", "skip")}
    assert {n: p.read for n, p in plans["edge"].items()} == {
        n: Read.EDGE if n in edge else Read.VIEWS for n in Layers.NAMES}
    assert all("not one op" in plans["edge"][n].reason for n in ("seq", "skip"))
    assert {p.read for p in plans["views"].values()} == {Read.VIEWS}
    assert set(records["edge"]) == set(records["views"])
    assert {name for kind, name in records["edge"] if kind == "grad_input"} == set(Layers.NAMES) - {"emb"}
    for key, stats in records["edge"].items():
        assert stats == records["views"][key], key  # the same numbers, exactly

    seen = {}
    for name in Layers.NAMES:
        getattr(plain, name).register_full_backward_hook(lambda module, gi, go, name=name: seen.update(
            {("grad_output", name): go[0], ("grad_input", name): gi[0]}))
    _loss(plain, x, tokens, autocast).backward()
    if autocast:  # the convolution's input was cast: its grad_input is float32, as x
        assert seen["grad_input", "conv"].dtype == torch.float32 and seen["grad_output", "conv"].dtype == torch.bfloat16
    for key, stats in records["edge"].items():
        assert_stats(stats._asdict(), ref_stats(seen[key]))


def test_a_cast_that_rounds_the_gradient_is_not_read_from_the_edge():
    """A bfloat16 input that autocast casts to float16 inside the Linear: the cast's backward
    rounds the gradient (neither dtype holds the other), so the edge's gradient is not the
    module's grad_input: the Linear is read through a view, and gives what a full hook gives."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(16, 8)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return net[1](net[0](x).bfloat16()).float().square().sum()

    monitor = GradientMonitor(net, histograms=False, parameters=False, activations=False)
    with monitor.attach():
        for _ in range(2):
            monitor.arm()
            loss().backward()
            record = {(e.kind, e.name): e.stats for e in monitor.collect().entries}
    assert monitor.plan["1"].read is Read.VIEWS and "not one op" in monitor.plan["1"].reason
    seen = {}
    net[1].register_full_backward_hook(lambda module, gi, go: seen.update(grad_input=gi[0], grad_output=go[0]))
    loss().backward()
    assert seen["grad_input"].dtype == torch.bfloat16
    for kind in ("grad_input", "grad_output"):
        assert_stats(record[kind, "1"]._asdict(), ref_stats(seen[kind]))
