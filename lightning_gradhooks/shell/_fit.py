"""What one fit of the ``GradHooks`` shell owns, with one owner: the monitor, the offload engine
and the sentinel, and the facts of the trainer the shell's decisions need. Made at ``setup``,
started at ``on_fit_start`` and removed once, whatever ended the fit. The log is not here: it is
the callback's own (``GradHooks.gradient_log``), kept after fit with the report.
"""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn  # shared by both namespaces

from lightning_gradhooks.shell import _trainer
from lightning_gradhooks.summary.text import listed
from lightning_gradhooks.log import GradientLog
from lightning_gradhooks.core.monitor import GradientMonitor
from lightning_gradhooks.offload import save_on_disk
from lightning_gradhooks.core.sentinel import NonfiniteSentinel
from lightning_gradhooks.shell._spikes import SpikeWatch
from lightning_gradhooks.log.updates import unwrapped


class Fit:
    """The resources of one fit, made from the callback's arguments (``hooks``)."""

    def __init__(self, hooks: Any, trainer: Any, pl_module: Any) -> None:
        self.monitor = GradientMonitor(pl_module, include=hooks.include, exclude=hooks.exclude, histograms=hooks.histograms,
                                       bins=hooks.histogram_bins, noise_scale=hooks.noise_scale,
                                       compile_statistics=hooks.compile_statistics, activations=hooks.activations,
                                       attention_logits=hooks.attention_logits,
                                       eager_logged_steps=hooks.eager_logged_steps,
                                       forward_checks=True)  # where NaN/Inf are born: the report names it
        #: Log every this many optimizer steps.
        self.interval = hooks.every_n_steps or trainer.log_every_n_steps or 1
        #: The hook statistics of every rank are pooled (sync_dist, several ranks).
        self.pooled = hooks.sync_dist and trainer.world_size > 1
        #: Every rank holds pieces of sharded parameters (FSDP, TP): known at fit start.
        self.pieces = False
        #: Trainable parameters that no optimizer holds: known at fit start.
        self.unowned: list[Any] = []
        self.sentinel: NonfiniteSentinel | None = None
        #: ``spikes=True``: every optimizer step's gradient norms and the spike rules (made at fit start).
        self.spikes: SpikeWatch | None = None
        frozen = self.monitor.frozen
        if frozen and trainer.is_global_zero:
            _trainer.logger_of(hooks).info(
                f"GradHooks: {len(frozen)} frozen modules (no trainable parameter) are not monitored: {listed(frozen)}")
        self.offload: save_on_disk | None = None
        if hooks.offload_threshold_bytes is not None:
            # Fails here, before the first step, when the folder cannot be written.
            self.offload = save_on_disk(hooks.offload_threshold_bytes, hooks.offload_dir,
                                        budget_bytes=hooks.offload_budget_bytes,
                                        fix_mmap_threshold=hooks.offload_fix_mmap_threshold)
            self.offload.keep_in_memory(pl_module)
        warning = _trainer.logger_warning(trainer)
        if warning is not None:
            rank_zero_warn(warning)

    def start(self, hooks: Any, trainer: Any, pl_module: Any, restored: dict[str, Any] | None,
              spikes: dict[str, Any] | None = None) -> GradientLog:
        """At fit start, after ``configure_model`` and ``configure_optimizers``: attach the monitor
        and make the fit's log (the callback's to keep), from a checkpoint's state if ``restored``."""
        self.monitor.attach()
        # `fully_shard` and `parallelize_module` have made their DTensor parameters: their
        # statistics need every rank's piece, with or without `sync_dist`.
        self.pieces = bool(self.monitor.sharded) and trainer.world_size > 1
        # A head left out of `configure_optimizers` gets gradients and never moves: its
        # gradients are collected with the first optimizer's, and the log says it is in none.
        self.unowned = _trainer.unowned(trainer, pl_module)
        self.sentinel = NonfiniteSentinel(pl_module.named_parameters()) if hooks.catch_nonfinite else None
        if hooks.spikes:  # the rules' windows from a checkpoint (`spikes`)
            self.spikes = SpikeWatch(pl_module.named_parameters(), hooks.thresholds)
            if spikes:
                self.spikes.load_state_dict(spikes)
        log = GradientLog(_trainer.writers(trainer), trainer.optimizers, statistics=hooks.statistics,
                          histograms=hooks.histograms, histogram_every_n_steps=hooks.histogram_every_n_steps,
                          thresholds=hooks.thresholds,
                          sync_dist=hooks.sync_dist, echo=_trainer.echo(trainer, hooks),
                          precision=_trainer.gradient_dtype(trainer))
        if restored is not None:
            log.load_state_dict(restored)
        return log

    def parameters_of(self, trainer: Any, optimizer: Any) -> list[Any]:
        """The parameters whose gradients are collected with ``optimizer``'s step: its own, and
        with the first optimizer those no optimizer holds."""
        params = _trainer.optimizer_params(optimizer)
        if self.unowned and unwrapped(optimizer) is trainer.optimizers[0]:
            params += self.unowned
        return params

    def skip_nonfinite(self, params: list[Any], norms: Any = None) -> list[str] | None:
        """The sentinel's check: None when every gradient of ``params`` is finite; else their
        gradients are dropped (the optimizer skips parameters without one) and the names of the
        non-finite ones returned. ``norms``: their norms, kept already (:class:`SpikeWatch`)."""
        bad = self.sentinel.check(params, norms)
        if bad is not None:
            for p in params:
                p.grad = None
        return bad

    def enter_offload(self) -> None:
        if self.offload is not None and not self.offload.active:
            self.offload.__enter__()

    def leave_offload(self, exc_type: type[BaseException] | None = None) -> None:
        # Not active after an __enter__ that was interrupted: it left no hooks behind.
        if self.offload is not None and self.offload.active:
            self.offload.__exit__(exc_type, None, None)

    def remove(self) -> Any:
        """Remove the monitor's hooks and close the offload engine; returns the engine's counters
        (None without offload)."""
        self.sentinel, self.unowned = None, []
        if self.spikes is not None:
            self.spikes.remove()
        self.monitor.remove()
        if self.offload is None:
            return None
        self.leave_offload(exc_type=RuntimeError)
        stats = self.offload.stats()  # what the engine did, kept after fit
        self.offload.close()
        self.offload = None
        return stats
