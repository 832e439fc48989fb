"""GradHooks in Lightning training set-ups: gradient accumulation, manual optimization."""

import pytest
import pytorch_lightning as pl
import torch

from lightning_gradhooks import GradHooks
from lightning_gradhooks.core.stats import reduce
from lightning_gradhooks.summary.statistics import STATISTICS

from conftest import MLP, ManualGAN, hook_snapshot, loader, make_trainer, pooled_calls, read_events, tag


class OutputGrads(pl.Callback):
    """An independent reference: the gradient of `net.4`'s output in every backward, captured
    with a plain tensor hook, grouped by optimizer step; and the parameter gradient at each step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = [[]]
        self.weight_grads: list[torch.Tensor] = []

    def on_fit_start(self, trainer, pl_module):  # noqa: ANN001
        def forward_hook(module, args, output):  # noqa: ANN001, ANN202
            if torch.is_grad_enabled():
                output.register_hook(lambda grad: self.steps[-1].append(grad.clone()))

        self.handle = pl_module.net[4].register_forward_hook(forward_hook)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self.weight_grads.append(pl_module.net[4].weight.grad.clone())
        self.steps.append([])

    def on_fit_end(self, trainer, pl_module):  # noqa: ANN001
        self.handle.remove()


def test_accumulated_micro_batches_give_one_record_per_optimizer_step(tmp_path):
    pl.seed_everything(0, verbose=False)
    reference = OutputGrads()
    trainer = make_trainer(
        tmp_path, [GradHooks(every_n_steps=1, statistics=list(STATISTICS)), reference], max_steps=3, accumulate_grad_batches=3
    )
    trainer.fit(MLP(), loader())
    events = read_events(trainer.logger.log_dir)
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.4")] == [0, 1, 2]
    # 8 batches per epoch: the epoch's last optimizer step accumulates the remaining two.
    assert list(pooled_calls(trainer.logger.log_dir, "net.4").values()) == [3, 3, 2]
    for step in range(3):
        # Hook statistics pool the three micro-batches, as one batch three times as large.
        want = reduce([torch.cat([g.flatten() for g in reference.steps[step]])])[0][0]
        assert len(reference.steps[step]) == [3, 3, 2][step]
        for i, stat in enumerate(STATISTICS):
            if stat == "nonfinite":  # charted from its first non-zero step only: never here
                assert tag("grad_output", stat, "net.4") not in events.Tags()["scalars"] and want[i] == 0
                continue
            got = events.Scalars(tag("grad_output", stat, "net.4"))[step].value
            assert got == pytest.approx(want[i], rel=1e-5, abs=1e-8), stat
        # Parameter gradients are read once accumulation is complete.
        got = events.Scalars("∇4 param_grad_norm/net.4.weight")[step].value
        assert got == pytest.approx(reference.weight_grads[step].norm().item(), rel=1e-5)


def test_manual_optimization_labels_each_optimizer_step(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = ManualGAN()
    before = hook_snapshot(model)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=4)  # 2 batches
    trainer.fit(model, loader())
    assert hook_snapshot(model) == before
    events = read_events(trainer.logger.log_dir)
    tags = set(events.Tags()["scalars"])
    # The discriminator's backward (optimizer 1) and the generator's (optimizer 0) are apart;
    # each record holds the parameter gradients of the optimizer that steps.
    d_pass = {"∇2 grad_output_norm/optimizer_1/disc.0", "∇2 grad_output_norm/optimizer_1/disc.2",
              "∇4 param_grad_norm/optimizer_1/disc.0.weight"}
    g_pass = {"∇2 grad_output_norm/optimizer_0/disc.2", "∇2 grad_output_norm/optimizer_0/gen.2",
              "∇4 param_grad_norm/optimizer_0/gen.0.weight"}
    assert d_pass | g_pass <= tags
    assert "∇2 grad_output_norm/optimizer_1/gen.2" not in tags  # fake.detach(): no gradient reaches gen
    assert "∇4 param_grad_norm/optimizer_0/disc.0.weight" not in tags
    assert "∇4 param_grad_norm/optimizer_1/gen.0.weight" not in tags
    # The discriminator runs twice in its own pass (fake and real) and once in the generator's.
    assert pooled_calls(trainer.logger.log_dir, "disc.2", optimizer=1) == {0: 2, 2: 2}
    assert set(pooled_calls(trainer.logger.log_dir, "disc.2", optimizer=0).values()) == {1}
    # Each batch makes two optimizer steps: global steps 0 and 2 are logged.
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/optimizer_0/gen.2")] == [0, 2]


def test_bf16_mixed_precision_logs_without_a_scale(tmp_path):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=2, precision="bf16-mixed")
    trainer.fit(MLP(), loader())
    events = read_events(trainer.logger.log_dir)
    tags = events.Tags()["scalars"]
    assert "loss_scale" not in tags
    norms = [e.value for e in events.Scalars("∇2 grad_output_norm/net.4")]
    assert len(norms) == 2 and all(0 < v < float("inf") for v in norms)
    assert [e.step for e in events.Scalars("∇3 grad_input_norm/net.2")] == [1]


class ManualAccumulation(MLP):
    """Manual optimization that steps every second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.manual_backward(torch.nn.functional.cross_entropy(self(x), y))
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()


def test_manual_accumulation_pools_until_the_step_and_a_last_backward_is_not_lost(tmp_path):
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_epochs=1, max_steps=-1)
    trainer.fit(ManualAccumulation(), loader(n=24))  # 3 batches: backward, backward + step, backward
    events = read_events(trainer.logger.log_dir)
    assert pooled_calls(trainer.logger.log_dir, "net.4") == {0: 2, 1: 1}
    # The third backward has no optimizer step after it: logged when training ends.
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.4")] == [0, 1]
    assert [e.step for e in events.Scalars("∇4 param_grad_norm/net.4.weight")] == [0]
