"""``GradHooks``: the Lightning callback that logs per-module gradient statistics to TensorBoard."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import pytorch_lightning
from lightning_utilities.core.rank_zero import rank_zero_warn  # shared by both namespaces
from pytorch_lightning.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_gradhooks._checks import (
    MAX_BINS,
    check_bool,
    check_choices,
    check_folder,
    check_int,
    check_patterns,
)
from lightning_gradhooks.log import DEFAULT_STATISTICS, LOGGED_STATISTICS, GradientLog, LoggedStatistic
from lightning_gradhooks.monitor import (
    DEFAULT_BINS,
    GradientMonitor,
    listed,
)
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.records import GradientRecord
from lightning_gradhooks.report import Thresholds
from lightning_gradhooks.sentinel import NonfiniteSentinel


if TYPE_CHECKING:
    import pytorch_lightning as pl


def _tensorboard_loggers(trainer: pl.Trainer) -> list[Any]:
    """The TensorBoardLoggers of the trainer, from whichever Lightning namespace is in use."""
    classes = tuple(
        sys.modules[f"{namespace}.loggers"].TensorBoardLogger
        for namespace in ("pytorch_lightning", "lightning.pytorch")
        if f"{namespace}.loggers" in sys.modules
    )
    return [lg for lg in trainer.loggers if isinstance(lg, classes)]


def _loss_scale(trainer: pl.Trainer) -> float | None:
    """The gradient scaler's current scale under ``precision="16-mixed"``, else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def _batch_size(batch: Any) -> int | None:
    """Examples in a batch, as Lightning counts them for logging; None when it cannot tell."""
    try:
        return extract_batch_size(batch)
    except Exception:  # MisconfigurationException: no tensor in the batch
        return None


def _thresholds(overrides: dict[str, float]) -> Thresholds:
    known = Thresholds.__dataclass_fields__
    if not isinstance(overrides, dict) or not set(overrides) <= set(known):
        raise ValueError(f"`report_thresholds` expected a dict with keys from {sorted(known)}, got {overrides!r}")
    return Thresholds(**overrides)  # range-checked there


