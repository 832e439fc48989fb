"""Update ratios (updates.py) on their own: ‖Δw‖/‖w_before‖ and ‖w_after‖ of the steps marked,
against values computed by hand, and nothing left on the optimizer after ``remove``."""

import math

import pytest
import torch
from torch import nn

from lightning_gradhooks.log.updates import UpdateTracker, unheld, unwrapped


def layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def tracked(lr: float = 0.1) -> tuple[nn.Linear, torch.optim.SGD, UpdateTracker]:
    """A layer, its SGD and a tracker of all its parameters attached to it."""
    model = layer()
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    tracker = UpdateTracker(dict(model.named_parameters()))
    tracker.attach(sgd)
    return model, sgd, tracker


def backward(model: nn.Module) -> None:
    model(torch.ones(4, 3)).square().sum().backward()


def hooks_on(optimizer: torch.optim.Optimizer) -> int:
    return len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)


def test_an_sgd_step_gives_the_ratio_and_the_norm_computed_by_hand():
    model, sgd, tracker = tracked()
    backward(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    tracker.expect(sgd, step=7)
    sgd.step()
    [(step, index, values)] = tracker.ready()
    assert (step, index) == (7, None) and sorted(values) == ["bias", "weight"]
    for name, p in model.named_parameters():
        ratio, norm = values[name][:2]
        assert ratio == pytest.approx(0.1 * grads[name].norm().item() / before[name].norm().item(), rel=1e-5)
        assert norm == pytest.approx(p.norm().item(), rel=1e-6)
    assert tracker.ready() == []  # read once
    tracker.remove()


def test_only_marked_steps_and_watched_parameters_are_measured_with_the_optimizer_index():
    model = layer()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = UpdateTracker({"weight": model.weight})  # the bias is stepped, not watched
    tracker.attach(sgd)
    for step in range(4):
        backward(model)
        if step % 2:
            tracker.expect(sgd, step=step, index=1)
        sgd.step()
        sgd.zero_grad()
    assert [(step, index, sorted(values)) for step, index, values in tracker.ready()] == [
        (1, 1, ["weight"]), (3, 1, ["weight"])]
    tracker.remove()


def test_each_optimizer_measures_its_own_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[1].parameters(), lr=0.01)
    tracker = UpdateTracker(dict(model.named_parameters()))
    tracker.attach(first)
    tracker.attach(second)
    backward(model)
    weight = model[1].weight.detach().clone()
    tracker.expect(second, step=0)
    first.step()  # not marked: not measured
    second.step()
    [(step, _, values)] = tracker.ready()
    assert step == 0 and sorted(values) == ["1.bias", "1.weight"]
    # Adam's first step moves every weight by lr, whatever the size of its gradient.
    assert values["1.weight"][0] == pytest.approx(0.01 * math.sqrt(weight.numel()) / weight.norm().item(), rel=1e-4)
    tracker.remove()


def test_a_step_marked_from_inside_the_closure_copies_the_weights_at_once():
    """Lightning calls on_before_optimizer_step from the closure, after the pre-hook has run."""
    model, sgd, tracker = tracked(lr=0.5)
    before = model.weight.detach().clone()

    def closure() -> torch.Tensor:
        sgd.zero_grad()
        loss = model(torch.ones(4, 3)).square().sum()
        loss.backward()
        tracker.expect(sgd, step=3, now=True)
        return loss

    sgd.step(closure)
    [(step, _, values)] = tracker.ready()
    moved = (model.weight.detach() - before).norm() / before.norm()
    assert step == 3 and values["weight"][0] == pytest.approx(moved.item(), rel=1e-5) and moved > 0
    tracker.remove()


def test_zero_weights_that_move_give_inf_and_weights_that_do_not_give_zero():
    model, sgd, tracker = tracked()
    with torch.no_grad():
        model.bias.zero_()
    backward(model)
    model.weight.grad.zero_()
    tracker.expect(sgd, step=0)
    sgd.step()
    [(_, _, values)] = tracker.ready()
    assert values["bias"][0] == math.inf and values["weight"][0] == 0.0
    tracker.remove()


def test_a_step_that_never_came_is_dropped_and_the_next_one_is_measured():
    """A gradient scaler that skips a step calls neither hook: nothing is measured for it."""
    model, sgd, tracker = tracked()
    backward(model)
    tracker.expect(sgd, step=0)  # skipped: no sgd.step()
    assert tracker.ready() == []
    tracker.expect(sgd, step=1)
    sgd.step()
    assert [step for step, _, _ in tracker.ready()] == [1]
    tracker.remove()


def test_remove_takes_the_hooks_off_the_optimizer_and_is_idempotent():
    model, sgd, tracker = tracked()
    assert hooks_on(sgd) == 2
    backward(model)
    tracker.expect(sgd, step=0)
    sgd.step()
    tracker.remove()
    tracker.remove()
    assert hooks_on(sgd) == 0
    assert tracker.ready() == []  # what was not read is dropped
    tracker.expect(sgd, step=1)
    sgd.step()
    assert tracker.ready() == []  # no hook, nothing measured


def test_each_update_says_its_group_its_learning_rate_and_whether_it_had_a_gradient():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    sgd = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.0}], lr=0.1)
    tracker = UpdateTracker(dict(model.named_parameters()))
    tracker.attach(sgd)
    model[1](torch.ones(4, 3)).sum().backward()  # model[0] gets no gradient: .grad stays None
    tracker.expect(sgd, step=0)
    sgd.step()
    [(_, _, values)] = tracker.ready()
    assert {n: (u.group, u.lr, u.gradient, u.update_ratio) for n, u in values.items()} == {
        "0.weight": (0, 0.1, False, 0.0), "0.bias": (0, 0.1, False, 0.0),
        "1.weight": (1, 0.0, True, 0.0), "1.bias": (1, 0.0, True, 0.0)}
    tracker.remove()


class _Wrapper:  # as Lightning's LightningOptimizer and Fabric's _FabricOptimizer hold theirs
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer


def test_parameters_no_optimizer_holds_are_found_through_wrappers():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)
    assert unwrapped(_Wrapper(sgd)) is sgd and unwrapped(sgd) is sgd
    assert [n for n, _ in unheld(model.named_parameters(), [_Wrapper(sgd)])] == ["1.weight", "1.bias"]
    assert unheld(model.named_parameters(), [sgd, torch.optim.SGD(model[1].parameters(), lr=0.1)]) == []
