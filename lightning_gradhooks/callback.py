"""``GradHooks``: the Lightning callback that logs per-module gradient statistics to TensorBoard."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Literal

import pytorch_lightning
from lightning_utilities.core.rank_zero import rank_zero_warn  # shared by both namespaces
from typing_extensions import override

from lightning_gradhooks._tensorboard import scalar_metrics, write_step
from lightning_gradhooks.flow import GradientFlow, custom_scalars_layout, have_matplotlib
from lightning_gradhooks.distributed import RankReducer
from lightning_gradhooks.monitor import (
    DEFAULT_BINS,
    CollectorPause,
    GradientMonitor,
    GradientRecord,
    check_patterns,
    listed,
)
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.report import HealthReport, Thresholds, nonfinite_origin
from lightning_gradhooks.stats import STATISTICS, Statistic
from lightning_gradhooks.updates import UpdateTracker

#: Statistics of the optimizer step, for parameters on logged steps: ‖Δw‖/‖w_before‖ and ‖w‖.
UPDATE_STATISTICS = ("update_ratio", "param_norm")
LoggedStatistic = Literal[Statistic, "update_ratio", "param_norm"]


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


MAX_HISTOGRAM_BINS = 4096  # TensorBoard shows ~30 buckets; each bin costs bytes in every histogram event


def _thresholds(overrides: dict[str, float]) -> Thresholds:
    known = Thresholds.__dataclass_fields__
    if not isinstance(overrides, dict) or not set(overrides) <= set(known):
        raise ValueError(f"`report_thresholds` expected a dict with keys from {sorted(known)}, got {overrides!r}")
    return Thresholds(**overrides)  # range-checked there


def _check_positive_int(argument: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        accepted = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"`{argument}` expected {accepted}, got {value!r}")


class GradHooksLogic:
    r"""Log per-module gradient statistics and histograms to TensorBoard.

    At fit start the modules are chosen (see :class:`~lightning_gradhooks.GradientMonitor`). On
    logging steps only, forward hooks on them hook the autograd graph, and backward hands the
    hooks each module's ``grad_output`` and ``grad_input`` (what a full backward hook receives;
    ``grad_output`` only for modules that the first logged step shows to be modified in place,
    see docs/usage.md), which they reduce to statistics on the device; before the optimizer step
    the selected modules' parameter gradients are reduced too; the numbers reach the host once
    per logged step. Steps that are not logged run exactly as without the callback. Scalars go
    to every logger, histograms to every ``TensorBoardLogger``. Every hook is removed after
    each logged step, at teardown and when fit raises.

    With ``offload_threshold_bytes`` set, the forward (and backward) of every training step runs
    inside one :class:`~lightning_gradhooks.offload.save_on_disk` engine: tensors saved for
    backward of at least that many bytes go to disk and come back in backward. Validation,
    test and prediction are not offloaded. The engine's files have no name; they are closed
    (their space returned) when each step's graph is freed, at teardown and when fit raises.

    Tags (one TensorBoard section per statistic): ``grad_output_<stat>/<module>``,
    ``grad_input_<stat>/<module>``, ``param_grad_<stat>/<parameter>``,
    ``grad_output_hist/<module>`` and ``param_grad_hist/<parameter>``, where ``<stat>`` is one
    of ``norm``, ``mean``, ``std``, ``absmax``, ``nonfinite``. One record is logged per
    optimizer step: the gradients of a module called several times, or in several accumulated
    micro-batches, are pooled (``grad_output_calls/<module>`` counts them); with several
    optimizers, names start with ``optimizer_<i>/``.

    Args:
        every_n_steps: log every this many optimizer steps (at ``trainer.global_step`` 0, n,
            2n, ...); default: the trainer's ``log_every_n_steps``.
        include: glob patterns on qualified module names (``named_modules()`` of the
            LightningModule) to monitor; default: every module that directly owns a trainable
            parameter.
        exclude: glob patterns of modules to leave out.
        statistics: which statistics to log as scalars; default: all of
            ``["norm", "mean", "std", "absmax", "nonfinite", "zero_fraction", "update_ratio",
            "param_norm"]``. ``zero_fraction`` is the share of exactly-zero gradient elements;
            ``update_ratio`` (‖Δw‖/‖w_before‖ of the optimizer step, healthy near 1e-3) and
            ``param_norm`` are measured on logged steps through the optimizers' own step hooks
            (:class:`~lightning_gradhooks.updates.UpdateTracker`: one copy of the monitored
            parameters of the optimizer being stepped, held during its ``step()`` only) and
            logged as ``param_update_ratio/<parameter>`` and ``param_norm/<parameter>``.
        histograms: log histograms of module output gradients and parameter gradients.
        histogram_bins: number of bins of each histogram (1 to 4096).
        offload_threshold_bytes: offload saved activations of at least this many bytes to
            disk; ``None`` (default) turns offload off.
        offload_dir: an existing folder in which the offload engine opens files that never
            have a name; ``None``: the system temporary folder. Needs ``offload_threshold_bytes``.
        sync_dist: under a data-parallel strategy, pool the hook statistics of all ranks into
            those of the global batch (one ``all_gather`` per logged step, see
            :class:`~lightning_gradhooks.distributed.RankReducer`); default: rank 0 logs the
            statistics of its own shard and the other ranks' hooks do no work. Parameter
            gradients are the same on every rank either way; sharded ones (FSDP2, tensor
            parallel ``DTensor`` parameters) are always those of the full gradient, pooled from
            every rank's piece in one gather per logged step. Only rank 0 writes.
        report_thresholds: overrides of the health report's thresholds (field names of
            :class:`~lightning_gradhooks.report.Thresholds`). At the end of fit, and when fit
            raises, rank 0 prints the report (one row per flag per module, worst first, or one
            line saying nothing was seen) and writes it as Markdown to TensorBoard's Text tab
            under ``gradhooks/health_report``. Out-of-range thresholds raise ``ValueError``.

    Raises:
        ValueError: at construction, for an invalid argument; at fit start, for an ``include``
            pattern that matches no module (an ``exclude`` pattern that matches none is one
            warning: it excludes nothing).
        DiskOffloadError: at fit start, for an offload folder that is missing or cannot hold
            an unnamed file (naming the folder and the reason); during a step, when a write or
            read fails (full disk, I/O error), naming folder and bytes.

    ``GradHooks`` exists once per Lightning namespace, with this same behaviour:
    ``from lightning_gradhooks import GradHooks`` for ``pytorch_lightning``, and
    ``from lightning_gradhooks.lightning import GradHooks`` for ``lightning.pytorch``.

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
    ) -> None:
        _check_positive_int("every_n_steps", every_n_steps, allow_none=True)
        _check_positive_int("offload_threshold_bytes", offload_threshold_bytes, allow_none=True)
        if offload_dir is not None and not isinstance(offload_dir, str):
            raise ValueError(f"`offload_dir` expected a str or None, got {offload_dir!r}")
        if offload_dir is not None and (offload_dir == "" or "\0" in offload_dir):
            raise ValueError(f"`offload_dir` expected a non-empty path without NUL bytes, got {offload_dir!r}")
        if offload_dir is not None and offload_threshold_bytes is None:
            raise ValueError(
                f"`offload_dir` expected `offload_threshold_bytes` to be set too, got offload_dir={offload_dir!r} "
                "with offload_threshold_bytes=None (offload off)"
            )
        _check_positive_int("histogram_bins", histogram_bins)
        if histogram_bins > MAX_HISTOGRAM_BINS:
            raise ValueError(f"`histogram_bins` expected at most {MAX_HISTOGRAM_BINS}, got {histogram_bins}")
        check_patterns("include", include)
        check_patterns("exclude", exclude)
        if statistics is None:
            statistics = [*STATISTICS, *UPDATE_STATISTICS]
        if isinstance(statistics, str) or not all(s in (*STATISTICS, *UPDATE_STATISTICS) for s in statistics):
            raise ValueError(
                f"`statistics` expected a list drawn from {[*STATISTICS, *UPDATE_STATISTICS]}, got {statistics!r}"
            )
        for argument, value in (("histograms", histograms), ("sync_dist", sync_dist)):
            if not isinstance(value, bool):
                raise ValueError(f"`{argument}` expected a bool, got {value!r}")
        self.every_n_steps = every_n_steps
        self.include = None if include is None else list(include)
        self.exclude = None if exclude is None else list(exclude)
        self.statistics = list(statistics)
        self.histograms = histograms
        self.histogram_bins = histogram_bins
        self.offload_threshold_bytes = offload_threshold_bytes
        self.offload_dir = offload_dir
        self.sync_dist = sync_dist
        self.report_thresholds = dict(report_thresholds or {})
        self._thresholds = _thresholds(self.report_thresholds)
        self._report: HealthReport | None = None
        self._updates: UpdateTracker | None = None
        self._flow: GradientFlow | None = None
        self._layouts: set[int] = set()  # writers that hold the custom-scalars layout
        self._nonfinite_seen: set[str] = set()
        self._reducer: RankReducer | None = None
        self._sharded: list[str] = []  # parameters each rank holds a piece of (FSDP, TP)
        self._pieces_due = False  # a logged step on which this rank reduces its pieces only
        self._told_skipped = False
        self._monitor: GradientMonitor | None = None
        self._offload: save_on_disk | None = None
        #: The offload engine's counters (:class:`~lightning_gradhooks.offload.OffloadStats`)
        #: when the last fit ended; None without offload.
        self.offload_stats: Any = None
        self._offload_active = False
        self._interval = 1
        self._step = 0  # the global step the armed record will be logged at
        self._in_nonfinite_episode = False
        self._collector = CollectorPause()  # for the rest of a logged batch, see _pause_gc

    def _logger(self) -> logging.Logger:
        """A logger under the Lightning namespace of this class, which prints at INFO level."""
        lightning_pytorch = any(c.__module__.startswith("lightning.pytorch") for c in type(self).__mro__)
        return logging.getLogger(f"{'lightning.pytorch' if lightning_pytorch else 'pytorch_lightning'}.callbacks.gradhooks")

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
        # ours is whether the last logged step already warned about non-finite gradients.
        return {"in_nonfinite_episode": self._in_nonfinite_episode}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after `setup`, so this survives `_cleanup`.
        self._in_nonfinite_episode = bool(state_dict.get("in_nonfinite_episode", False))

    # -- lifecycle -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cleanup()
        self._in_nonfinite_episode = False
        self._told_skipped = False
        self._report = HealthReport(self._thresholds)
        self._nonfinite_seen = set()
        self._flow = GradientFlow() if have_matplotlib() and _tensorboard_loggers(trainer) else None
        if self._flow is None and _tensorboard_loggers(trainer) and trainer.is_global_zero:
            self._logger().info(
                "GradHooks: `pip install lightning-gradhooks[plots]` (matplotlib) to get the gradient-flow "
                "picture in TensorBoard's Images tab."
            )
        self._monitor = GradientMonitor(
            pl_module,
            include=self.include,
            exclude=self.exclude,
            histograms=self.histograms,
            bins=self.histogram_bins,
            forward_checks="nonfinite" in self.statistics,  # where NaN/Inf are born
        )
        self._interval = self.every_n_steps or trainer.log_every_n_steps or 1
        if self.sync_dist and trainer.world_size > 1:
            self._reducer = RankReducer(self.histogram_bins, trainer.strategy.root_device)
        frozen = self._monitor.frozen
        if frozen and trainer.is_global_zero:
            self._logger().info(
                f"GradHooks: {len(frozen)} frozen modules (no trainable parameter) are not monitored: {listed(frozen)}"
            )
        if self.offload_threshold_bytes is not None:
            # Fails here, before the first step, when the folder cannot be written.
            self._offload = save_on_disk(self.offload_threshold_bytes, self.offload_dir)
            self._offload.keep_in_memory(pl_module)
        if not trainer.loggers:
            rank_zero_warn("GradHooks found no logger (`Trainer(logger=False)`?): nothing will be logged.")
        elif not _tensorboard_loggers(trainer):
            rank_zero_warn(
                "GradHooks found no TensorBoardLogger in `trainer.loggers`: scalars go to the "
                "other loggers and histograms are not written."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitor is not None:
            self._monitor.attach()
            # After `configure_model`: `fully_shard` and `parallelize_module` have made their
            # DTensor parameters. Their statistics need every rank's piece, with or without
            # `sync_dist`, in the one gather of the logged step.
            self._sharded = self._monitor.sharded
            if trainer.is_global_zero and any(s in self.statistics for s in UPDATE_STATISTICS):
                # Sharded parameters are left out: a local piece's norm is not the parameter's.
                watched = {n: p for n, p in self._monitor.parameters.items() if n not in self._sharded}
                self._updates = UpdateTracker(watched)
                for optimizer in trainer.optimizers:
                    self._updates.attach(getattr(optimizer, "_optimizer", optimizer))
            if self._sharded and trainer.world_size > 1 and self._reducer is None:
                self._reducer = RankReducer(self.histogram_bins, trainer.strategy.root_device, hooks=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cleanup()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._draw_flow(trainer, final=True)
            self._print_report(trainer)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        self._collector.resume()
        self._reducer = None
        if self._updates is not None:
            self._updates.remove()
            self._updates = None
        if self._monitor is not None:
            self._monitor.remove()
            self._monitor = None
        if self._offload is not None:
            self._leave_offload(exc_type=RuntimeError)
            self.offload_stats = self._offload.stats()  # what the engine did, kept after fit
            self._offload.close()
            self._offload = None

    def _leave_offload(self, exc_type: type[BaseException] | None = None) -> None:
        if self._offload_active:
            self._offload_active = False
            if self._offload.active:  # __enter__ may have been interrupted before its hooks were on
                self._offload.__exit__(exc_type, None, None)

    # -- steps -----------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        monitor = self._monitor
        # Without `sync_dist` only rank 0 logs, so the hooks of the other ranks stay idle.
        observed = trainer.is_global_zero or (self._reducer is not None and self._reducer.hooks)
        self._pieces_due = self._reducer is not None and trainer.global_step % self._interval == 0
        if monitor is not None and observed and not monitor.armed and trainer.global_step % self._interval == 0:
            self._step = trainer.global_step
            self._pause_gc()
            monitor.arm()
        elif monitor is not None and monitor.armed:  # a later micro-batch of a logged step
            self._pause_gc()
        if self._offload is not None and not self._offload_active:
            self._offload_active = True  # first: an interrupt inside __enter__ still gets an exit
            self._offload.__enter__()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        monitor = self._monitor
        if monitor is None or not (monitor.armed or self._pieces_due):
            return  # steps that are not logged end here
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not monitor.armed:
            # A rank that logs nothing itself still holds pieces of the sharded parameters.
            if pl_module.automatic_optimization:
                self._pieces_due = False
            self._write(trainer, monitor.collect_parameters(params))
            return
        # One record per optimizer step: the hook statistics of every backward since the last
        # one (micro-batches, several manual_backward calls) pooled, and the gradients of the
        # parameters this optimizer is about to step.
        record = monitor.collect(params)
        prefix = ""
        if len(trainer.optimizers) > 1:
            index = next(i for i, o in enumerate(trainer.optimizers) if o is getattr(optimizer, "_optimizer", optimizer))
            record = record.prefixed(f"optimizer_{index}")
            prefix = f"optimizer_{index}/"
        if self._updates is not None:
            # Lightning runs this hook inside `optimizer.step(closure)`, after the step pre-hook:
            # the weights are copied now, the post-hook measures the update.
            self._updates.expect(getattr(optimizer, "_optimizer", optimizer), self._step, prefix, now=True)
        if not pl_module.automatic_optimization:
            monitor.arm()  # later backward passes of this training step are logged too
        self._write(trainer, record)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._leave_offload()
        self._write_updates(trainer, wait=False)
        # Hook statistics waiting for an optimizer step (accumulation) keep the monitor armed.
        if self._monitor is not None and not self._monitor.pending:
            self._monitor.disarm()
        self._collector.resume()

    def _pause_gc(self) -> None:
        """Switch Python's cyclic garbage collector off for the rest of a logged batch.

        The monitor pauses it from ``arm`` to ``collect`` (see :meth:`GradientMonitor.arm`); a
        logged step then makes a record, TensorBoard values and report rows for every tensor,
        alive long enough to be promoted to the oldest generation, which sets off full
        collections of the whole process (~250 ms each with Lightning imported; on 500 modules
        one every few logged steps). Paused here, first, the monitor leaves the collector alone,
        and it is switched back on at the end of the batch, at teardown and when fit raises.
        A collector the user switched off stays off.
        """
        self._collector.pause()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A backward that no optimizer step followed (the end of an epoch cut short) is logged.
        if self._monitor is not None and self._monitor.pending:
            # Ranks may differ here, so this is rank 0's own record, with no collective.
            self._write(trainer, self._monitor.collect(parameters=()), reduce=False)
        self._write_updates(trainer, wait=True)
        self._draw_flow(trainer, final=True)
        self._print_report(trainer)

    def _write_updates(self, trainer: pl.Trainer, wait: bool) -> None:
        """Log the update ratios and parameter norms of the measured steps that reached the host."""
        if self._updates is None:
            return
        tensorboards = _tensorboard_loggers(trainer)
        for step, values in self._updates.ready(wait):
            metrics = {}
            for name, (ratio, norm) in values.items():
                if "update_ratio" in self.statistics:
                    metrics[f"param_update_ratio/{name}"] = ratio
                if "param_norm" in self.statistics:
                    metrics[f"param_norm/{name}"] = norm
            for logger in trainer.loggers:
                if logger not in tensorboards:
                    logger.log_metrics(metrics, step=step)
            for logger in tensorboards:
                write_step(logger.experiment, metrics, None, step)
            if self._report is not None:
                stats = {("param", n): {k: v for k, v in (("update_ratio", r), ("param_norm", w)) if k in self.statistics}
                         for n, (r, w) in values.items()}
                self._report.add_stats(step, stats, new_step=False)

    def _draw_flow(self, trainer: pl.Trainer, final: bool = False) -> None:
        """Write the gradient-flow picture of the latest logged step (at the end: if not yet drawn)."""
        if self._flow is None or not trainer.is_global_zero or not self._flow.steps:
            return
        if final and self._flow.drawn == self._flow.steps[-1]:
            return
        image = self._flow.image()
        for logger in _tensorboard_loggers(trainer):
            logger.experiment.add_image("gradient_flow", image, self._flow.steps[-1], dataformats="HWC")

    def _print_report(self, trainer: pl.Trainer) -> None:
        """Rank 0 prints the health report and writes it to TensorBoard's Text tab, once per fit."""
        report, self._report = self._report, None
        if report is None or not trainer.is_global_zero or not report.steps:
            return
        self._logger().info(report.table())
        for logger in _tensorboard_loggers(trainer):
            logger.experiment.add_text("gradhooks/health_report", report.markdown(), self._step)
            logger.experiment.flush()

    def _write(self, trainer: pl.Trainer, record: GradientRecord, reduce: bool = True) -> None:
        # Under a gradient scaler the hooks saw gradients of the scaled loss; the scale has not
        # changed since that backward (it is updated after the optimizer step). Parameter
        # gradients are already unscaled by the time `on_before_optimizer_step` runs.
        scale = _loss_scale(trainer)
        if scale is not None:
            record = record.unscaled(scale)
        if reduce and self._reducer is not None:
            record = self._reducer.reduce(record, self._sharded)  # every rank, even with an empty record
        skipped = self._monitor.skipped if self._monitor is not None else {}
        if skipped and not self._told_skipped and trainer.is_global_zero:
            self._told_skipped = True  # silence is a bug: say once what gives no entry, and why
            reasons: dict[str, list[str]] = {}
            for name, reason in skipped.items():
                reasons.setdefault(reason, []).append(name)
            rank_zero_warn(
                f"GradHooks: {len(skipped)} chosen parameters give no param_grad entry: "
                + "; ".join(f"{listed(names)} ({reason})" for reason, names in reasons.items())
            )
        if record.entries and trainer.is_global_zero:
            self._log(trainer, record, {} if scale is None else {"loss_scale": scale})

    def _log(self, trainer: pl.Trainer, record: GradientRecord, extra: dict[str, float]) -> None:
        metrics = {**scalar_metrics(record, self.statistics, self._nonfinite_seen), **extra}
        tensorboards = _tensorboard_loggers(trainer)
        for logger in trainer.loggers:
            if logger not in tensorboards:
                logger.log_metrics(metrics, step=self._step)
        for logger in tensorboards:
            write_step(logger.experiment, metrics, record, self._step)  # histograms only if collected
            if id(logger.experiment) not in self._layouts:  # once per run
                self._layouts.add(id(logger.experiment))
                logger.experiment.add_custom_scalars(custom_scalars_layout(self.statistics))
        if self._flow is not None:
            self._flow.add(self._step, record)
            if self._flow.steps and self._flow.steps[-1] == self._step and self._flow.due():
                self._draw_flow(trainer)
        if self._report is not None:
            self._report.add(self._step, record, self.statistics)
        origin = nonfinite_origin([(e.kind, e.name, e.stats) for e in record.entries])
        if origin is not None and not self._in_nonfinite_episode:
            rank_zero_warn(f"GradHooks: non-finite values at step {self._step}: {origin[1]}.")
        self._in_nonfinite_episode = origin is not None


class GradHooks(GradHooksLogic, pytorch_lightning.Callback):
    __doc__ = GradHooksLogic.__doc__
