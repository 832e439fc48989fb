"""The NaN sentinel (sentinel.py) on its own: which gradients it names, in which order, and what
it leaves alone. Through GradHooks in a real fit: tests/health/test_report_unseen.py."""

import pytest
import torch
from torch import nn

from lightning_gradhooks.core.sentinel import NonfiniteSentinel


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def backward(model: nn.Module, poison_after: int | None = None, value: float = float("nan")) -> None:
    """One backward of a sum; with ``poison_after=i``, the gradient that reaches the output of
    layer ``i`` is multiplied by ``value``, as if backward met a NaN (or Inf) there."""
    h = torch.ones(2, 3)
    for i, layer in enumerate(model):
        h = layer(h)
        if i == poison_after:
            h.register_hook(lambda g: g * value)
    h.sum().backward()


def test_finite_gradients_pass_and_every_gradient_is_checked():
    model = chain()
    sentinel = NonfiniteSentinel(model.named_parameters())
    backward(model)
    assert sentinel.check() is None
    assert sentinel.last_checked == 6


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_born_in_backward_names_the_parameters_upstream_in_model_order(value):
    """Backward carries the NaN to everything upstream of where it appeared: the layers after it
    stay finite, and the last name is the parameter nearest the loss that got one."""
    model = chain()
    sentinel = NonfiniteSentinel(model.named_parameters())
    backward(model, poison_after=2, value=value)  # the gradient reaching the second Linear's output
    assert sentinel.check() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.isfinite(model[4].weight.grad).all()


def test_a_nan_from_the_loss_names_every_parameter():
    model = chain()
    sentinel = NonfiniteSentinel(model.named_parameters())
    backward(model, poison_after=4)
    assert sentinel.check() == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def test_finite_gradients_whose_total_norm_overflows_name_all_checked_parameters():
    """No element is NaN, but the total norm is infinite in float32 (as clip_grad_norm_ would see
    it): no single gradient is to blame, so all of them are named."""
    model = chain()
    sentinel = NonfiniteSentinel(model.named_parameters())
    backward(model)
    # 1.5e19 squared is 2.25e38, under float32's 3.4e38; two such squares are not.
    model[0].bias.grad[0] = model[4].bias.grad[0] = 1.5e19
    assert all(torch.isfinite(torch.linalg.vector_norm(p.grad)) for p in model.parameters())
    assert sentinel.check() == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def test_only_the_given_parameters_with_a_gradient_are_checked():
    model = chain()
    model[0].bias.requires_grad_(False)  # frozen: never checked
    sentinel = NonfiniteSentinel(model.named_parameters())
    backward(model, poison_after=2)
    model[2].weight.grad = None  # no gradient this step: skipped
    assert sentinel.check() == ["0.weight", "2.bias"]
    assert sentinel.last_checked == 4
    # Restricted to the parameters one optimizer steps (the last layer): all finite.
    assert sentinel.check(model[4].parameters()) is None
    assert sentinel.last_checked == 2
    assert sentinel.check([model[0].weight]) == ["0.weight"]


def test_no_gradient_at_all_passes():
    model = chain()
    sentinel = NonfiniteSentinel(model.named_parameters())
    assert sentinel.check() is None
    assert sentinel.last_checked == 0


def test_a_sparse_gradient_is_checked_by_its_values():
    embedding = nn.Embedding(10, 3, sparse=True)
    sentinel = NonfiniteSentinel(embedding.named_parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse and sentinel.check() is None
    nan = torch.sparse_coo_tensor([[4]], [[0.0, float("nan"), 0.0]], (10, 3), check_invariants=True)
    embedding.weight.grad = nan
    assert sentinel.check() == ["weight"]
