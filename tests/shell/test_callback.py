import collections
import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from lightning_gradhooks import GradHooks
from lightning_gradhooks.summary.events import STATS_TAG
from lightning_gradhooks.log import LOGGED_STATISTICS

from conftest import MLP, AdamMLP, GradRecorder, graph_nodes, hook_snapshot, loader, make_trainer, read_events

LAYERS = ["net.0", "net.2", "net.4"]
PARAMS = [f"{m}.{p}" for m in LAYERS for p in ("weight", "bias")]


def fit(tmp_path, callback=None, model=None, **kwargs):  # noqa: ANN001, ANN201
    pl.seed_everything(0, verbose=False)
    model = model or MLP()
    trainer = make_trainer(tmp_path, [callback] if callback else [], **kwargs)
    trainer.fit(model, loader(), loader(16))
    return trainer, model


def sections(tags) -> set[str]:  # noqa: ANN001
    return {t.partition("/")[0] for t in tags}


def test_default_charts_are_seven_sections_a_third_of_every_statistic(tmp_path):
    trainer, _ = fit(tmp_path / "default", GradHooks(every_n_steps=2))
    events = read_events(trainer.logger.log_dir)
    tags = events.Tags()
    ours = [t for t in tags["scalars"] + tags["histograms"] + tags["images"] if t.startswith("∇")]
    assert sections(ours) == {"∇1 overview", "∇2 grad_output_norm", "∇3 grad_input_norm", "∇4 param_grad_norm",
                              "∇5 param_update_ratio", "∇6 histograms", "∇8 forward"}  # the outputs' RMS
    assert {"∇1 overview/total_norm", "∇1 overview/nonfinite_total", "∇1 overview/gradient_flow"} <= set(ours)
    trainer, _ = fit(tmp_path / "all", GradHooks(every_n_steps=2, statistics=list(LOGGED_STATISTICS)))
    every = [t for t in read_events(trainer.logger.log_dir).Tags()["scalars"] if t.startswith("∇")]
    assert len(sections(every)) > 6 and len(tags["scalars"]) <= len(every) / 2
    assert set(tags["scalars"]) & set(every) == {t for t in tags["scalars"] if t.startswith("∇")}


def test_events_hold_expected_tags_at_expected_steps(tmp_path):
    trainer, _ = fit(tmp_path, GradHooks(every_n_steps=2, statistics=list(LOGGED_STATISTICS), histogram_every_n_steps=3))
    events = read_events(trainer.logger.log_dir)
    scalars, histograms = set(events.Tags()["scalars"]), set(events.Tags()["histograms"])
    assert {"∇1 overview/total_norm", "∇1 overview/nonfinite_total"} <= scalars
    assert not [t for t in scalars if t.endswith("_nonfinite")]  # written from the first non-zero step only
    for stat in ("norm", "mean", "std", "absmax", "zero_fraction"):
        number = lambda kind: 7 if stat != "norm" else {"grad_output": 2, "grad_input": 3, "param_grad": 4}[kind]  # noqa: E731
        assert {f"∇{number('grad_output')} grad_output_{stat}/{m}" for m in LAYERS} <= scalars
        assert {f"∇{number('grad_input')} grad_input_{stat}/{m}" for m in ("net.2", "net.4")} <= scalars
        assert {f"∇{number('param_grad')} param_grad_{stat}/{p}" for p in PARAMS} <= scalars
    assert {f"∇5 param_update_ratio/{p}" for p in PARAMS} | {f"∇7 param_norm/{p}" for p in PARAMS} <= scalars
    assert "∇3 grad_input_norm/net.0" not in scalars  # the input batch needs no grad
    assert histograms == {f"∇6 histograms/grad_output/{m}" for m in LAYERS} | {f"∇6 histograms/param_grad/{p}" for p in PARAMS}
    for tag in ("∇2 grad_output_norm/net.0", "∇7 param_grad_std/net.4.bias"):
        assert [e.step for e in events.Scalars(tag)] == [0, 2, 4]
    hist = events.Histograms("∇6 histograms/grad_output/net.2")
    assert [e.step for e in hist] == [0, 4]  # the first logged step of each window of 3 steps (0-2, 3-5)
    assert [e.step for e in events.Tensors(STATS_TAG)][:3] == [0, 0, 2]  # the summary of every logged step
    assert hist[0].histogram_value.num == 8 * 16  # batch 8 x 16 features, all finite
    norm = events.Scalars("∇2 grad_output_norm/net.2")[0].value
    assert hist[0].histogram_value.sum_squares == pytest.approx(norm**2, rel=1e-4)


def test_default_interval_is_log_every_n_steps_and_statistics_are_chosen(tmp_path):
    trainer, _ = fit(tmp_path, GradHooks(statistics=["norm"], histograms=False), log_every_n_steps=5)
    events = read_events(trainer.logger.log_dir)
    ours = {t for t in events.Tags()["scalars"] if "grad" in t}
    assert ours == {f"∇2 grad_output_norm/{m}" for m in LAYERS} | {"∇3 grad_input_norm/net.2", "∇3 grad_input_norm/net.4"} | {
        f"∇4 param_grad_norm/{p}" for p in PARAMS
    }
    assert events.Tags()["histograms"] == []
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.0")] == [0, 5]


def test_include_and_exclude_choose_modules(tmp_path):
    trainer, _ = fit(tmp_path, GradHooks(every_n_steps=3, include=["net.*"], exclude=["net.3", "net.4"]))
    tags = read_events(trainer.logger.log_dir).Tags()["scalars"]
    assert {t.split("/", 1)[1] for t in tags if t.startswith("∇2 grad_output_norm/")} == {"net.0", "net.1", "net.2"}


def test_pattern_matching_nothing_fails_at_fit_start_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"'encoder\.\*' matches no module of MLP.*'net.0'"):
        fit(tmp_path, GradHooks(include=["encoder.*"]))


def test_losses_and_gradients_bitwise_identical(tmp_path):
    runs = []
    for callback in (None, GradHooks(every_n_steps=1)):
        recorder = GradRecorder()
        pl.seed_everything(0, verbose=False)
        model = MLP()
        trainer = make_trainer(tmp_path, [c for c in (callback, recorder) if c])
        trainer.fit(model, loader())
        runs.append((torch.stack(model.losses), recorder.grads))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) == 6
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads_a, grads_b) for a, b in zip(step_a, step_b))


def test_no_logger_is_warned(tmp_path):
    with pytest.warns(UserWarning, match="found no logger"):
        fit(tmp_path, GradHooks(), logger=False)


class HookCounter(pl.Callback):
    def __init__(self) -> None:
        self.counts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        layer = pl_module.net[0]
        self.counts.append(len(layer._backward_hooks) + len(layer._forward_hooks) + len(layer._forward_pre_hooks))


def test_hooks_removed_after_fit_and_fit_twice_does_not_double_them(tmp_path):
    model = MLP()
    before = hook_snapshot(model)
    counter = HookCounter()
    callback = GradHooks(noise_scale=False, attention_logits=False)  # the probe's and attention's hooks: test_noise, test_forward_stats
    for max_steps in (2, 4):  # the second fit resumes training for two more steps
        trainer = make_trainer(tmp_path, [callback, counter], max_steps=max_steps)
        trainer.fit(model, loader())
        assert hook_snapshot(model) == before
    # Each fit has its own trainer, from step 0. Logged steps carry the in-place probe's forward
    # pre-hook and forward hook in step 0, then a forward hook (the Linear is one op on its input:
    # grad_input from the edge of its node, no pre-hook), nothing else.
    assert counter.counts == [2, 1] + [2, 1, 1, 1]
    callback.teardown(trainer, model, "fit")  # cleanup is safe to run again


