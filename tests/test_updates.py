"""UpdateTracker and the optimizer helpers, directly."""

import pytest
import torch

from lightning_gradhooks.updates import UpdateTracker, unheld, unwrapped


class _Wrapper:  # as Lightning's LightningOptimizer and Fabric's _FabricOptimizer hold theirs
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer


def test_parameters_no_optimizer_holds_are_found_through_wrappers():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)
    assert unwrapped(_Wrapper(sgd)) is sgd and unwrapped(sgd) is sgd
    assert [n for n, _ in unheld(model.named_parameters(), [_Wrapper(sgd)])] == ["1.weight", "1.bias"]
    assert unheld(model.named_parameters(), [sgd, torch.optim.SGD(model[1].parameters(), lr=0.1)]) == []


def test_the_update_ratio_is_the_step_over_the_weights_before_it_and_carries_its_optimizer_index():
    model = torch.nn.Linear(3, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    tracker = UpdateTracker(dict(model.named_parameters()))
    tracker.attach(sgd)
    model(torch.ones(2, 3)).sum().backward()
    before = model.weight.detach().clone()
    tracker.expect(sgd, step=7, index=1)
    sgd.step()
    sgd.step()  # not expected: not measured
    ((step, index, values),) = tracker.ready()
    assert (step, index, sorted(values)) == (7, 1, ["bias", "weight"])
    ratio, norm = values["weight"]
    assert ratio == pytest.approx((0.5 * model.weight.grad).norm().item() / before.norm().item(), rel=1e-6)
    assert norm == pytest.approx((before - 0.5 * model.weight.grad).norm().item(), rel=1e-6)
    assert tracker.ready() == []
    tracker.remove()
    assert not sgd._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks
