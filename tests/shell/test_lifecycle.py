"""Nothing of ours stays on, however a step ends.

GradHooks: however Lightning ends a training batch or epoch (``on_train_batch_start`` returning
-1, ``training_step`` returning None, ``trainer.should_stop``, ``max_steps``, a callback that
raises, manual optimization), the offload hooks are exited, the garbage collector is on and no
module holds a hook of ours, as seen from the LightningModule's own hooks, which Lightning runs
after the callbacks'. GradientMonitor: a plain loop that goes on after a step raised between a
bare ``arm()`` and ``collect()`` gets a clean next record, one warning, and a collector that
was never left off.
"""

import gc
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gradhooks import GradHooks, GradientMonitor

from conftest import MLP, FailingBackward, ManualGAN, hook_snapshot, loader, make_trainer, pooled_calls, read_events


def saved_tensors_hooks_off() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Observed:
    """Records, from the LightningModule's own hooks, whether anything of GradHooks is on."""

    ends_epoch_at: int | None = None  # on_train_batch_start returns -1 at this batch of epoch 0

    def start_observing(self) -> None:
        self.before = hook_snapshot(self)
        self.seen: list[tuple[str, bool]] = []

    def observe(self, where: str) -> None:
        clean = gc.isenabled() and saved_tensors_hooks_off() and hook_snapshot(self) == self.before
        self.seen.append((where, clean))

    def on_train_batch_start(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.current_epoch == 0 and batch_idx == self.ends_epoch_at:
            return -1  # Lightning skips the rest of the epoch, and on_train_batch_end
        return None

    def on_train_epoch_end(self) -> None:
        self.observe("train_epoch_end")

    def on_validation_start(self) -> None:
        self.observe("validation_start")

    def on_train_end(self) -> None:
        self.observe("train_end")


class ObservedMLP(Observed, MLP):
    def __init__(self, ends_epoch_at=None, none_at=None, stop_at=None) -> None:  # noqa: ANN001
        super().__init__()
        self.ends_epoch_at, self.none_at, self.stop_at = ends_epoch_at, none_at, stop_at
        self.start_observing()

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.stop_at:
            self.trainer.should_stop = True
        return None if batch_idx == self.none_at else loss  # None: Lightning skips the optimization


class ObservedGAN(Observed, ManualGAN):
    def __init__(self) -> None:
        super().__init__()
        self.ends_epoch_at = 2
        self.start_observing()


class AfterBatch(pl.Callback):
    """A callback after GradHooks: sees its state at the end of every optimizer step's batches
    (between the micro-batches of one step, the monitor stays armed on purpose)."""

    def __init__(self, model: Observed) -> None:
        self.model = model

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.model.observe("train_batch_end")


CASES = {
    # on_train_batch_start returns -1 on a logged step: the rest of epoch 0 is skipped
    "-1": (lambda: ObservedMLP(ends_epoch_at=2), {}),
    # ... in the middle of an accumulation window: a backward that no optimizer step followed
    "-1 accumulating": (lambda: ObservedMLP(ends_epoch_at=3), dict(accumulate_grad_batches=2)),
    "-1 manual optimization": (ObservedGAN, {}),
    "training_step returns None": (lambda: ObservedMLP(none_at=1), {}),
    "should_stop": (lambda: ObservedMLP(stop_at=1), dict(max_epochs=1)),
    "max_steps mid-epoch": (lambda: ObservedMLP(), dict(max_steps=3)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_nothing_of_ours_stays_on_however_a_batch_or_epoch_ends(tmp_path, case, offload):
    make, options = CASES[case]
    model = make()
    callback = GradHooks(every_n_steps=1, offload_threshold_bytes=256 if offload else None)
    options = dict(dict(max_epochs=2, max_steps=-1, limit_train_batches=4), **options)
    trainer = make_trainer(tmp_path, [callback, AfterBatch(model)], **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's warnings about the odd loops
        trainer.fit(model, loader(), loader(16) if isinstance(model, MLP) else None)
    wheres = [where for where, _ in model.seen]
    assert "train_epoch_end" in wheres and wheres[-1] == "train_end"
    assert [where for where, clean in model.seen if not clean] == []
    assert gc.isenabled() and saved_tensors_hooks_off() and hook_snapshot(model) == model.before
    events = read_events(trainer.logger.log_dir)
    calls = pooled_calls(trainer.logger.log_dir, "net.0")
    if case == "-1 accumulating":
        # Steps 0 (batches 0-1) and 1 (batch 2, cut short by -1 at batch 3: logged at the end of
        # the epoch), then epoch 1 starts again at step 1: nothing of the cut window is pooled in.
        assert calls == {0: 2, 1: 2, 2: 2}
        assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.0")] == [0, 1, 1, 2]
    elif case != "-1 manual optimization":  # the GAN's disc runs twice a step
        assert set(calls.values()) == {1}  # no record pooled the gradients of two batches


def test_a_callback_that_raises_in_on_train_batch_start_leaves_nothing_on(tmp_path):
    class Raises(pl.Callback):
        def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN002
            if trainer.global_step == 2:  # after GradHooks armed, paused and entered offload
                raise RuntimeError("boom in a callback")

    model = ObservedMLP()
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=1, offload_threshold_bytes=256), Raises()])
    with pytest.raises(RuntimeError, match="boom in a callback"):
        trainer.fit(model, loader())
    assert gc.isenabled() and saved_tensors_hooks_off() and hook_snapshot(model) == model.before


# -- plain loops: a bare arm() and a step that raises ------------------------------------------


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 2))


class Boom(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            raise RuntimeError("boom in forward")
        return FailingBackward.apply(x)


def clean_record(x: torch.Tensor):  # noqa: ANN201
    model = small_model()
    monitor = GradientMonitor(model)
    with monitor.attach(), monitor.arm():
        model(x).sum().backward()  # the probe step
        monitor.collect()
    model.zero_grad()
    with monitor.attach(), monitor.arm():
        model(x).sum().backward()
        return monitor.collect()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("probed", [False, True], ids=["first armed step", "later armed step"])
def test_a_plain_loop_that_goes_on_after_a_failed_armed_step_gets_a_clean_record(where, probed):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model = small_model()
    failing = nn.Sequential(*model[:3], Boom(where), *model[3:])  # the same modules, and a failure
    monitor = GradientMonitor(model)
    with monitor.attach():
        if probed:
            monitor.arm()
            model(x).sum().backward()
            monitor.collect()
        monitor.arm()  # bare, as in a loop that catches errors and goes on
        with pytest.raises(RuntimeError, match=f"boom in {where}"):
            failing(x).sum().backward()
        assert gc.isenabled()  # never left off by a step that raised
        model.zero_grad()
        with pytest.warns(UserWarning, match=r"still armed .* partial statistics are dropped") as caught:
            monitor.arm()
        assert len([w for w in caught if "still armed" in str(w.message)]) == 1
        model(x).sum().backward()
        record = monitor.collect()
        if not probed:  # the failed step's probe was dropped: this one probes
            monitor.arm()
            model.zero_grad()
            model(x).sum().backward()
            record = monitor.collect()
    assert gc.isenabled() and not monitor.armed
    assert record.entries and all(e.calls == 1 for e in record.entries)
    reference = clean_record(x)
    assert [(e.kind, e.name) for e in record.entries] == [(e.kind, e.name) for e in reference.entries]
    for got, want in zip(record.entries, reference.entries):
        assert got.stats == pytest.approx(want.stats, rel=1e-6), (got.kind, got.name)


def test_the_with_form_needs_no_disarm_and_warns_nothing():
    x = torch.randn(4, 6)
    model = small_model()
    failing = nn.Sequential(*model[:3], Boom("backward"), *model[3:])
    monitor = GradientMonitor(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.attach():
            for step in range(4):
                try:
                    with monitor.arm(when=step % 2 == 0):
                        (failing if step == 0 else model)(x).sum().backward()
                        record = monitor.collect()
                except RuntimeError:
                    assert gc.isenabled() and not monitor.armed
                    continue
                assert bool(record.entries) == (step % 2 == 0)
                assert all(e.calls == 1 for e in record.entries)
                model.zero_grad()
