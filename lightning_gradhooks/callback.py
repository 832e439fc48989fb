"""``GradHooks``: the Lightning callback that logs per-module gradient statistics to TensorBoard.

The shell decides *when* (logged steps, micro-batches, optimizers) and hands the *what* to the
core and the log. Its state is of two lifetimes: the fit's (the monitor, the log, the offload
engine, the sentinel, made in ``setup``/``on_fit_start`` and removed by ``_cleanup``) and the
batch's, held in one :class:`_Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytorch_lightning
from lightning_utilities.core.rank_zero import rank_zero_warn  # shared by both namespaces
from typing_extensions import override

from lightning_gradhooks import _trainer
from lightning_gradhooks._checks import check_callback_arguments
from lightning_gradhooks.log import (
    DEFAULT_HISTOGRAM_EVERY_N_STEPS, DEFAULT_STATISTICS, LOGGED_STATISTICS, GradientLog, LoggedStatistic,
)
from lightning_gradhooks._text import listed
from lightning_gradhooks.monitor import DEFAULT_BINS, GradientMonitor
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.records import GradientRecord
from lightning_gradhooks.sentinel import NonfiniteSentinel

if TYPE_CHECKING:
    import pytorch_lightning as pl


@dataclass
class _Batch:
    """The shell's per-batch state, in one place. ``on_train_batch_start`` opens a batch and
    ``_end_batch`` closes it; whether hooks are in the model is the monitor's ``armed``, whether
    offload hooks are set the engine's ``active``."""

    open: bool = False  # between on_train_batch_start and _end_batch
    step: int = 0  # the global step the armed record is logged at
    pieces_due: bool = False  # a logged step on which this rank reduces its sharded pieces only
    log_next: bool = False  # the sentinel caught a NaN: log the next batch in full