class GradHooksLogic:
    r"""Log per-module gradient statistics, histograms and a health report to TensorBoard.

    A thin shell: a :class:`~lightning_gradhooks.GradientMonitor` collects on logged steps, a
    :class:`~lightning_gradhooks.log.GradientLog` writes and keeps the report, and an optional
    :class:`~lightning_gradhooks.offload.save_on_disk` engine offloads; this class decides when
    (logged steps, micro-batches, optimizers), where (the trainer's loggers) and what only
    Lightning knows (AMP scale, strategies, checkpoints). Steps that are not logged run exactly
    as without it. Every hook is removed after each logged step, at teardown and when fit raises,
    however Lightning ends a batch. Tags and behaviour: README.md and docs/usage.md.

    Args:
        every_n_steps: log every this many optimizer steps (at ``trainer.global_step`` 0, n,
            2n, ...); default: the trainer's ``log_every_n_steps``.
        include: glob patterns on qualified module names (``named_modules()`` of the
            LightningModule) to monitor; None: every module that directly owns a trainable
            parameter. An empty list is refused.
        exclude: glob patterns of modules to leave out.
        statistics: the statistics charted per module, from ``norm``, ``mean``, ``std``,
            ``absmax``, ``nonfinite``, ``zero_fraction``, ``update_ratio`` (‖Δw‖/‖w_before‖ of the
            optimizer step) and ``param_norm``; default: ``["norm", "update_ratio"]``. The
            overview is always charted, and every statistic is written in one compact summary
            per logged step, which the health report and its command read.
        histograms: log histograms of module output gradients and parameter gradients.
        histogram_bins: bins of each histogram (1 to 4096).
        offload_threshold_bytes: offload saved activations of at least this many bytes to disk
            during training steps; None (default): no offload.
        offload_dir: an existing folder for the offload engine's unnamed files; None: the
            system temporary folder. Needs ``offload_threshold_bytes``.
        sync_dist: under a data-parallel strategy, pool the hook statistics of all ranks (one
            ``all_gather`` per logged step); default: rank 0's own. Sharded parameters (FSDP2,
            tensor parallel) always give the full gradient's statistics.
        report_thresholds: overrides of the health report's thresholds (fields of
            :class:`~lightning_gradhooks.report.Thresholds`, each range-checked).
        offload_budget_bytes: with offload on, keep at most this many bytes of offloadable saved
            tensors in memory (plus one tensor), the newest, and write the oldest to disk
            (``save_on_disk(budget_bytes=...)``); None (default): every tensor of at least
            ``offload_threshold_bytes`` is written. Needs ``offload_threshold_bytes``.
        catch_nonfinite: on every optimizer step, logged or not, check that the gradients are
            finite (one fused norm and one host read per step,
            :class:`~lightning_gradhooks.sentinel.NonfiniteSentinel`); when they are not, skip
            the step (its gradients are dropped, so the weights stay finite), name the step and
            the parameters in the report, and log the next step in full. Off by default; under
            a gradient scaler (AMP fp16) the scaler already skips such steps, and it is not run.
        offload_fix_mmap_threshold: with offload of CPU activations, fix glibc's mmap threshold for
            the process so that offload lowers its peak memory (``save_on_disk(fix_mmap_threshold=...)``;
            said in one INFO line); False leaves the allocator alone.
        noise_scale: estimate the gradient noise scale (the critical batch size) on logged
            steps, chart it as ``∇1 overview/noise_scale`` and say at the end of fit how it
            compares with the batch per optimizer step (see :mod:`lightning_gradhooks.noise`).

    Raises:
        ValueError: at construction, for an invalid argument (naming it, what is accepted and
            the value); at fit start, for an ``include`` pattern that matches no module.
        DiskOffloadError: at fit start, for an offload folder that is missing or cannot hold an
            unnamed file; during a step, when a write or read fails (full disk, I/O error).

    ``GradHooks`` exists once per Lightning namespace: ``from lightning_gradhooks import
    GradHooks`` for ``pytorch_lightning``, ``from lightning_gradhooks.lightning import
    GradHooks`` for ``lightning.pytorch``.

    Example::

        from pytorch_lightning import Trainer
        from lightning_gradhooks import GradHooks

        trainer = Trainer(max_epochs=1, callbacks=[GradHooks(every_n_steps=10)])
        trainer.fit(model, train_loader)
        # tensorboard --logdir lightning_logs
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
    ) -> None:
        check_int("every_n_steps", every_n_steps, allow_none=True)
        check_int("offload_threshold_bytes", offload_threshold_bytes, allow_none=True)
        check_int("offload_budget_bytes", offload_budget_bytes, allow_none=True)
        offload_dir = check_folder("offload_dir", offload_dir)
        for name, value in (("offload_budget_bytes", offload_budget_bytes), ("offload_dir", offload_dir)):
            if value is not None and offload_threshold_bytes is None:
                raise ValueError(f"`{name}` expected `offload_threshold_bytes` to be set too, got {name}={value!r} "
                                 "with offload_threshold_bytes=None (offload off)")
        check_int("histogram_bins", histogram_bins, maximum=MAX_BINS)
        include = check_patterns("include", include, allow_empty=False)
        exclude = check_patterns("exclude", exclude)
        statistics = list(DEFAULT_STATISTICS) if statistics is None else check_choices(
            "statistics", statistics, list(LOGGED_STATISTICS))
        check_bool("histograms", histograms)
        check_bool("sync_dist", sync_dist)
        check_bool("catch_nonfinite", catch_nonfinite)
        check_bool("offload_fix_mmap_threshold", offload_fix_mmap_threshold)
        self.noise_scale = check_bool("noise_scale", noise_scale)
        self.every_n_steps = every_n_steps
        self.include = include
        self.exclude = exclude
        self.statistics = statistics
        self.histograms = histograms
        self.histogram_bins = histogram_bins
        self.offload_threshold_bytes = offload_threshold_bytes
        self.offload_dir = offload_dir
        self.offload_budget_bytes = offload_budget_bytes
        self.offload_fix_mmap_threshold = offload_fix_mmap_threshold
        self.sync_dist = sync_dist
        self.catch_nonfinite = catch_nonfinite
        self._sentinel: NonfiniteSentinel | None = None
        self._log_next = False  # the sentinel caught a NaN: log the next step in full
        self.report_thresholds = dict(report_thresholds or {})
        self._thresholds = _thresholds(self.report_thresholds)
        self._monitor: GradientMonitor | None = None
        #: The :class:`~lightning_gradhooks.log.GradientLog` of the current (or last) fit: its
        #: ``report`` is the health report, kept after fit. None before the first fit.
        self.gradient_log: GradientLog | None = None
        self._pooled = False  # the hook statistics of every rank are pooled (sync_dist, several ranks)
        self._pieces = False  # every rank holds pieces of sharded parameters (FSDP, TP)
        self._pieces_due = False  # a logged step on which this rank reduces its pieces only
        self._offload: save_on_disk | None = None
        #: The offload engine's counters (:class:`~lightning_gradhooks.offload.OffloadStats`)
        #: when the last fit ended; None without offload.
        self.offload_stats: Any = None
        self._interval = 1
        self._step = 0  # the global step the armed record will be logged at
        self._restored: dict[str, Any] | None = None  # the log's state from a checkpoint, for on_fit_start
        self._unowned: list[Any] = []  # trainable parameters that no optimizer holds
        self._in_batch = False  # between on_train_batch_start and _end_batch

    def _logger(self) -> logging.Logger:
        """A logger under the Lightning namespace of this class, which prints at INFO level."""
        lightning_pytorch = any(c.__module__.startswith("lightning.pytorch") for c in type(self).__mro__)
        return logging.getLogger(f"{'lightning.pytorch' if lightning_pytorch else 'pytorch_lightning'}.callbacks.gradhooks")

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
        return bar.print if bar is not None and getattr(bar, "is_enabled", True) else self._logger().info

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Distinct per configuration, so differently configured instances can share a Trainer.
        return self._generate_state_key(
            every_n_steps=self.every_n_steps,
            include=self.include,
            exclude=self.exclude,
            offload_threshold_bytes=self.offload_threshold_bytes,
            sync_dist=self.sync_dist,
        )

    def state_dict(self) -> dict[str, Any]:
        # The logging schedule follows `trainer.global_step`, which Lightning restores; what is
        # ours is the log's: the health report, the flow picture's history, the NaN episode. A
        # resumed run reports on the whole run, as `python -m lightning_gradhooks report` does.
        return {"log": self.gradient_log.state_dict() if self.gradient_log is not None else self._restored}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after `setup` and, with most strategies, before
        # `on_fit_start`, where the log is made and takes it; a checkpoint of an older version
        # holds only the episode.
        state = state_dict.get("log")
        if state is None and "in_nonfinite_episode" in state_dict:
            state = {"report": None, "in_nonfinite_episode": bool(state_dict["in_nonfinite_episode"])}
        self._restored = state
        if self.gradient_log is not None and state is not None:
            self._restore(self.gradient_log)

    def _restore(self, log: GradientLog) -> None:
        state = self._restored
        if state is None:
            return
        if state.get("report") is None:  # an older checkpoint: the episode only
            log.in_nonfinite_episode = bool(state.get("in_nonfinite_episode", False))
        else:
            log.load_state_dict(state)

    # -- lifecycle -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cleanup()
        self.gradient_log = None  # made at fit start, when the optimizers exist
        self._restored = None
        self._monitor = GradientMonitor(
            pl_module,
            include=self.include,
            exclude=self.exclude,
            histograms=self.histograms,
            bins=self.histogram_bins,
            forward_checks=True,  # where NaN/Inf are born: the report names it
            noise_scale=self.noise_scale,
        )
        self._interval = self.every_n_steps or trainer.log_every_n_steps or 1
        self._pooled = self.sync_dist and trainer.world_size > 1
        frozen = self._monitor.frozen
        if frozen and trainer.is_global_zero:
            self._logger().info(
                f"GradHooks: {len(frozen)} frozen modules (no trainable parameter) are not monitored: {listed(frozen)}"
            )
        if self.offload_threshold_bytes is not None:
            # Fails here, before the first step, when the folder cannot be written.
            self._offload = save_on_disk(self.offload_threshold_bytes, self.offload_dir,
                                         budget_bytes=self.offload_budget_bytes,
                                         fix_mmap_threshold=self.offload_fix_mmap_threshold)
            self._offload.keep_in_memory(pl_module)
        if trainer.fast_dev_run:
            pass  # Lightning has switched logging off: nothing to say
        elif not trainer.loggers:
            rank_zero_warn(
                "GradHooks found no logger (`Trainer(logger=False)`?): no statistics, histograms or gradient-flow "
                "picture are written; the health report is still printed at the end of fit."
            )
        elif not _tensorboard_loggers(trainer):
            wandb = any(type(lg).__name__ == "WandbLogger" for lg in trainer.loggers)
            rank_zero_warn(
                "GradHooks found no TensorBoardLogger in `trainer.loggers`: the gradient-flow picture is not drawn"
                + (" (W&B gets the scalars, histograms and the report)." if wandb else
                   ", histograms and the report's Text tab are not written, and the other loggers get the overview "
                   "and the norms only; add a TensorBoardLogger (or a WandbLogger) to get them.")
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitor is None:
            return
        self._monitor.attach()
        # After `configure_model`: `fully_shard` and `parallelize_module` have made their DTensor
        # parameters. Their statistics need every rank's piece, with or without `sync_dist`.
        self._pieces = bool(self._monitor.sharded) and trainer.world_size > 1
        writers: list[Any] = []
        if trainer.is_global_zero and not trainer.fast_dev_run:  # TensorBoard loggers get events; others, scalars
            tensorboards = _tensorboard_loggers(trainer)
            writers = [lg.experiment for lg in tensorboards] + [lg for lg in trainer.loggers if lg not in tensorboards]
        self.gradient_log = GradientLog(
            writers,
            trainer.optimizers,
            statistics=self.statistics,
            histograms=self.histograms,
            thresholds=self._thresholds,
            sync_dist=self.sync_dist,
            echo=self._echo(trainer),
        )
        self._restore(self.gradient_log)
        # A head left out of `configure_optimizers` gets gradients and never moves: its
        # gradients are collected with the first optimizer's, and the log says it is in none.
        held = {id(p) for o in trainer.optimizers for group in o.param_groups for p in group["params"]}
        self._unowned = [p for p in pl_module.parameters() if p.requires_grad and id(p) not in held]
        self._log_next = False
        self._sentinel = NonfiniteSentinel(pl_module.named_parameters()) if self.catch_nonfinite else None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cleanup()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            if self.gradient_log is not None:
                self.gradient_log.close()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        self._in_batch = False
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
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._in_batch:  # the last batch ended without on_train_batch_end (see _end_batch)
            self._end_batch(trainer)
        self._in_batch = True
        monitor = self._monitor
        logged = trainer.global_step % self._interval == 0 or self._log_next
        self._log_next = False
        # Without `sync_dist` only rank 0 logs, so the hooks of the other ranks stay idle.
        observed = trainer.is_global_zero or self._pooled
        self._pieces_due = (self._pooled or self._pieces) and logged
        if monitor is not None and observed and not monitor.armed and logged:
            self._step = trainer.global_step
            monitor.arm(batch_size=_batch_size(batch), accumulation=trainer.accumulate_grad_batches)
        elif monitor is not None and monitor.noise is not None and logged and not monitor.armed \
                and not monitor.noise.armed and trainer.world_size > 1:
            # A rank that logs nothing itself measures its local gradient for the noise scale.
            monitor.noise.arm(_batch_size(batch), trainer.accumulate_grad_batches)
        if self._offload is not None and not self._offload.active:
            self._offload.__enter__()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        monitor = self._monitor
        if monitor is not None and not monitor.armed and monitor.noise is not None and monitor.noise.armed:
            monitor.noise.collect([p for group in optimizer.param_groups for p in group["params"]])  # its all_reduce
        armed = monitor is not None and monitor.armed
        if monitor is not None and (armed or self._pieces_due):
            self._write_logged(trainer, pl_module, optimizer)
        if self._sentinel is not None:
            self._check_finite(trainer, optimizer, recorded=armed)
        # steps that are not logged end here

    def _check_finite(self, trainer: pl.Trainer, optimizer: Any, recorded: bool) -> None:
        """The sentinel: a step with a non-finite gradient is skipped (its gradients dropped)
        and, unless its record says it already, written to the log."""
        if _loss_scale(trainer) is not None:
            return  # the gradient scaler skips such steps itself
        params = [p for group in optimizer.param_groups for p in group["params"]]
        bad = self._sentinel.check(params)
        if bad is None:
            return
        for p in params:
            p.grad = None  # the optimizer skips parameters without a gradient
        self._log_next = True
        if self.gradient_log is not None and not recorded:
            self.gradient_log.write_caught(trainer.global_step, bad, self._sentinel.last_checked)

    def _write_logged(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        monitor = self._monitor
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self._unowned and getattr(optimizer, "_optimizer", optimizer) is trainer.optimizers[0]:
            params += self._unowned
        if not monitor.armed:
            # A rank that logs nothing itself still holds pieces of the sharded parameters.
            if pl_module.automatic_optimization:
                self._pieces_due = False
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
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_batch(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer, epoch_over=True)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_batch(trainer)

    def _end_batch(self, trainer: pl.Trainer, epoch_over: bool = False) -> None:
        """End what ``on_train_batch_start`` began (offload hooks, armed monitor),
        idempotently: Lightning skips ``on_train_batch_end`` when ``on_train_batch_start`` returns
        -1. Statistics waiting for their optimizer step (accumulation) keep the monitor armed,
        unless the epoch is over: then a backward that no step followed is logged as it is."""
        self._in_batch = False
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
        # gradients are already unscaled by the time `on_before_optimizer_step` runs.
        scale = _loss_scale(trainer)
        if scale is not None:
            record = record.unscaled(scale)
        if self.gradient_log is not None:
            # Lightning runs this hook inside `optimizer.step(closure)`, after the step's
            # pre-hook: the log copies the weights now, and the post-hook measures the update.
            self.gradient_log.write(record, self._step, optimizer=optimizer, stepping=optimizer is not None,
                            scalars=None if scale is None else {"loss_scale": scale}, pool=pool)


class GradHooks(GradHooksLogic, pytorch_lightning.Callback):
    __doc__ = GradHooksLogic.__doc__
