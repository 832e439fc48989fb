"""StepNorms (core/spikes.py): the norms it keeps against plain torch, what it leaves out, and that
keeping them reads nothing on the host (no ``.item()``, no copy that waits). Through GradHooks in
a real fit: tests/shell/test_spikes.py."""

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradhooks.core.sentinel import NonfiniteSentinel
from lightning_gradhooks.core.spikes import IN_FLIGHT, StepNorms, parameter_norms


class Ops(TorchDispatchMode):
    """Records the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2, bias=False), nn.Linear(2, 1))
    model[3].weight.requires_grad_(False)
    model(torch.randn(4, 3)).square().sum().backward()
    return model


def test_the_norms_are_each_gradients_l2_norm_in_the_order_given_without_gradientless_parameters():
    model = model_with_grads()
    norms = StepNorms()
    kept = norms.keep(3, list(model.named_parameters()))
    [(step, names, values, extra)] = norms.ready()
    with_grad = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    assert (step, extra) == (3, None)
    assert names == tuple(n for n, _ in with_grad) == ("0.weight", "0.bias", "2.weight", "3.bias")
    expected = [torch.linalg.vector_norm(p.grad).item() for _, p in with_grad]
    assert values.tolist() == pytest.approx(expected, rel=1e-6)
    assert kept.dtype == torch.float32 and kept.shape == (4,)
    assert norms.ready() == []  # each step once
    assert norms.keep(4, [("3.weight", model[3].weight)]) is None and norms.ready() == []


def test_an_inverse_scale_is_applied_on_the_device_and_the_unscaled_vector_returned():
    model = model_with_grads()
    norms = StepNorms()
    kept = norms.keep(0, list(model.named_parameters()), inv_scale=torch.tensor(0.25))
    values = norms.ready()[0][2]
    assert values.tolist() == pytest.approx((kept * 0.25).tolist(), rel=1e-6)


def test_keeping_a_step_reads_nothing_on_the_host():
    """No `.item()` (`_local_scalar_dense`), no `.tolist()`, no `.cpu()` of a device tensor: one
    fused norm, a stack and a copy into a buffer (a non-blocking copy into page-locked memory on a
    GPU: the same ops)."""
    model = model_with_grads()
    norms = StepNorms()
    norms.keep(0, list(model.named_parameters()))
    norms.ready()
    with Ops() as seen:
        for step in range(1, 4):
            norms.keep(step, list(model.named_parameters()), inv_scale=torch.tensor(0.5))
    assert "_local_scalar_dense" not in seen.ops and "_to_copy" not in seen.ops
    assert seen.ops.count("_foreach_norm") == 3 and seen.ops.count("copy_") == 3
    assert [s for s, *_ in norms.ready()] == [1, 2, 3]


def test_a_host_far_ahead_of_its_device_drops_the_oldest_copies_and_counts_them():
    model = model_with_grads()
    norms = StepNorms()
    for step in range(IN_FLIGHT + 2):
        norms.keep(step, list(model.named_parameters()))
    assert norms.dropped == 2
    assert [s for s, *_ in norms.ready()] == list(range(2, IN_FLIGHT + 2))
    norms.clear()
    assert norms.ready() == []


def test_the_sentinel_reuses_the_kept_norms_and_still_names_a_nan():
    model = model_with_grads()
    sentinel, norms = NonfiniteSentinel(model.named_parameters()), StepNorms()
    model[2].weight.grad[0, 0] = math.nan
    kept = norms.keep(0, list(model.named_parameters()))
    with Ops() as seen:
        bad = sentinel.check(norms=kept)
    assert bad == ["2.weight"] and "_foreach_norm" not in seen.ops
    assert math.isnan(norms.ready()[0][2][2])


def test_parameter_norms_of_a_sparse_gradient_are_those_of_its_values():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 4])).sum().backward()
    assert parameter_norms([emb.weight.grad]).item() == pytest.approx(emb.weight.grad.to_dense().norm().item())


def test_steps_with_other_gradients_get_buffers_of_their_size():
    """Parameters without a gradient at some steps (a mixture-of-experts' idle expert): the kept
    vectors differ in length, and the spare buffers are told apart by size."""
    model, norms = model_with_grads(), StepNorms()
    named = list(model.named_parameters())
    for step in range(6):
        model[2].weight.grad = None if step % 2 else torch.ones(2, 5)
        norms.keep(step, named)
        if step % 3 == 2:
            assert [len(v) for _, _, v, _ in norms.ready()] == [4, 3, 4] if step == 2 else [3, 4, 3]