class GraphRecorder(MLP):
    """Records the autograd nodes of each training step's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[collections.Counter] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        self.graphs.append(graph_nodes(loss))
        return loss


def test_steps_that_are_not_logged_carry_no_hook_and_no_hook_node(tmp_path):
    model = GraphRecorder()
    before = hook_snapshot(model)
    counter = HookCounter()
    snapshots = []
    checker = pl.Callback()
    checker.on_train_batch_start = lambda *a: snapshots.append(hook_snapshot(model) == before)
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=3, noise_scale=False, attention_logits=False), counter, checker], max_steps=7)
    trainer.fit(model, loader())
    # Logged steps (0, 3, 6) carry the in-place probe's forward pre-hook and forward hook in step
    # 0, then a forward hook (the Linear is read from its edge); steps that are not logged, none.
    assert counter.counts == [2, 0, 0, 1, 0, 0, 1]
    assert snapshots == [False, True, True, False, True, True, False]
    bare = model.graphs[1]
    assert "BackwardHookFunctionBackward" not in bare and "ViewBackward0" not in bare
    # The probe reads grad_output only; later logged steps read grad_input from the edge of each
    # Linear's node (one op on its input): no view, no node of ours in any graph.
    assert [model.graphs[i] for i in range(7)] == [bare] * 7
    assert hook_snapshot(model) == before


def test_hooks_removed_after_exception_in_training_step(tmp_path):
    model = MLP(fail_at=3)
    before = hook_snapshot(model)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        fit(tmp_path, GradHooks(every_n_steps=1), model=model)
    assert hook_snapshot(model) == before


def test_nonfinite_gradients_are_counted_and_warned_once(tmp_path):
    with pytest.warns(UserWarning, match=r"non-finite values at step 2: the loss: the first gradient of backward \(grad_output of `net.4`\)") as rec:
        trainer, _ = fit(tmp_path, GradHooks(every_n_steps=1, statistics=["norm", "nonfinite"], histogram_every_n_steps=1),
                         model=MLP(nan_at=2))
    assert len([w for w in rec if "non-finite" in str(w.message)]) == 1
    events = read_events(trainer.logger.log_dir)
    counts = {e.step: e.value for e in events.Scalars("∇7 grad_output_nonfinite/net.4")}
    assert min(counts) == 2 and counts[2] == 3  # one sample's 3 logits, charted from that step on
    totals = {e.step: e.value for e in events.Scalars("∇1 overview/nonfinite_total")}
    assert totals[0] == totals[1] == 0 and totals[2] > 3  # every logged step
    # Histograms are built from the finite values of that step.
    hist = {e.step: e.histogram_value for e in events.Histograms("∇6 histograms/grad_output/net.4")}
    assert hist[2].num == 8 * 3 - 3


def test_without_tensorboard_scalars_go_to_other_loggers_with_one_warning(tmp_path):
    logger = CSVLogger(str(tmp_path))
    with pytest.warns(UserWarning, match="no TensorBoardLogger") as rec:
        fit(tmp_path, GradHooks(every_n_steps=2, statistics=list(LOGGED_STATISTICS)), logger=logger)
    assert len([w for w in rec if "TensorBoardLogger" in str(w.message)]) == 1
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    # A table of columns gets the overview and the per-module norms, not every statistic, under
    # ASCII names (no "∇<n> ", which only orders TensorBoard's sections).
    columns = header.split(",")
    assert {"grad_output_norm/net.0", "param_grad_norm/net.4.bias", "overview/total_norm"} <= set(columns)
    assert header.isascii() and not [c for c in columns if "update_ratio" in c or "absmax" in c]


class ArmedProbe(pl.Callback):
    def __init__(self, gradhooks: GradHooks) -> None:
        self.gradhooks = gradhooks
        self.seen = []

    def _check(self) -> None:
        monitor = self.gradhooks.monitor
        self.seen.append(monitor is not None and (monitor.armed or monitor.pending))

    def on_validation_batch_end(self, *args, **kwargs):  # noqa: ANN002, ANN003
        self._check()


def test_validation_test_and_predict_do_no_hook_work_and_warn_nothing(tmp_path):
    callback = GradHooks(every_n_steps=1)
    probe = ArmedProbe(callback)
    model = MLP()
    trainer = make_trainer(tmp_path, [callback, probe], val_check_interval=2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model, loader(), loader(16))
        trainer.validate(model, loader(16), verbose=False)
        trainer.test(model, loader(16), verbose=False)
        trainer.predict(model, loader(16))
    assert probe.seen and not any(probe.seen)
    ours = [w for w in rec if "GradHooks" in str(w.message) or "backward hook" in str(w.message)]
    assert ours == []
    assert all(len(m._backward_hooks) == 0 for m in model.modules())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(every_n_steps=0), "`every_n_steps` expected a positive int or None, got 0"),
        (dict(every_n_steps=2.5), "`every_n_steps` expected a positive int or None, got 2.5"),
        (dict(every_n_steps=True), "`every_n_steps` expected a positive int or None, got True"),
        (dict(include="net.0"), r"`include` expected a non-empty list of glob patterns \(str\) or None, got 'net.0'"),
        (dict(exclude=[1]), r"`exclude` expected a list of glob patterns \(str\) or None, got \[1\]"),
        (dict(statistics=["norm", "median"]), r"`statistics` expected a list drawn from \['norm'"),
        (dict(statistics="norm"), "`statistics` expected a list drawn from"),
        (dict(histograms="yes"), r"`histograms` expected a bool \(True or False\), got 'yes'"),
        (dict(sync_dist=1), r"`sync_dist` expected a bool \(True or False\), got 1"),
        (dict(histogram_bins=0), "`histogram_bins` expected an int from 1 to 4096, got 0"),
    ],
)
def test_invalid_arguments_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradHooks(**kwargs)


def test_mixed_precision_statistics_are_unscaled_and_the_scale_is_logged(tmp_path):
    from pytorch_lightning.plugins.precision import MixedPrecision

    norms = {}
    for init_scale in (1.0, 1024.0):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
        trainer, _ = fit(
            tmp_path / str(init_scale), GradHooks(every_n_steps=1, statistics=["norm", "absmax"]), max_steps=2,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        )
        events = read_events(trainer.logger.log_dir)
        assert [e.value for e in events.Scalars("∇1 overview/loss_scale")] == [init_scale, init_scale]
        norms[init_scale] = {
            tag: events.Scalars(tag)[0].value
            for tag in ("∇2 grad_output_norm/net.4", "∇7 grad_input_absmax/net.2", "∇4 param_grad_norm/net.0.weight")
        }
        hist = events.Histograms("∇6 histograms/grad_output/net.4")[0].histogram_value
        absmax = events.Scalars("∇7 grad_output_absmax/net.4")[0].value
        assert max(abs(hist.min), abs(hist.max)) == pytest.approx(absmax, rel=1e-6)
        norms[init_scale]["hist.max"] = hist.max
    for tag, value in norms[1.0].items():
        assert norms[1024.0][tag] == pytest.approx(value, rel=1e-2), tag


def test_an_optimizer_that_unscales_in_its_own_step_logs_unscaled_gradients(tmp_path):
    """Lightning skips `scaler.unscale_` before `on_before_optimizer_step` for fused Adam, which
    unscales inside its step: the logged parameter gradients, total norm and noise scale must still
    be those of the unscaled gradients, as with the unfused Adam."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    logged = {}
    for fused in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        pl.seed_everything(0, verbose=False)
        callback = GradHooks(every_n_steps=1)
        trainer, _ = fit(tmp_path / str(fused), callback, model=AdamMLP(fused), max_steps=3,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        events = read_events(trainer.logger.log_dir)
        tags = [t for t in events.Tags()["scalars"] if t.startswith(("∇4 param_grad_norm/", "∇1 overview/total_norm"))]
        logged[fused] = {(t, e.step): e.value for t in tags for e in events.Scalars(t)}
        noise = callback.gradient_log.noise_scale  # |G|² and tr(Σ): both scale with the loss scale squared
        assert noise.steps == 3
        logged[fused] |= {("grad_sq", 3): noise.grad_sq, ("trace", 3): noise.trace}
    assert set(logged[True]) == set(logged[False]) and len(logged[True]) == 3 * 7 + 2
    for key, value in logged[False].items():
        assert logged[True][key] == pytest.approx(value, rel=1e-2), key


def test_resume_from_checkpoint_keeps_the_schedule_and_state(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = MLP(nan_at=1)  # step 1 is non-finite (and everything after it)
    first = GradHooks(every_n_steps=2, include=["net.4"])
    other = GradHooks(every_n_steps=3)  # a second, differently configured instance
    trainer = make_trainer(tmp_path / "a", [first, other], max_steps=3)
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(model, loader())
    path = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=False)["callbacks"]
    assert len([k for k in states if k.startswith("GradHooks")]) == 2
    state = states[first.state_key]["log"]
    assert state["in_nonfinite_episode"] is True and state["report"]["seen"] == [0, 2]

    resumed = GradHooks(every_n_steps=2, include=["net.4"])
    trainer = make_trainer(tmp_path / "b", [resumed], max_steps=6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(MLP(nan_at=1), loader(), ckpt_path=path)
    assert not [w for w in rec if "non-finite" in str(w.message)]  # still the same episode
    events = read_events(trainer.logger.log_dir)
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.4")] == [4]
    # The report goes on from the checkpoint's: the NaN of step 2, and three logged steps.
    report = resumed.gradient_log.report
    assert report.steps == 3 and report.first_nonfinite.since == 2


class CollectorProbe(pl.Callback):
    """Whether Python's cyclic garbage collector is on, at each phase of each batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, bool]] = []

    def _see(self, trainer, phase):  # noqa: ANN001
        import gc

        self.seen.append((trainer.global_step, phase, gc.isenabled()))

    def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN002
        self._see(trainer, "start")

    def on_before_optimizer_step(self, trainer, *args):  # noqa: ANN001, ANN002
        self._see(trainer, "logged")  # after GradHooks' collect and write, which come first

    def on_train_batch_end(self, trainer, *args):  # noqa: ANN001, ANN002
        self._see(trainer, "end")


def test_the_garbage_collector_is_on_at_every_phase_of_every_batch_and_after_fit(tmp_path):
    """The monitor pauses the collector inside its collect() only (its one owner): it is on at
    the start of every batch, after GradHooks' writing, at the end, and after fit, also when fit
    raises; a collector the user switched off stays off."""
    import gc

    probe = CollectorProbe()
    trainer = make_trainer(tmp_path, [GradHooks(every_n_steps=2), probe], max_steps=4)
    trainer.fit(MLP(), loader())
    assert gc.isenabled()
    assert [on for *_, on in probe.seen] == [True] * 12
    with pytest.raises(RuntimeError, match="boom in training_step"):
        make_trainer(tmp_path, [GradHooks(every_n_steps=1)]).fit(MLP(fail_at=2), loader())
    assert gc.isenabled()
    gc.disable()
    try:
        make_trainer(tmp_path, [GradHooks(every_n_steps=1)], max_steps=2).fit(MLP(), loader())
        assert not gc.isenabled()
    finally:
        gc.enable()


class SparseEmbeddingModel(pl.LightningModule):
    """``nn.Embedding(sparse=True)``: its weight's gradient is a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 4, sparse=True)
        self.head = torch.nn.Linear(4, 3)
        self.weight_grads: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.embed(x).mean(1)), y)

    def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
        self.weight_grads.append(self.embed.weight.grad.to_dense().clone())

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sparse_parameter_gradients_are_logged_as_their_dense_tensor(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, 50, (32, 5), generator=g), torch.randint(0, 3, (32,), generator=g)), batch_size=8)
    model = SparseEmbeddingModel()
    hooks = GradHooks(every_n_steps=1, statistics=["norm", "zero_fraction"])
    trainer = make_trainer(tmp_path, [hooks], max_steps=3)
    trainer.fit(model, data)
    events = read_events(trainer.logger.log_dir)
    logged = [e.value for e in events.Scalars("∇4 param_grad_norm/embed.weight")]
    zeros = [e.value for e in events.Scalars("∇7 param_grad_zero_fraction/embed.weight")]
    assert logged == pytest.approx([g.norm().item() for g in model.weight_grads], rel=1e-5)
    assert zeros == pytest.approx([(g == 0).double().mean().item() for g in model.weight_grads], rel=1e-6)
    assert events.Histograms("∇6 histograms/param_grad/embed.weight")[0].histogram_value.num == 50 * 4
