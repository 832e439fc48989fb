"""torch.compile: training still works, compiled code keeps its graph, names lose `_orig_mod.`.

Module hooks inside compiled code would make Dynamo break the graph around every hooked module,
so modules there report parameter gradients only; modules outside compiled code keep their hooks.
"""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gradhooks import GradHooks, GradientMonitor

from conftest import MLP, hook_snapshot, loader, make_trainer, read_events


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Dynamo caches compiled code per code object across tests; start and end clean.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)), backend="aot_eager")
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train(net: nn.Module, monitor: GradientMonitor | None, steps: int = 3) -> tuple[list, list]:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    records, grads = [], []
    for _ in range(steps):
        net.zero_grad()
        if monitor:
            monitor.arm()
        net(x).square().sum().backward()
        if monitor:
            records.append(monitor.collect())
        grads.append([p.grad.clone() for p in net.parameters()])
    return records, grads


def test_compiled_submodule_keeps_its_graph_and_reports_parameter_gradients():
    torch.manual_seed(0)
    plain_grads = train(Net(), None)[1]
    assert graph_breaks() == 0
    torch.manual_seed(0)
    net = Net()
    with pytest.warns(UserWarning, match=r"torch.compile: .*2 modules in compiled code .*: body.0, body.2$"):
        monitor = GradientMonitor(net)
    assert list(monitor.modules) == ["body.0", "body.2", "head"] and monitor.compiled == ["body.0", "body.2"]
    before = hook_snapshot(net)
    with monitor.attach():
        records, grads = train(net, monitor)
    assert hook_snapshot(net) == before
    assert monitor.fallback == []  # the compiled modules are not "unseen": they are not hooked
    assert [p.read.name for p in monitor.plan.values()] == ["PARAMETERS_ONLY", "PARAMETERS_ONLY", "EDGE"]
    assert graph_breaks() == 0  # the hooks did not split the compiled body
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads, plain_grads) for a, b in zip(step_a, step_b))
    names = {(e.kind, e.name) for e in records[-1].entries}
    assert {("param_grad", "body.0.weight"), ("param_grad", "body.2.bias"), ("grad_output", "head")} <= names
    assert not [n for n in names if n[0] != "param_grad" and n[1].startswith("body")]
    assert not [n for _, n in names if "_orig_mod" in n]


def test_patterns_use_names_without_the_compile_wrapper():
    with pytest.warns(UserWarning, match="torch.compile"):
        monitor = GradientMonitor(Net(), include=["body.*"])
    assert list(monitor.modules) == ["body.0", "body.1", "body.2"]


def test_lightning_fit_of_a_compiled_module(tmp_path):
    """The user's model is compiled, and so are the statistics' kernels: both work, and the
    user's torch.compile settings are left as they were."""
    pl.seed_everything(0, verbose=False)
    model = MLP()
    before = hook_snapshot(model)
    compiled = torch.compile(model)  # the default inductor backend, on the CPU
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1, offload_threshold_bytes=256)], max_steps=3)
    settings = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()  # deterministic: set
    with pytest.warns(UserWarning, match="torch.compile: .*3 modules in compiled code"):
        trainer.fit(compiled, loader())
    assert hook_snapshot(model) == before
    assert graph_breaks() == 0
    events = read_events(trainer.logger.log_dir)
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("∇4 param_grad_norm/net.0.weight")] == [0, 1, 2]
    assert not [t for t in tags if t.startswith(("grad_output", "grad_input")) or "_orig_mod" in t]
    assert len(model.losses) == 3 and all(torch.isfinite(loss) for loss in model.losses)
    after = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()
    assert [{k: (v, now[k]) for k, v in was.items() if now[k] != v} for was, now in zip(settings, after)] == [{}, {}]


class CompiledStep(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.training_step = torch.compile(self.training_step, backend="aot_eager")


def test_lightning_module_with_a_compiled_training_step(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = CompiledStep()
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=2)
    with pytest.warns(UserWarning, match="torch.compile: .*3 modules in compiled code"):
        trainer.fit(model, loader())
    events = read_events(trainer.logger.log_dir)
    assert [e.step for e in events.Scalars("∇4 param_grad_norm/net.4.bias")] == [0, 1]
    assert not [t for t in events.Tags()["scalars"] if t.startswith("grad_output")]


def test_frozen_modules_in_compiled_code_are_named_without_the_wrapper():
    net = Net()
    net.body._orig_mod[0].requires_grad_(False)
    with pytest.warns(UserWarning, match="torch.compile"):
        monitor = GradientMonitor(net)
    assert monitor.frozen == ["body.0"]
