"""``GradHooks``: the Lightning callback that logs per-module gradient statistics to TensorBoard.

The shell decides *when* (logged steps, micro-batches, optimizers) and hands the *what* to the
core and the log. Its state has two lifetimes: the fit's (:class:`~lightning_gradhooks.shell._fit.Fit`;
the log is kept after fit) and the batch's (:class:`_BatchState`). One class per Lightning
namespace: ``lightning_gradhooks.GradHooks``, ``lightning_gradhooks.lightning.GradHooks``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import pytorch_lightning
from typing_extensions import override

from lightning_gradhooks.shell import _trainer
from lightning_gradhooks.summary.checks import (
    MAX_BINS, check_bool, check_choices, check_folder, check_int, check_needs, check_overrides, check_patterns,
)
from lightning_gradhooks.shell._fit import Fit
from lightning_gradhooks.log import (
    DEFAULT_HISTOGRAM_EVERY_N_STEPS, DEFAULT_STATISTICS, LOGGED_STATISTICS, GradientLog, LoggedStatistic,
)
from lightning_gradhooks.core.monitor import DEFAULT_BINS, GradientMonitor
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.summary.records import GradientRecord
from lightning_gradhooks.health import Thresholds

if TYPE_CHECKING:
    import pytorch_lightning as pl


@dataclass
class _BatchState:
    """The shell's per-batch state, opened by ``on_train_batch_start``, closed by ``_end_batch``
    (hooks in the model: the monitor's ``armed``; offload hooks: the engine's ``active``)."""

    open: bool = False  # between on_train_batch_start and _end_batch
    step: int = 0  # the global step the armed record is logged at
    pieces_due: bool = False  # a logged step on which this rank reduces its sharded pieces only
    log_next: bool = False  # the sentinel caught a NaN: log the next batch in full
    scale: float | None = None  # the gradient scaler's scale at the logged step's write, until the batch ends


class GradHooksLogic:
    r"""Log per-module gradient statistics, histograms and a health report to TensorBoard.

    A thin shell over a :class:`~lightning_gradhooks.GradientMonitor` (collects on logged steps),
    a :class:`~lightning_gradhooks.log.GradientLog` (writes, keeps the report) and an optional
    :class:`~lightning_gradhooks.offload.save_on_disk` engine: it decides when, and what only
    Lightning knows (AMP scale, strategies, checkpoints). Steps that are not logged run as
    without it; every hook is removed after each logged step, at teardown and when fit raises.

    Args:
        every_n_steps: log every this many optimizer steps; default: ``log_every_n_steps``.
        include: glob patterns of module names to monitor; None: modules owning trainable parameters.
        exclude: glob patterns of modules to leave out.
        statistics: charted per module, from :data:`~lightning_gradhooks.log.LOGGED_STATISTICS`; default
            ``["norm", "update_ratio"]`` (the report reads every statistic whatever is charted).
        histograms: log histograms of output and parameter gradients, of ``histogram_bins`` bins
            (1 to 4096).
        offload_threshold_bytes: offload saved activations of at least this many bytes to disk
            during training steps (in ``offload_dir``, default the temporary folder; keeping the
            newest ``offload_budget_bytes`` in memory); None: no offload.
        sync_dist: pool the hook statistics of all data-parallel ranks (one ``all_gather`` per
            logged step); default: rank 0's own. Sharded parameters are always pooled.
        report_thresholds: overrides of :class:`~lightning_gradhooks.health.Thresholds` fields.
        catch_nonfinite: check every step's gradients before the optimizer step and skip a step
            with NaN/Inf (:class:`~lightning_gradhooks.core.sentinel.NonfiniteSentinel`), naming it.
        offload_fix_mmap_threshold: with CPU offload, fix glibc's mmap threshold so that offload
            lowers the peak (one INFO line says so).
        noise_scale: estimate the gradient noise scale (the critical batch size) on logged steps
            (:mod:`lightning_gradhooks.core.noise`).
        compile_statistics: reduce with kernels ``torch.compile`` builds once per process; False
            (or no compiler, said once at INFO, or a model with compiled code of its own, so that
            Dynamo compiles no graph of ours beside yours): eager ops that give the same numbers.
        histogram_every_n_steps: histograms on the first logged step of each window of this many
            optimizer steps (scalars and the report's summary on every logged step).
        activations: on logged steps, also reduce each monitored module's outputs (RMS, absmax,
            mean, the share of zeros, absmax over RMS: on the device, batched with the
            gradients), charted in ``∇8 forward`` (:class:`~lightning_gradhooks.GradientMonitor`).
        attention_logits: on logged steps, also measure the maximum attention logit of every
            ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` call, per module
            (one more ``q·kᵀ`` per call, on logged steps only; :mod:`lightning_gradhooks.core.attention`);
            judged by the report's ``attention_logits`` flag. On by default.
        eager_logged_steps: run the logged steps of a compiled model (``torch.compile``, ``module.compile()``,
            a compiled ``training_step``) eagerly, from the batch's start to its optimizer step
            (``torch.compiler.set_stance("force_eager")``: the compiled code is skipped, not recompiled,
            and every module is seen); the other steps run the compiled code untouched. False: logged
            steps run compiled too, and modules in compiled code report parameter gradients only
            (:mod:`lightning_gradhooks.core.compiled`).
        spikes: keep the gradient norm of every parameter at every optimizer step (one fused
            norm on the device, read one step late without waiting for it), chart the total in
            ``∇1 overview/step_norm``, name each step whose norm jumps far above its recent level
            (a ``spike`` row: its size, the modules carrying it) and log the next step in full
            (:mod:`lightning_gradhooks.health.spikes`).

    Raises:
        ValueError: an invalid argument (at construction), an ``include`` that matches nothing.
        DiskOffloadError: an offload folder that cannot hold an unnamed file, a failed write or read.

    Example::

        trainer = Trainer(max_epochs=1, callbacks=[GradHooks(every_n_steps=10)])
        trainer.fit(model, train_loader)  # then: tensorboard --logdir lightning_logs
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        statistics: list[LoggedStatistic] | None = None,
        histograms: bool = True,
        histogram_bins: int = DEFAULT_BINS,
        offload_threshold_bytes: int | None = None,
        offload_dir: str | None = None,
        sync_dist: bool = False,
        report_thresholds: dict[str, float] | None = None,
        offload_budget_bytes: int | None = None,
        catch_nonfinite: bool = False,
        offload_fix_mmap_threshold: bool = True,
        noise_scale: bool = True,
        compile_statistics: bool = True,
        histogram_every_n_steps: int = DEFAULT_HISTOGRAM_EVERY_N_STEPS,
        activations: bool = True,
        attention_logits: bool = True,
        eager_logged_steps: bool = True,
        spikes: bool = False,
    ) -> None:
        self.every_n_steps = check_int("every_n_steps", every_n_steps, allow_none=True)
        self.include = check_patterns("include", include, allow_empty=False)
        self.exclude = check_patterns("exclude", exclude)
        self.statistics = list(DEFAULT_STATISTICS if statistics is None else
                               check_choices("statistics", statistics, LOGGED_STATISTICS))
        self.histograms = check_bool("histograms", histograms)
        self.histogram_bins = check_int("histogram_bins", histogram_bins, maximum=MAX_BINS)
        self.histogram_every_n_steps = check_int("histogram_every_n_steps", histogram_every_n_steps)
        self.offload_threshold_bytes = check_int("offload_threshold_bytes", offload_threshold_bytes, allow_none=True)
        self.offload_dir = check_folder("offload_dir", offload_dir)
        self.sync_dist = check_bool("sync_dist", sync_dist)
        self.report_thresholds = check_overrides("report_thresholds", report_thresholds, [f.name for f in fields(Thresholds)])
        self.offload_budget_bytes = check_int("offload_budget_bytes", offload_budget_bytes, allow_none=True)
        self.catch_nonfinite = check_bool("catch_nonfinite", catch_nonfinite)
        self.offload_fix_mmap_threshold = check_bool("offload_fix_mmap_threshold", offload_fix_mmap_threshold)
        self.noise_scale = check_bool("noise_scale", noise_scale)
        self.compile_statistics = check_bool("compile_statistics", compile_statistics)
        self.activations = check_bool("activations", activations)
        self.attention_logits = check_bool("attention_logits", attention_logits)
        self.eager_logged_steps = check_bool("eager_logged_steps", eager_logged_steps)
        self.spikes = check_bool("spikes", spikes)
        for name, value in (("offload_budget_bytes", offload_budget_bytes), ("offload_dir", offload_dir)):
            check_needs(name, value, "offload_threshold_bytes", offload_threshold_bytes, "offload off")
        #: The report's :class:`~lightning_gradhooks.Thresholds`, made (each range-checked) now, not at fit start.
        self.thresholds = Thresholds(**self.report_thresholds)
        #: The :class:`~lightning_gradhooks.log.GradientLog` of the current (or last) fit (its ``report``).
        self.gradient_log: GradientLog | None = None
        #: The offload engine's counters (``OffloadStats``) when the last fit ended; None without offload.
        self.offload_stats: Any = None
        self._fit: Fit | None = None  # the fit's resources, from setup to _cleanup
        self._restored: dict[str, Any] | None = None  # the log's state from a checkpoint, for on_fit_start
        self._restored_spikes: dict[str, Any] | None = None  # the spike rules' state from a checkpoint
        self._batch = _BatchState()

    @property
    def monitor(self) -> GradientMonitor | None:
        """The :class:`~lightning_gradhooks.GradientMonitor` of the fit under way; None outside a fit."""
        return self._fit.monitor if self._fit is not None else None

    @property
    def offload(self) -> save_on_disk | None:
        """The offload engine of the fit under way; None without offload and outside a fit."""
        return self._fit.offload if self._fit is not None else None

    @property
    def state_key(self) -> str:
        # Distinct per configuration, so differently configured instances can share a Trainer.
        return self._generate_state_key(every_n_steps=self.every_n_steps, include=self.include, exclude=self.exclude,
                                        offload_threshold_bytes=self.offload_threshold_bytes, sync_dist=self.sync_dist)

    def state_dict(self) -> dict[str, Any]:
        # The schedule follows `trainer.global_step`; ours is the log's state: a resumed run reports on the whole run.
        spikes = self._fit.spikes if self._fit is not None else None
        if spikes is not None and self._read_spikes():  # the steps arrived since the last batch began: in the window
            self._batch.log_next = True
        return {"log": self.gradient_log.state_dict() if self.gradient_log is not None else self._restored,
                "spikes": spikes.state_dict() if spikes is not None else self._restored_spikes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored after `setup` and, with most strategies, before `on_fit_start`, where the log takes it.
        self._restored = state_dict.get("log", state_dict)
        self._restored_spikes = state_dict.get("spikes")
        if self.gradient_log is not None:
            self.gradient_log.load_state_dict(self._restored)
        if self._fit is not None and self._fit.spikes is not None and self._restored_spikes:
            self._fit.spikes.load_state_dict(self._restored_spikes)

    # -- lifecycle -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cleanup()
        # the log is made at fit start, when the optimizers exist
        self.gradient_log, self._restored, self._restored_spikes = None, None, None
        self._fit = Fit(self, trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit is not None:
            self.gradient_log = self._fit.start(self, trainer, pl_module, self._restored, self._restored_spikes)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cleanup()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._cleanup()  # Lightning calls no teardown when fit raises

    def _cleanup(self) -> None:
        """Close the log (printing the report once) and remove everything of the fit; idempotent."""
        self._batch = _BatchState()
        try:
            if self.gradient_log is not None:
                self.gradient_log.close()
        finally:
            fit, self._fit = self._fit, None
            if fit is not None and fit.spikes is not None:
                self._restored_spikes = fit.spikes.state_dict()  # kept after fit, as the log is
            if fit is not None and (stats := fit.remove()) is not None:
                self.offload_stats = stats

    # -- steps -----------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if (fit := self._fit) is None:
            return
        state = self._batch
        monitor = fit.monitor
        if state.open:  # the last batch ended without on_train_batch_end (see _end_batch)
            self._end_batch(trainer)
        if fit.spikes is not None and self._read_spikes():
            state.log_next = True  # a spike at the last step (or the one before): this step in full
        full = state.log_next  # after a spike or a caught NaN: histograms too, off their cadence
        logged = trainer.global_step % fit.interval == 0 or full
        state.open, state.log_next = True, False
        state.pieces_due = (fit.pooled or fit.pieces) and logged
        # Without `sync_dist` only rank 0 logs, so the hooks of the other ranks stay idle.
        observed = trainer.is_global_zero or fit.pooled
        if observed and not monitor.armed and logged:
            state.step = trainer.global_step
            size, accumulation = _trainer.batch_size(batch), trainer.accumulate_grad_batches
            if self.gradient_log is not None:  # histograms counted on the log's cadence
                self.gradient_log.arm(monitor, state.step, batch_size=size, accumulation=accumulation, full=full)
            else:
                monitor.arm(batch_size=size, accumulation=accumulation)
        elif logged and trainer.world_size > 1:  # a rank that logs nothing itself
            monitor.arm_noise(_trainer.batch_size(batch), trainer.accumulate_grad_batches)
        fit.enter_offload()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if (fit := self._fit) is None:
            return
        if not fit.monitor.armed:
            fit.monitor.collect_noise(_trainer.optimizer_params(optimizer))  # armed on its own: its all_reduce
        armed = fit.monitor.armed
        if armed or self._batch.pieces_due:
            self._write_logged(trainer, pl_module, optimizer)
        norms = None
        params = _trainer.optimizer_params(optimizer) if fit.spikes is not None or fit.sentinel is not None else []
        if fit.spikes is not None:  # one fused norm, kept on the device; the sentinel's too
            norms = fit.spikes.keep(trainer.global_step, optimizer, trainer.optimizers, params,
                                    _trainer.inverse_scale(trainer, optimizer))
        if fit.sentinel is not None and _trainer.loss_scale(trainer) is None:  # a scaler skips such steps itself
            # A step with a non-finite gradient is skipped, written unless its record says so, the next logged.
            bad = fit.skip_nonfinite(params, norms)
            if bad is not None:
                self._batch.log_next = True
                if self.gradient_log is not None and not armed:
                    self.gradient_log.write_caught(trainer.global_step, bad, fit.sentinel.last_checked)

    def _read_spikes(self, wait: bool = False) -> bool:
        """Judge the step norms that have arrived (all of them with ``wait``), chart them and
        write the spikes; whether one was found."""
        found = False
        for step, optimizer, norm, spike in self._fit.spikes.read(wait):
            found = found or spike is not None
            if self.gradient_log is not None and not self.gradient_log.closed:
                self.gradient_log.write_step_norm(step, norm, spike, optimizer)
        return found

    def _write_logged(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        monitor, params = self._fit.monitor, self._fit.parameters_of(trainer, optimizer)
        if not monitor.armed:
            # A rank that logs nothing itself still holds pieces of the sharded parameters.
            if pl_module.automatic_optimization:
                self._batch.pieces_due = False
            self._write(trainer, monitor.collect_parameters(params), optimizer)
            return
        # One record per optimizer step: the hook statistics of every backward since the last one
        # pooled (micro-batches, manual_backward calls), and the gradients this optimizer steps.
        record = monitor.collect(params)
        if not pl_module.automatic_optimization:
            monitor.arm(noise=False)  # later backward passes of this step are logged too; one noise sample
        self._write(trainer, record, optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end_batch(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer, epoch_over=True)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer)

    def _end_batch(self, trainer: pl.Trainer, epoch_over: bool = False) -> None:
        """End what ``on_train_batch_start`` began, idempotently (Lightning skips ``on_train_batch_end``
        when it returns -1). Statistics waiting for their optimizer step (accumulation) keep the
        monitor armed, unless the epoch is over: then a backward no step followed is logged as it is."""
        self._batch.open = False
        if self._fit is None:
            return
        scale, self._batch.scale = self._batch.scale, None
        if scale is not None and self.gradient_log is not None:  # scaler.update() has run: did it skip the step?
            self.gradient_log.write_scaler(self._batch.step, scale, _trainer.loss_scale(trainer))
        monitor = self._fit.monitor
        try:
            self._fit.leave_offload()
            if epoch_over and monitor.pending:
                # Ranks may differ here, so this is rank 0's own record, with no collective.
                self._write(trainer, monitor.collect(parameters=()), None, pool=False)
        finally:
            if epoch_over or not monitor.pending:
                monitor.disarm(noise=epoch_over)  # at the epoch's end, a noise probe no step collected too

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer, epoch_over=True)  # fit may end without ending its epoch (max_steps)
        if self._fit is not None and self._fit.spikes is not None:
            self._read_spikes(wait=True)  # the last steps' norms: the fit is over, waiting costs nothing
        if self.gradient_log is not None:
            self.gradient_log.close()

    def _write(self, trainer: pl.Trainer, record: GradientRecord, optimizer: Any, pool: bool = True) -> None:
        # Under a gradient scaler the hooks saw gradients of the scaled loss (its scale changes only after
        # the optimizer step); parameter gradients too when the optimizer unscales in its own step.
        scale = _trainer.loss_scale(trainer)
        if scale is not None:
            record = record.unscaled(scale, parameters=optimizer is not None and _trainer.optimizer_unscales(optimizer))
        if self.gradient_log is not None:
            # Lightning runs this hook inside `optimizer.step(closure)`, after the step's
            # pre-hook: the log copies the weights now, and the post-hook measures the update.
            self.gradient_log.write(record, self._batch.step, optimizer=optimizer, stepping=optimizer is not None,
                                    scalars=None if scale is None else {"loss_scale": scale}, pool=pool)
            if optimizer is not None and scale is not None and record.entries and self._batch.scale is None:
                self._batch.scale = scale  # told to the log once the batch ends (_end_batch)


class GradHooks(GradHooksLogic, pytorch_lightning.Callback):
    __doc__ = GradHooksLogic.__doc__