class GradHooksLogic:
    r"""Log per-module gradient statistics, histograms and a health report to TensorBoard.

    A thin shell over a :class:`~lightning_gradhooks.GradientMonitor` (collects on logged steps),
    a :class:`~lightning_gradhooks.log.GradientLog` (writes, keeps the report) and an optional
    :class:`~lightning_gradhooks.offload.save_on_disk` engine: it decides when and where, and
    what only Lightning knows (AMP scale, strategies, checkpoints). Steps that are not logged run
    as without it; every hook is removed after each logged step, at teardown and when fit
    raises. Tags and behaviour: README.md and docs/usage.md.

    Args:
        every_n_steps: log every this many optimizer steps (``trainer.global_step`` 0, n, 2n,
            ...); default: the trainer's ``log_every_n_steps``.
        include: glob patterns on qualified module names to monitor; None: every module that
            directly owns a trainable parameter. An empty list is refused.
        exclude: glob patterns of modules to leave out.
        statistics: the statistics charted per module, from ``norm``, ``mean``, ``std``,
            ``absmax``, ``nonfinite``, ``zero_fraction``, ``update_ratio`` and ``param_norm``;
            default ``["norm", "update_ratio"]``. Every statistic is still written in the
            compact summary the report and its command read.
        histograms: log histograms of module output gradients and parameter gradients.
        histogram_bins: bins of each histogram (1 to 4096).
        offload_threshold_bytes: offload saved activations of at least this many bytes to disk
            during training steps; None (default): no offload.
        offload_dir: an existing folder for the offload engine's unnamed files; None: the
            system temporary folder. Needs ``offload_threshold_bytes``.
        sync_dist: under data parallelism, pool the hook statistics of all ranks (one
            ``all_gather`` per logged step); default: rank 0's own. Sharded parameters always
            give the full gradient's statistics.
        report_thresholds: overrides of the health report's thresholds (fields of
            :class:`~lightning_gradhooks.report.Thresholds`, each range-checked).
        offload_budget_bytes: keep at most this many bytes of offloadable saved tensors in
            memory, the newest, and write the oldest to disk; None: write every one.
        catch_nonfinite: check every step's gradients before the optimizer step (one fused norm,
            one host read: :class:`~lightning_gradhooks.sentinel.NonfiniteSentinel`); on NaN/Inf
            skip the step, name it and its parameters in the report and log the next step in
            full. Off by default; not run under a gradient scaler, which skips such steps.
        offload_fix_mmap_threshold: with offload of CPU activations, fix glibc's mmap threshold
            so that offload lowers the peak (one INFO line says so); False leaves it alone.
        noise_scale: estimate the gradient noise scale (the critical batch size) on logged
            steps, chart it as ``∇1 overview/noise_scale`` and compare it with the batch per
            optimizer step at the end of fit (:mod:`lightning_gradhooks.noise`).
        histogram_every_n_steps: count and write the histograms on the first logged step of each
            window of this many optimizer steps (default 500: every 10th logged step at
            Lightning's default ``log_every_n_steps=50``); the scalars and the compact summary
            are written every logged step. 1: every logged step.

    Raises:
        ValueError: at construction, for an invalid argument (naming it, what is accepted and
            the value); at fit start, for an ``include`` pattern that matches no module.
        DiskOffloadError: at fit start, for an offload folder that cannot hold an unnamed file;
            during a step, when a write or read fails (full disk, I/O error).

    One class per Lightning namespace: ``lightning_gradhooks.GradHooks`` for
    ``pytorch_lightning``, ``lightning_gradhooks.lightning.GradHooks`` for ``lightning.pytorch``.

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
        histogram_every_n_steps: int = DEFAULT_HISTOGRAM_EVERY_N_STEPS,
    ) -> None:
        arguments = check_callback_arguments(locals(), DEFAULT_STATISTICS, LOGGED_STATISTICS)  # checked, converted
        for name, value in arguments.items():
            setattr(self, name, value)
        self._thresholds = _trainer.thresholds(self.report_thresholds)
        #: The :class:`~lightning_gradhooks.log.GradientLog` of the current (or last) fit: its
        #: ``report`` is the health report, kept after fit. None before the first fit.
        self.gradient_log: GradientLog | None = None
        #: The offload engine's counters (:class:`~lightning_gradhooks.offload.OffloadStats`)
        #: when the last fit ended; None without offload.
        self.offload_stats: Any = None
        # The fit's state (made in setup / on_fit_start, let go in _cleanup) ...
        self._monitor: GradientMonitor | None = None
        self._offload: save_on_disk | None = None
        self._sentinel: NonfiniteSentinel | None = None
        self._interval = 1
        self._pooled = False  # the hook statistics of every rank are pooled (sync_dist, several ranks)
        self._pieces = False  # every rank holds pieces of sharded parameters (FSDP, TP)
        self._unowned: list[Any] = []  # trainable parameters that no optimizer holds
        self._restored: dict[str, Any] | None = None  # the log's state from a checkpoint, for on_fit_start
        # ... and the batch's.
        self._batch = _Batch()

    @property
    def monitor(self) -> GradientMonitor | None:
        """The :class:`~lightning_gradhooks.GradientMonitor` of the fit under way (its ``plan``,
        ``pending``, ``armed``); None outside a fit."""
        return self._monitor

    @property
    def offload(self) -> save_on_disk | None:
        """The :class:`~lightning_gradhooks.offload.save_on_disk` engine of the fit under way (its
        ``stats()``); None without offload and outside a fit (``offload_stats`` keeps the last)."""
        return self._offload

    def _echo(self, trainer: pl.Trainer) -> Any:
        """How the report is printed: through the progress bar (above it, once), else Lightning's log."""
        bar = trainer.progress_bar_callback
        return bar.print if bar is not None and getattr(bar, "is_enabled", True) else _trainer.logger_of(self).info

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Distinct per configuration, so differently configured instances can share a Trainer.
        return self._generate_state_key(every_n_steps=self.every_n_steps, include=self.include, exclude=self.exclude,
                                        offload_threshold_bytes=self.offload_threshold_bytes, sync_dist=self.sync_dist)

    def state_dict(self) -> dict[str, Any]:
        # The logging schedule follows `trainer.global_step`, which Lightning restores; what is
        # ours is the log's: the health report, the flow picture's history, the NaN episode. A
        # resumed run reports on the whole run, as `python -m lightning_gradhooks report` does.
        return {"log": self.gradient_log.state_dict() if self.gradient_log is not None else self._restored}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after `setup` and, with most strategies, before
        # `on_fit_start`, where the log is made and takes it; an older checkpoint holds the episode.
        self._restored = state_dict.get("log", state_dict)
        if self.gradient_log is not None:
            self.gradient_log.load_state_dict(self._restored)

    # -- lifecycle -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cleanup()
        self.gradient_log, self._restored = None, None  # the log is made at fit start, when the optimizers exist
        self._monitor = GradientMonitor(pl_module, include=self.include, exclude=self.exclude, histograms=self.histograms,
                                        bins=self.histogram_bins, noise_scale=self.noise_scale,
                                        forward_checks=True)  # where NaN/Inf are born: the report names it
        self._interval = self.every_n_steps or trainer.log_every_n_steps or 1
        self._pooled = self.sync_dist and trainer.world_size > 1
        frozen = self._monitor.frozen
        if frozen and trainer.is_global_zero:
            _trainer.logger_of(self).info(
                f"GradHooks: {len(frozen)} frozen modules (no trainable parameter) are not monitored: {listed(frozen)}")
        if self.offload_threshold_bytes is not None:
            # Fails here, before the first step, when the folder cannot be written.
            self._offload = save_on_disk(self.offload_threshold_bytes, self.offload_dir, budget_bytes=self.offload_budget_bytes,
                                         fix_mmap_threshold=self.offload_fix_mmap_threshold)
            self._offload.keep_in_memory(pl_module)
        warning = _trainer.logger_warning(trainer)
        if warning is not None:
            rank_zero_warn(warning)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitor is None:
            return
        self._monitor.attach()
        # After `configure_model`: `fully_shard` and `parallelize_module` have made their DTensor
        # parameters. Their statistics need every rank's piece, with or without `sync_dist`.
        self._pieces = bool(self._monitor.sharded) and trainer.world_size > 1
        self.gradient_log = GradientLog(_trainer.writers(trainer), trainer.optimizers, statistics=self.statistics,
                                        histograms=self.histograms, thresholds=self._thresholds,
                                        histogram_every_n_steps=self.histogram_every_n_steps,
                                        sync_dist=self.sync_dist, echo=self._echo(trainer),
                                        precision=_trainer.gradient_dtype(trainer))
        if self._restored is not None:
            self.gradient_log.load_state_dict(self._restored)
        # A head left out of `configure_optimizers` gets gradients and never moves: its
        # gradients are collected with the first optimizer's, and the log says it is in none.
        self._unowned = _trainer.unowned(trainer, pl_module)
        self._sentinel = NonfiniteSentinel(pl_module.named_parameters()) if self.catch_nonfinite else None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cleanup()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self.gradient_log is not None:
                self.gradient_log.close()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        self._batch = _Batch()
        self._sentinel, self._unowned = None, []
        if self.gradient_log is not None and not self.gradient_log.closed:
            self.gradient_log.close()
        if self._monitor is not None:
            self._monitor.remove()
            self._monitor = None
        if self._offload is not None:
            self._leave_offload(exc_type=RuntimeError)
            self.offload_stats = self._offload.stats()  # what the engine did, kept after fit
            self._offload.close()
            self._offload = None

    def _leave_offload(self, exc_type: type[BaseException] | None = None) -> None:
        # Not active after an __enter__ that was interrupted: it left no hooks behind.
        if self._offload is not None and self._offload.active:
            self._offload.__exit__(exc_type, None, None)

    # -- steps -----------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        state, monitor = self._batch, self._monitor
        if state.open:  # the last batch ended without on_train_batch_end (see _end_batch)
            self._end_batch(trainer)
        logged = trainer.global_step % self._interval == 0 or state.log_next
        state.open, state.log_next = True, False
        state.pieces_due = (self._pooled or self._pieces) and logged
        # Without `sync_dist` only rank 0 logs, so the hooks of the other ranks stay idle.
        observed = trainer.is_global_zero or self._pooled
        if monitor is not None and observed and not monitor.armed and logged:
            state.step = trainer.global_step
            if self.gradient_log is not None:  # histograms are counted on their own cadence
                monitor.histograms = self.gradient_log.histograms_due(state.step)
            monitor.arm(batch_size=_trainer.batch_size(batch), accumulation=trainer.accumulate_grad_batches)
        elif monitor is not None and monitor.noise is not None and logged and not monitor.armed \
                and not monitor.noise.armed and trainer.world_size > 1:
            # A rank that logs nothing itself measures its local gradient for the noise scale.
            monitor.noise.arm(_trainer.batch_size(batch), trainer.accumulate_grad_batches)
        if self._offload is not None and not self._offload.active:
            self._offload.__enter__()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        monitor = self._monitor
        if monitor is not None and not monitor.armed and monitor.noise is not None and monitor.noise.armed:
            monitor.noise.collect(_trainer.optimizer_params(optimizer))  # its all_reduce
        armed = monitor is not None and monitor.armed
        if monitor is not None and (armed or self._batch.pieces_due):
            self._write_logged(trainer, pl_module, optimizer)
        if self._sentinel is not None and _trainer.loss_scale(trainer) is None:  # a scaler skips such steps itself
            self._check_finite(trainer, optimizer, recorded=armed)
        # steps that are not logged end here

    def _check_finite(self, trainer: pl.Trainer, optimizer: Any, recorded: bool) -> None:
        """The sentinel: a step with a non-finite gradient is skipped (its gradients dropped)
        and, unless its record says it already, written to the log."""
        params = _trainer.optimizer_params(optimizer)
        bad = self._sentinel.check(params)
        if bad is None:
            return
        for p in params:
            p.grad = None  # the optimizer skips parameters without a gradient
        self._batch.log_next = True
        if self.gradient_log is not None and not recorded:
            self.gradient_log.write_caught(trainer.global_step, bad, self._sentinel.last_checked)

    def _write_logged(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        monitor = self._monitor
        params = _trainer.optimizer_params(optimizer)
        if self._unowned and getattr(optimizer, "_optimizer", optimizer) is trainer.optimizers[0]:
            params += self._unowned
        if not monitor.armed:
            # A rank that logs nothing itself still holds pieces of the sharded parameters.
            if pl_module.automatic_optimization:
                self._batch.pieces_due = False
            self._write(trainer, monitor.collect_parameters(params), optimizer)
            return
        # One record per optimizer step: the hook statistics of every backward since the last
        # one (micro-batches, several manual_backward calls) pooled, and the gradients of the
        # parameters this optimizer is about to step.
        record = monitor.collect(params)
        if not pl_module.automatic_optimization:
            monitor.arm()  # later backward passes of this training step are logged too
            if monitor.noise is not None:
                monitor.noise.disarm()  # one noise sample a step: that of the first optimizer
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
        """End what ``on_train_batch_start`` began (offload hooks, armed monitor), idempotently:
        Lightning skips ``on_train_batch_end`` when ``on_train_batch_start`` returns -1.
        Statistics waiting for their optimizer step (accumulation) keep the monitor armed, unless
        the epoch is over: then a backward that no step followed is logged as it is."""
        self._batch.open = False
        monitor = self._monitor
        try:
            self._leave_offload()
            if epoch_over and monitor is not None and monitor.pending:
                # Ranks may differ here, so this is rank 0's own record, with no collective.
                self._write(trainer, monitor.collect(parameters=()), None, pool=False)
        finally:
            if monitor is not None and (epoch_over or not monitor.pending):
                monitor.disarm()
            if epoch_over and monitor is not None and monitor.noise is not None:
                monitor.noise.disarm()  # armed on its own (a rank that logs nothing), no step came

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer, epoch_over=True)  # fit may end without ending its epoch (max_steps)
        if self.gradient_log is not None:
            self.gradient_log.close()

    def _write(self, trainer: pl.Trainer, record: GradientRecord, optimizer: Any, pool: bool = True) -> None:
        # Under a gradient scaler the hooks saw gradients of the scaled loss; the scale has not
        # changed since that backward (it is updated after the optimizer step). Parameter
        # gradients are unscaled by then, unless the optimizer unscales in its own step: then
        # Lightning skips `scaler.unscale_` and they are divided here too.
        scale = _trainer.loss_scale(trainer)
        if scale is not None:
            record = record.unscaled(scale, parameters=optimizer is not None and _trainer.optimizer_unscales(optimizer))
        if self.gradient_log is not None:
            # Lightning runs this hook inside `optimizer.step(closure)`, after the step's
            # pre-hook: the log copies the weights now, and the post-hook measures the update.
            self.gradient_log.write(record, self._batch.step, optimizer=optimizer, stepping=optimizer is not None,
                                    scalars=None if scale is None else {"loss_scale": scale}, pool=pool)


class GradHooks(GradHooksLogic, pytorch_lightning.Callback):
    __doc__ = GradHooksLogic.__doc__
