"""``GradientLog``: everything after :meth:`GradientMonitor.collect`, in any training loop.

A :class:`GradientLog` takes one :class:`~lightning_gradhooks.summary.records.GradientRecord` per logged
step and owns what follows from it: the histogram cadence (:meth:`GradientLog.arm`), the
warning that names where NaN/Inf were born and the health report. The rest are units it calls:
:class:`~lightning_gradhooks.log.distributed.RankPooling` pools a record over the ranks of a
distributed job, :class:`~lightning_gradhooks.log.updates.UpdateRatios` measures the optimizer
steps, :class:`~lightning_gradhooks.summary.noise.NoiseScale` smooths the noise scale,
:class:`~lightning_gradhooks.log.flow.GradientFlow` keeps the flow picture; and every step, a
record's, its update ratios or a caught one, goes out one way, through
:class:`~lightning_gradhooks.log.writers.Writers` to every writer and on to the report. It never
imports Lightning: the ``GradHooks`` callback is a thin shell that decides *when* and hands the
records to one of these.

Example:
    >>> import tempfile
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from lightning_gradhooks import GradientMonitor
    >>> folder = tempfile.TemporaryDirectory()
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> monitor = GradientMonitor(model)
    >>> log = GradientLog(SummaryWriter(folder.name), optimizers=[optimizer])
    >>> with monitor.attach():
    ...     for step in range(4):
    ...         with log.arm(monitor, step) if step % 2 == 0 else monitor.arm(when=False):
    ...             model(torch.randn(16, 4)).square().mean().backward()
    ...             log.write(monitor.collect(), step)   # before optimizer.step(): the update is measured
    ...         optimizer.step(); optimizer.zero_grad()
    >>> report = log.close()  # doctest: +ELLIPSIS
    GradHooks: ...
    >>> report.steps
    2
    >>> folder.cleanup()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_gradhooks.summary.checks import check_choices, check_instance, check_int, check_number
from lightning_gradhooks.log._tensorboard import FLOW_TAG, OVERVIEW, UPDATE_SECTIONS, scalar_metrics
from lightning_gradhooks.summary.text import listed
from lightning_gradhooks.log.distributed import RankPooling, rank
from lightning_gradhooks.log.flow import GradientFlow, have_matplotlib
from lightning_gradhooks.health import HealthReport, Thresholds, nonfinite_origin
from lightning_gradhooks.health.spikes import Spike, spike_summary
from lightning_gradhooks.summary.noise import NoiseScale
from lightning_gradhooks.summary.records import GradientRecord, Key, Kind, Summary, step_summary
from lightning_gradhooks.summary.statistics import STATISTICS, ChartedStatistic
from lightning_gradhooks.log.updates import UpdateRatios
from lightning_gradhooks.log.writers import Writers

if TYPE_CHECKING:
    from lightning_gradhooks.core.handles import ArmedStep
    from lightning_gradhooks.core.monitor import GradientMonitor

#: Statistics of the optimizer step, for parameters on logged steps: ‖Δw‖/‖w‖ and ‖w‖.
UPDATE_STATISTICS = tuple(UPDATE_SECTIONS)
LoggedStatistic = Literal[ChartedStatistic, "update_ratio", "param_norm"]
#: Every statistic a log can chart, in the order of the docs.
LOGGED_STATISTICS: tuple[str, ...] = (*STATISTICS, *UPDATE_STATISTICS)
#: What is charted by default: the per-module norms and the update ratios (with the overview and
#: the histograms and the forward pass, seven sections). Every statistic of every entry is written all the same, in one
#: compact summary per logged step that the health report and the report command read.
DEFAULT_STATISTICS: tuple[str, ...] = ("norm", "update_ratio")
#: Histograms are written on the first logged step of every window of this many steps. Logged
#: every 50 steps (Lightning's default), that is every 10th logged step: a 100k-step run writes
#: 200 histograms a tag, fewer than the 500 a tag TensorBoard keeps and shows (its
#: ``--samples_per_plugin`` default), and a histogram step costs about ten times the bytes of
#: the rest of a logged step (docs/benchmarks.md).
DEFAULT_HISTOGRAM_EVERY_N_STEPS = 500


class GradientLog:
    """Writes what a :class:`~lightning_gradhooks.GradientMonitor` collects and keeps the report.

    Call :meth:`write` once per optimizer step with the monitor's record (an empty record, from
    a step that was not armed, costs nothing), *before* ``optimizer.step()``: the step that
    follows is measured for the update ratios. :meth:`close` at the end prints the health report,
    writes it to TensorBoard's Text tab and returns it.

    In a distributed job every rank calls :meth:`write` at the same steps: the records are
    pooled over the ranks there (the hook statistics with ``sync_dist``, the pieces of sharded
    parameters always, see :class:`~lightning_gradhooks.log.distributed.RankReducer`), and only
    rank 0 writes, warns and reports.

    Args:
        writer: where the log goes: a ``torch.utils.tensorboard.SummaryWriter`` (scalars,
            histograms, the flow picture and the report), any object with
            ``log_metrics(metrics, step)`` (a ``WandbLogger`` gets the scalars, the histograms,
            as W&B histograms, and the report, as text; any other Lightning logger the overview
            and the norms, named without the ``∇<n> ``), a list of those,
            or None (nothing is written; the report is still kept).
        optimizers: the optimizers whose steps are measured for ``update_ratio`` and
            ``param_norm`` (through their own step hooks, removed by :meth:`close`).
        statistics: the statistics charted per module (from :data:`LOGGED_STATISTICS`);
            default: :data:`DEFAULT_STATISTICS`. The overview (total norm, non-finite count) is
            always charted, and the health report always reads every statistic.
        histograms: write the records' histograms (to TensorBoard and W&B writers).
        histogram_every_n_steps: write them on the first logged step of each window of this
            many steps (steps 0 to n-1, n to 2n-1, ...; :meth:`histograms_due`); the scalars
            and the compact summary are written every logged step. Default:
            :data:`DEFAULT_HISTOGRAM_EVERY_N_STEPS`; 1: every logged step.
        thresholds: when the health report raises a flag; default
            :class:`~lightning_gradhooks.health.Thresholds`.
        sync_dist: in a distributed job, pool the hook statistics of every rank into those of
            the global batch (one ``all_gather`` per logged step); default: rank 0's own.
        echo: how the report (and a note when matplotlib is missing) is printed: a function of
            one string; None: nothing is printed.
        precision: the dtype the hooks' gradients are computed in when not float32
            (``torch.bfloat16`` or ``torch.float16`` under autocast): what float round-off means
            for the report's notes of parameters that get no gradient by construction.

    Raises:
        ValueError: an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        writer: Any = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        statistics: Sequence[str] | None = None,
        histograms: bool = True,
        histogram_every_n_steps: int = DEFAULT_HISTOGRAM_EVERY_N_STEPS,
        thresholds: Thresholds | None = None,
        sync_dist: bool = False,
        echo: Callable[[str], Any] | None = print,
        precision: torch.dtype | None = None,
    ) -> None:
        statistics = list(DEFAULT_STATISTICS if statistics is None else
                          check_choices("statistics", statistics, LOGGED_STATISTICS))
        check_instance("thresholds", thresholds, (Thresholds, type(None)), "a Thresholds or None")
        self._writers = Writers(writer, statistics)
        self._updates = UpdateRatios(optimizers)
        self.optimizers = self._updates.optimizers  # Lightning/Fabric wrappers unwrapped
        self.statistics = statistics
        self.histograms = bool(histograms)
        self.histogram_every_n_steps = check_int("histogram_every_n_steps", histogram_every_n_steps)
        self._full_step: int | None = None  # a step armed in full (histograms off the cadence)
        self._histogram_step: int | None = None  # the last step whose histograms were written
        self._pooling = RankPooling(sync_dist)
        self.sync_dist = self._pooling.sync_dist
        self._echo = echo
        if precision is not None and (not isinstance(precision, torch.dtype) or not precision.is_floating_point):
            raise ValueError(f"`precision` expected a floating-point torch.dtype or None, got {precision!r}")
        self._eps = None if precision in (None, torch.float32) else torch.finfo(precision).eps
        #: The health report of the steps written so far (kept after :meth:`close`).
        self.report = HealthReport(thresholds)
        self.closed = False
        tensorboards = self._writers.tensorboards
        self._flow = GradientFlow() if tensorboards and have_matplotlib() else None
        if tensorboards and self._flow is None and rank() == 0 and echo is not None:
            echo("GradHooks: `pip install lightning-gradhooks[plots]` (matplotlib) to get the gradient-flow picture "
                 "in TensorBoard's Images tab.")
        self._nonfinite_seen: set[str] = set()
        #: Whether the last logged step had non-finite values (warned once per episode).
        self.in_nonfinite_episode = False
        self._told_skipped = False
        self._last_step = 0
        #: The gradient noise scale of the steps written so far, smoothed (:class:`NoiseScale`).
        self.noise_scale = NoiseScale()

    @property
    def collectives(self) -> int:
        """Collectives made to pool records over the ranks (for tests and the curious)."""
        return self._pooling.collectives

    # -- per step ------------------------------------------------------------------------------
    def histograms_due(self, step: int) -> bool:
        """Whether the histograms of a record logged at ``step`` are written: on the first logged
        step of each window of ``histogram_every_n_steps`` steps (and again at that same step, for
        another optimizer's record). :meth:`arm` arms a monitor to count them on those steps only."""
        return self.histograms and (self._on_cadence(step) or step == self._full_step)

    def _on_cadence(self, step: int) -> bool:
        last, n = self._histogram_step, self.histogram_every_n_steps
        return last is None or step == last or step // n != last // n

    def arm(self, monitor: GradientMonitor, step: int, *, batch_size: int | None = None,
            accumulation: int = 1, full: bool = False) -> ArmedStep:
        """Arm ``monitor`` (:meth:`GradientMonitor.arm`) for the step to be logged at ``step``,
        counting histograms only where this log writes them (:meth:`histograms_due`): the one
        place the histogram cadence reaches the monitor; ``full``: with histograms whatever the
        cadence (the step after a spike or a caught NaN), leaving the cadence as it was. Returns
        what ``monitor.arm`` returns."""
        if full:
            self._full_step = step
        return monitor.arm(batch_size=batch_size, accumulation=accumulation, histograms=self.histograms_due(step))

    def write(
        self,
        record: GradientRecord,
        step: int,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        stepping: bool = False,
        scalars: dict[str, float] | None = None,
        pool: bool = True,
    ) -> None:
        """Write one logged step's record and measure the optimizer step that follows.

        Args:
            record: from :meth:`GradientMonitor.collect`; that of a step that was not armed is
                empty and costs nothing (no collective either).
            step: the step it is logged at.
            optimizer: the optimizer about to step, one of ``optimizers``; with several, the
                record's names are prefixed with ``optimizer_<i>/``; default: all of them step.
            stepping: the optimizer's step has already begun (called from its closure): its
                weights are copied now for the update ratio.
            scalars: more scalars of this step (a loss scale, say), charted in the overview
                section (``∇1 overview/<name>``).
            pool: pool over the ranks (every rank must write at the same steps); False for a
                record that only this rank has.
        """
        histograms = self.histograms_due(step)
        if record.bins > 0 and histograms and self._on_cadence(step):  # on every rank: the same steps
            self._histogram_step = step
        if pool:
            record = self._pooling.pool(record)
        if self.closed:
            raise RuntimeError("GradientLog.write: the log is closed")
        if rank() != 0:
            return
        self._warn_skipped(record)
        index = self._updates.index(optimizer)
        # With several optimizers, the names of each are told apart by its index.
        labelled = index if index is not None and len(self.optimizers) > 1 else None
        if labelled is not None:
            record = record.for_optimizer(labelled)
        # The update ratios of earlier steps, first (it drops a snapshot not taken yet), so the
        # report judges each step with all its statistics.
        self._write_updates()
        if record.entries:
            self._last_step = step
            self._updates.expect(record, step, index, labelled, now=stepping)
            self._write_record(record, step, labelled, scalars or {}, histograms)

    def write_caught(self, step: int, names: Sequence[str], checked: int) -> None:
        """Write that :class:`~lightning_gradhooks.core.sentinel.NonfiniteSentinel` caught non-finite
        gradients at ``step`` (a step that need not be logged), before the optimizer step:
        ``names`` as it returned them (the one nearest the loss last), of ``checked``
        parameters with a gradient. The report and the
        ``report`` command name the step and where it was born; the warning says it once per
        episode."""
        if self.closed:
            raise RuntimeError("GradientLog.write_caught: the log is closed")
        if rank() != 0 or not names:
            return
        self._write_updates()
        self._send(step, {f"{OVERVIEW}/caught_nonfinite": float(len(names))},
                   step_summary(caught=names, checked=checked), warn=True)

    def write_step_norm(self, step: int, norm: float, spike: Spike | None = None, optimizer: int | None = None) -> None:
        """Chart the total gradient norm of optimizer step ``step`` (logged or not) in
        ``∇1 overview/step_norm`` (``step_norm_optimizer_<i>`` for ``optimizer`` i of several), and
        write ``spike`` (:class:`~lightning_gradhooks.health.spikes.SpikeRule`'s verdict on it) at
        its step: a ``spike`` row of the report, not a logged step."""
        if self.closed:
            raise RuntimeError("GradientLog.write_step_norm: the log is closed")
        if rank() != 0:
            return
        metrics = {f"{OVERVIEW}/step_norm" + ("" if optimizer is None else f"_optimizer_{optimizer}"): norm}
        if spike is None:
            self._writers.send(step, metrics, {})
        else:
            self._send(step, metrics, spike_summary(spike))

    def write_scaler(self, step: int, scale: float, new_scale: float) -> None:
        """Write what a gradient scaler did at logged step ``step``, once its ``update()`` ran.

        A scaler (``torch.amp.GradScaler``, FSDP2's ``ShardedGradScaler``) that finds non-finite
        gradients skips the optimizer step and lowers its scale, by design: the report counts
        such a logged step (a note at the end) instead of flagging its NaN/Inf, unless the
        skipping persists (see :class:`~lightning_gradhooks.health.scaler.ScalerSkips`). The
        ``GradHooks`` callback calls it itself; a plain loop or Fabric, after ``write``::

            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            log.write(monitor.collect().unscaled(scale), step, scalars={"loss_scale": scale})
            scaler.step(optimizer)
            scaler.update()
            log.write_scaler(step, scale, scaler.get_scale())

        Args:
            step: the logged step (that of :meth:`write`).
            scale: the scale the step's loss was multiplied by (``scaler.get_scale()`` before
                ``scaler.step``).
            new_scale: the scale after ``scaler.update()``: lower than ``scale`` when the scaler
                skipped the step. Charted as ``∇1 overview/scaler_skipped`` (1 or 0).

        Raises:
            ValueError: a scale that is not a finite number of at least 0.
        """
        scale, new_scale = check_number("scale", scale, 0.0), check_number("new_scale", new_scale, 0.0)
        if self.closed:
            raise RuntimeError("GradientLog.write_scaler: the log is closed")
        if rank() != 0:
            return
        self._write_updates()
        self._send(step, {f"{OVERVIEW}/scaler_skipped": float(new_scale < scale)},
                   step_summary(scaler=(scale, new_scale)))

    def _send(self, step: int, metrics: dict[str, float], stats: Summary, record: GradientRecord | None = None,
              histograms: bool = False, warn: bool = False) -> None:
        """The one way a step goes out: to every writer, then to the report (and, for a record
        or a caught step, the non-finite warning, named as the report names it)."""
        self._writers.send(step, metrics, stats, record, histograms)
        self.report.add_stats(step, stats)
        if warn:
            origin = nonfinite_origin(stats)
            if origin is not None and not self.in_nonfinite_episode:
                warnings.warn(f"GradHooks: non-finite values at step {step}: {origin[1]}.", stacklevel=4)
            self.in_nonfinite_episode = origin is not None

    def _write_record(self, record: GradientRecord, step: int, labelled: int | None, extra: dict[str, float],
                      histograms: bool) -> None:
        suffix = "" if labelled is None else f"_optimizer_{labelled}"
        metrics = scalar_metrics(record, self.statistics, self._nonfinite_seen, suffix)
        metrics.update({f"{OVERVIEW}/{name}": value for name, value in extra.items()})
        noise = ranks = None
        if record.noise is not None:  # smoothed in the overview; its raw estimates in the summary
            value = self.noise_scale.take(record.noise, step)
            if value is not None:
                metrics[f"{OVERVIEW}/noise_scale"] = value
            noise = record.noise.stats()
            if bad := record.noise.nonfinite_ranks:
                # which ranks' own gradients were not finite before the all-reduce (the noise probe's)
                ranks = {"nonfinite_ranks": float(len(bad)), "first_rank": float(bad[0]), "own": float(rank() in bad)}
        stats = step_summary(record, optimizer=labelled, unowned=self._updates.unowned(record), noise=noise, ranks=ranks)
        if self._eps is not None:  # round-off of the gradients the hooks saw
            stats[Key(Kind.PRECISION, "gradient")] = {"eps": self._eps}
        self._send(step, metrics, stats, record, histograms, warn=True)
        if self._flow is not None:
            self._flow.add(step, record)
            if self._flow.steps and self._flow.steps[-1] == step and self._flow.due():
                self._draw_flow()

    def _warn_skipped(self, record: GradientRecord) -> None:
        """Silence is a bug: say once which chosen parameters give no entry, and why."""
        if not record.skipped or self._told_skipped:
            return
        self._told_skipped = True
        reasons: dict[str, list[str]] = {}
        for name, reason in record.skipped.items():
            reasons.setdefault(reason, []).append(name)
        warnings.warn(
            f"GradHooks: {len(record.skipped)} chosen parameters give no param_grad entry: "
            + "; ".join(f"{listed(names)} ({reason})" for reason, names in reasons.items()),
            stacklevel=4,
        )

    def _write_updates(self) -> None:
        """Write the update ratios and parameter norms of the measured steps."""
        for step, optimizer, values in self._updates.ready():
            stats = step_summary(updates=values, optimizer=optimizer)
            metrics = {f"{UPDATE_SECTIONS[statistic]}/{key.label}": value[statistic]
                       for key, value in stats.items() for statistic in UPDATE_SECTIONS if statistic in self.statistics}
            self._send(step, metrics, stats)

    def _draw_flow(self, final: bool = False) -> None:
        """Write the flow picture of the latest logged step (at the end: if not drawn yet)."""
        flow = self._flow
        if flow is None or not flow.steps or (final and flow.drawn == flow.steps[-1]):
            return
        self._writers.image(FLOW_TAG, flow.image(), flow.steps[-1])

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on where this one stopped: the health report's state,
        the flow picture's history and whether a non-finite episode is under way (plain Python
        values, for a checkpoint). Writes the update ratios measured so far first."""
        if not self.closed:
            self._write_updates()
        return {
            "report": self.report.state_dict(),
            "flow": self._flow.state_dict() if self._flow is not None else None,
            "in_nonfinite_episode": self.in_nonfinite_episode,
            "noise_scale": self.noise_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` of an earlier log (of the run being resumed); a state of
        an older version (``{"in_nonfinite_episode": ...}`` alone) restores the episode only."""
        if state.get("report") is not None:
            self.report.load_state_dict(state["report"])
        if self._flow is not None and state.get("flow") is not None:
            self._flow.load_state_dict(state["flow"])
        self.in_nonfinite_episode = bool(state.get("in_nonfinite_episode", False))
        if state.get("noise_scale") is not None:
            self.noise_scale.load_state_dict(state["noise_scale"])

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> HealthReport | None:
        """Write what is still due (update ratios, the last flow picture), print the report,
        write it to the Text tab and remove the optimizer hooks. Returns the report on rank 0
        (None on other ranks). Idempotent; the writers stay open (they are the caller's)."""
        if self.closed:
            return self.report if rank() == 0 else None
        self.closed = True
        try:
            if rank() != 0:
                return None
            self._write_updates()
            self._draw_flow(final=True)
            if self._echo is not None:
                self._echo(self.report.table() if self.report.steps else
                           "GradHooks: no step was logged (the run ended before its first logged step), so there "
                           "is no gradient-health report.")
                sentence = self.noise_scale.sentence()  # the run's later noise scale next to the batch per step
                if sentence is not None:
                    self._echo(sentence)
            if self.report.steps:
                self._writers.report(self.report.table(), self.report.markdown(), self._last_step)
            return self.report
        finally:
            self._updates.remove()
