"""``GradientMonitor``: per-module gradient statistics of the backward pass, in plain PyTorch.

The monitor chooses modules and gives back one handle that removes everything it registers.
Between logged steps nothing of it is in the modules. When it is *armed*, its parts read the step:
the watched modules' hooks (:mod:`lightning_gradhooks.core.module_hooks`: ``grad_output`` and
``grad_input``, what a full backward hook receives, and the outputs), the plug-ins that put hooks
of their own in for the armed step and reset when it ends (the forward checks, the attention
logits: :class:`Plugin`), and the noise probe. Everything is reduced on the device into the
step's buffer (:mod:`lightning_gradhooks.core.step_buffer`); :meth:`GradientMonitor.collect` adds
the parameter gradients (:mod:`lightning_gradhooks.core.parameter_reader`) and brings everything
to the host in one transfer per device, as a
:class:`~lightning_gradhooks.summary.records.GradientRecord`. Which modules are watched and how
each is read is planned in :mod:`lightning_gradhooks.core.planning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from torch import Tensor, nn

from lightning_gradhooks.core.attention import AttentionCapture
from lightning_gradhooks.core.forward_checks import ForwardChecks
from lightning_gradhooks.core.handles import ArmedStep, CollectorPause, Hook, MonitorHandle
from lightning_gradhooks.core.module_hooks import ArmedState, ModuleHooks
from lightning_gradhooks.core.noise import NoiseProbe, gradient_squares
from lightning_gradhooks.core.parameter_reader import ParameterReader
from lightning_gradhooks.core.planning import (
    Plan, Planner, Read, _named_modules, select_modules,
)
from lightning_gradhooks.core.compiled import CompiledCode
from lightning_gradhooks.core.stats import Scratch
from lightning_gradhooks.core.step_buffer import StepBuffer
from lightning_gradhooks.summary.checks import MAX_BINS, check_bool, check_int
from lightning_gradhooks.summary.records import GradientEntry, GradientRecord, Histogram
from lightning_gradhooks.summary.text import listed

__all__ = [
    "ArmedStep", "GradientEntry", "GradientMonitor", "GradientRecord", "Histogram", "MonitorHandle", "Plan", "Plugin",
    "Read", "select_modules",
]

#: Label used for the root module, whose qualified name is the empty string.
ROOT_NAME = "(model)"
DEFAULT_BINS = 64


def _label(name: str) -> str:
    return name or ROOT_NAME


class Plugin(Protocol):
    """A part of the monitor that reads armed steps with module hooks of its own: the monitor puts
    its ``hooks`` in with every armed step, parks them with its own, and calls ``reset()`` when the
    step is over (collected, disarmed or dropped). What it measures it reduces into the step's
    buffer (the ``reduce`` it was made with), so it reaches the record with everything else."""

    hooks: Sequence[Hook]

    def reset(self) -> None: ...


def _frozen(model: nn.Module, chosen: Mapping[str, nn.Module]) -> list[str]:
    """Modules left out because they own parameters and none of them requires grad."""
    return [
        _label(name)
        for name, module in _named_modules(model).items()
        if name not in chosen
        and list(module.parameters(recurse=False))
        and not any(p.requires_grad for p in module.parameters(recurse=False))
    ]


def _forward_plugins(model: nn.Module, hooked: Mapping[str, nn.Module], compiled: set[int],
                     reduce: Callable[..., None], armed: Callable[[], bool], forward_checks: bool,
                     attention_logits: bool) -> list[Plugin]:
    """The plug-ins that read the forward pass on armed steps."""
    plugins: list[Plugin] = []
    labels = {_label(name): module for name, module in _named_modules(model).items()}
    if forward_checks:
        # Every other module (parameterless ones too) gets a forward hook on armed steps that
        # checks its inputs and outputs only: a NaN is named where it is made.
        unmonitored = {label: m for label, m in labels.items() if label not in hooked and id(m) not in compiled}
        plugins.append(ForwardChecks(model, unmonitored, reduce, armed, ROOT_NAME))
    if attention_logits:
        # No attention capture around hidden code: its mode active there would make Dynamo recompile it.
        around = {id(m) for m in labels.values() if any(id(sub) in compiled for sub in m.modules())}
        plugins.append(AttentionCapture({label: m for label, m in labels.items() if id(m) not in around}, reduce, armed))
    return plugins


def _say_hidden(code: CompiledCode, modules: Mapping[str, nn.Module]) -> None:
    """Say once what of the model cannot be seen on logged steps, by name, and what is measured instead."""
    for note in code.notes:
        warnings.warn(f"torch.compile: {note}", stacklevel=4)
    for reason, labels in code.hidden_by_reason(modules).items():
        warnings.warn(f"{len(labels)} modules report parameter gradients only (no grad_output, grad_input, "
                      f"outputs, attention logits or noise probe), {reason}: {listed(labels)}", stacklevel=4)


class GradientMonitor:
    """Collects per-module gradient statistics: each module's ``grad_output`` and ``grad_input``
    (what a full backward hook receives) and its parameters' gradients.

    Works in any PyTorch loop; it never imports Lightning. Attach once, arm it for the steps you
    want to see, and :meth:`collect` after backward (before ``optimizer.zero_grad``).

    Args:
        model: the module whose submodules are monitored.
        include: a list (or tuple) of glob patterns on qualified module names; None (default):
            every module that directly owns a parameter requiring grad. An empty list is refused.
        exclude: a list (or tuple) of glob patterns of modules to leave out.
        histograms: also count histograms of ``grad_output`` and parameter gradients.
        bins: number of histogram bins, 1 to 4096.
        parameters: also reduce each selected module's own parameter gradients in
            :meth:`collect`.
        forward_checks: on armed steps, also sum the floating inputs and outputs of every
            module in forward (one op per tensor; parameterless and unchosen modules included)
            into entries of kind ``"forward_input"`` and ``"forward"``, in forward order before
            the gradients (with ``activations``, a watched module's outputs are not summed again:
            their ``"output"`` rows count their NaN/Inf, and give a ``"forward"`` entry where they
            hold any), and check the weights once (one ``"weights"`` entry counting the
            parameters that hold NaN/Inf when the step begins), so that the report names where
            NaN or Inf were born (:func:`lightning_gradhooks.health.nonfinite_origin`).
        noise_scale: also estimate the gradient noise scale on armed steps (keyword only).
        activations: on armed steps, also reduce each watched module's floating outputs as its
            forward returns them, into entries of kind ``"output"`` (RMS, absmax, mean, the share
            of zeros, absmax over RMS; on the device, batched with the gradients: two aten ops
            per output; an output that a later in-place op changes is read from a copy; keyword
            only; default on).
        attention_logits: on armed steps, also measure the maximum attention logit of every
            ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` call, for the
            innermost module running the call (kind ``"attention_logit"``; one more ``q·kᵀ`` per
            call, in chunks of queries; see :mod:`lightning_gradhooks.core.attention`; keyword only; on
            by default).
        compile_statistics: reduce gradients with kernels compiled once per process by
            ``torch.compile`` (C++ on the CPU, Triton on GPUs; keyword only), where a compiler is
            there; False: eager ops that give the same numbers (slower; no compile at the first logged
            step). Where compiling is unavailable the eager ops run anyway, said once at INFO; on a
            model with compiled code too, so that Dynamo compiles no graph of ours beside yours.
        eager_logged_steps: run armed steps of a model with compiled code eagerly, from :meth:`arm`
            to :meth:`collect` or :meth:`disarm` (``torch.compiler.set_stance("force_eager")``, the
            stance before restored, also when the step raises; keyword only): every module is seen,
            and steps that are not armed run the compiled code untouched. False: armed steps run
            compiled too, and modules in compiled code report parameter gradients only
            (:mod:`lightning_gradhooks.core.compiled`).
    Raises:
        ValueError: an invalid argument (naming it, what is accepted and the value received),
            or an ``include`` pattern that matches no module.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> monitor = GradientMonitor(model)
        >>> with monitor.attach():
        ...     for step in range(2):
        ...         with monitor.arm():  # hooks in for this step only
        ...             model(torch.randn(16, 4)).sum().backward()
        ...             record = monitor.collect()
        >>> [f"{e.kind} {e.name}" for e in record.entries][:4]
        ['output 0', 'output 2', 'grad_output 2', 'grad_input 2']
    """

    def __init__(
        self,
        model: nn.Module,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        histograms: bool = True,
        bins: int = DEFAULT_BINS,
        parameters: bool = True,
        forward_checks: bool = False,
        *,
        noise_scale: bool = True,
        compile_statistics: bool = True,
        activations: bool = True,
        attention_logits: bool = True,
        eager_logged_steps: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"`model` expected a torch.nn.Module, got {type(model).__name__}")
        check_int("bins", bins, maximum=MAX_BINS)
        for argument, value in (("histograms", histograms), ("parameters", parameters), ("forward_checks", forward_checks),
                                ("noise_scale", noise_scale), ("compile_statistics", compile_statistics),
                                ("activations", activations), ("attention_logits", attention_logits),
                                ("eager_logged_steps", eager_logged_steps)):
            check_bool(argument, value)
        self.modules = select_modules(model, include, exclude)
        #: Modules left out because they own parameters and none of them requires grad.
        self.frozen = _frozen(model, self.modules)
        # Armed steps of a compiled model run eagerly (core.compiled); what cannot be seen gets no hook.
        self._code = CompiledCode(model, eager_logged_steps)
        hidden = self._code.hidden
        self._planner = Planner({_label(name): module for name, module in self.modules.items()}, hidden)
        self._hooked = self._planner.hooked
        self._hooked_ids = frozenset(id(module) for module in self._hooked.values())  # they feed the noise probe
        _say_hidden(self._code, {_label(n): m for n, m in self.modules.items()})
        # No graph of ours beside a compiled model's (Dynamo's count of graphs is the user's): eager ops.
        compile_statistics = compile_statistics and not self._code.compiled
        self.histograms, self.bins, self.compile_statistics, self.activations = (
            histograms, bins, compile_statistics, activations)
        self._step = ArmedState(histograms=histograms)  # this armed step's (arm(histograms=))
        self._collector = CollectorPause()  # in a `with arm()` block, to collect() or disarm()
        # CPU buffers reused from one logged step to the next (bounded; freed by remove()).
        self._buffer = StepBuffer(bins, Scratch(), compile_statistics)
        self._parameters = ParameterReader(model, self.modules, parameters)
        self._handle: MonitorHandle | None = None
        #: The :class:`~lightning_gradhooks.core.noise.NoiseProbe`, armed and collected with the
        #: monitor; None with ``noise_scale=False``.
        self.noise = NoiseProbe(model, skip=hidden) if noise_scale else None  # no hook where none runs
        self._plugins = _forward_plugins(model, self._hooked, set(hidden), self._buffer.reduce,
                                         lambda: self._step.armed, forward_checks, attention_logits)
        checks = next((p for p in self._plugins if isinstance(p, ForwardChecks)), None)
        attention = next((p for p in self._plugins if isinstance(p, AttentionCapture)), None)
        self._module_hooks = ModuleHooks(self._planner, self._step, self._buffer, activations, self._replan,
                                         checks, self.noise, attention)

    def attach(self) -> MonitorHandle:
        """Prepare the hooks and return the handle that removes all of them (and disarms).

        Nothing is registered until the monitor is armed, and everything is taken out again
        when it disarms (:meth:`collect`, :meth:`disarm`): steps that are not logged run exactly
        as without the monitor.

        Reading ``grad_input`` passes a module's inputs through a view (or, for a layer whose
        forward is one op on its input, reads the edge of its output's node), which breaks on
        modules whose output (or input) is modified in place, as ``ReLU(inplace=True)`` after a
        norm layer or ``out += identity`` do. So the first armed forward only watches tensor
        version counters, and which layers are one op, and reads ``grad_output`` (that step has
        no ``grad_input``). When its backward starts, modules seen modified in place keep to
        ``grad_output`` (reported once in a warning) and every other module has its inputs
        watched too (:attr:`plan`).
        """
        if self._handle is None or not self._handle.active:
            self._handle = MonitorHandle(on_remove=self._release)
            if self._step.armed:
                self._register()
        return self._handle

    def _register(self) -> None:
        """Put the hooks of the plug-ins and of each module's plan in the modules."""
        for plugin in self._plugins:
            self._handle.put(plugin.hooks)
        self._planner.start()
        self._handle.put(self._module_hooks.hooks(self._hooked))

    def _replan(self) -> None:
        """The probe's backward has planned every module: its hooks out, the new plans' in if armed."""
        self._handle.park()
        if self._step.armed:
            self._register()

    @property
    def plan(self) -> dict[str, Plan]:
        """Each chosen module's read plan, by name: :class:`Plan` ``(read, reason)``, as it stands.

        Every module with hooks (all but :attr:`parameters_only`) starts with :attr:`Read.PROBE`; the first logged
        step's backward plans each lastingly (see ``docs/how-it-works.md``, "How the gradients are
        read")."""
        return dict(self._planner.plans)

    @property
    def parameters_only(self) -> list[str]:
        """Modules that get no hook and report their parameter gradients only (:attr:`Read.PARAMETERS_ONLY`):
        in compiled code that logged steps run (``eager_logged_steps=False``), or in CUDA graphs."""
        return [name for name, p in self._planner.plans.items() if p.read is Read.PARAMETERS_ONLY]

    @property
    def fallback(self) -> list[str]:
        """Modules whose ``grad_output`` alone is read (:attr:`Read.OUTPUT_ONLY`: modified in
        place, structured outputs, or not run in the first logged step), sorted."""
        return sorted(name for name, p in self._planner.plans.items() if p.read is Read.OUTPUT_ONLY)

    def remove(self) -> None:
        """Remove every hook, drop pending statistics and free scratch memory; safe to call any
        number of times."""
        if self._handle is not None:
            self._handle.remove()  # releases the monitor too (on_remove)
        else:
            self._release()

    def _release(self) -> None:
        self.disarm()
        if self.noise is not None:
            self.noise.remove()
        self._buffer.scratch = Scratch()

    @property
    def armed(self) -> bool:
        return self._step.armed

    @property
    def skipped(self) -> dict[str, str]:
        """Chosen parameters that gave no entry at the last collect, with the reason."""
        return self._parameters.skipped

    @property
    def scratch_bytes(self) -> int:
        """Memory the monitor keeps between logged steps to reduce the next one into, on the
        gradients' devices: buffers of at most :data:`~lightning_gradhooks.core.stats.SCRATCH_KEPT`
        elements each (a fresh buffer of megabytes costs more in page faults than its
        reduction), the noise probe's included. Freed when the hooks are removed."""
        return self._buffer.scratch.nbytes + (0 if self.noise is None else self.noise.scratch_bytes)

    @property
    def pending(self) -> bool:
        """Whether the hooks collected anything that :meth:`collect` has not returned yet."""
        return bool(self._buffer.pending)

    def arm(self, when: bool = True, *, batch_size: int | None = None, accumulation: int = 1,
            noise: bool = True, histograms: bool | None = None) -> ArmedStep:
        """Put the hooks in and make them collect until :meth:`collect` or :meth:`disarm`.

        Arm before the forward of the step to log; for gradient accumulation, once before the
        first micro-batch (:meth:`collect` after the last pools them). The result is a context
        manager that disarms on leaving, also by an exception; ``when=False`` gives one that does
        nothing, so one loop serves logged and other steps::

            for step, (x, y) in enumerate(loader):
                with monitor.arm(when=step % 50 == 0):
                    loss_fn(model(x), y).backward()
                    record = monitor.collect()  # empty unless armed

        Inside the ``with`` block Python's cyclic garbage collector is paused (if it was on; collect
        and leaving the block switch it back on; the collections an armed step's objects set off cost
        a 500-module MLP a third of its armed step). A collector you switched off stays off.

        Arming a monitor still armed (a step that raised before its :meth:`collect`, in a loop that
        went on without :meth:`disarm`) drops that step's partial statistics, with a warning. On a
        model with compiled code, the armed step runs eagerly until :meth:`collect` or :meth:`disarm`
        (``eager_logged_steps``): disarm also after a step that raised, or arm with ``with``.

        ``batch_size`` (examples per micro-batch on this rank) and ``accumulation`` (backward
        passes accumulated into the step) tell the noise probe where its two batches come from
        (see :mod:`lightning_gradhooks.core.noise`); ``noise=False`` leaves the noise probe out of this
        step (one noise sample a step: that of its first optimizer). ``histograms=False`` leaves
        histograms out of this step (a log's cadence: :meth:`GradientLog.arm`); None (the
        default) follows the monitor's ``histograms``.
        """
        if histograms is not None and not isinstance(histograms, bool):
            raise ValueError(f"`histograms` expected True, False or None, got {histograms!r}")
        if not check_bool("when", when):
            return ArmedStep(self, None)
        if self._step.armed:
            warnings.warn(
                "GradientMonitor.arm(): the monitor was still armed from a step that was neither "
                "collected nor disarmed (did it raise?); its partial statistics are dropped. Call "
                "collect() or disarm() after every armed step, or arm with `with monitor.arm():`, "
                "which disarms also when the step raises.",
                UserWarning,
                stacklevel=2,
            )
            self.disarm()
        self._step.armed = True
        self._step.histograms = self.histograms and histograms is not False
        if self._handle is not None and self._handle.active:
            # Registering makes a few objects per module: without the pause, a full collection
            # of the process's objects can fall inside it (measured: 6 -> 58 µs per module).
            was_paused = self._collector.paused
            self._collector.pause()
            try:
                self._code.enter()  # a compiled model: run eagerly until disarmed (core.compiled)
                self._register()
                if self.noise is not None and noise:
                    self.noise.arm(batch_size, accumulation, fed=self._hooked_ids)  # one set of hooks per module
            finally:
                if not was_paused:
                    self._collector.resume()  # paused again by `with`, or in collect()
        return ArmedStep(self, self._collector)

    def arm_noise(self, batch_size: int | None = None, accumulation: int = 1) -> None:
        """Measure this rank's gradient for the noise scale alone, on a step the monitor is not
        armed for: in a distributed job, a rank that logs nothing itself still takes part in the
        noise probe's ``all_reduce`` (:meth:`collect_noise`). Nothing when already armed."""
        if self.noise is not None and not self._step.armed and not self.noise.armed:
            self.noise.arm(batch_size, accumulation)

    def collect_noise(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Collect what :meth:`arm_noise` measured (its ``all_reduce``); nothing when the
        monitor is armed (:meth:`collect` collects it then) or the noise probe is not."""
        if self.noise is not None and not self._step.armed and self.noise.armed:
            self.noise.collect(parameters)

    def disarm(self, noise: bool = False) -> None:
        """Stop collecting, take the hooks out and drop what was collected but not returned;
        ``noise``: also a noise probe armed on its own (:meth:`arm_noise`), which otherwise
        stays armed until its optimizer step."""
        if self.noise is not None and (self._step.armed or noise):
            self.noise.disarm()
        self._step.armed = False
        self._code.leave()  # the stance before arm(), also after a step that raised
        self._buffer.clear()
        for plugin in self._plugins:
            plugin.reset()
        self._planner.stop()  # a probe whose backward never came is run again at the next arm
        if self._handle is not None:
            self._handle.park()
        self._collector.resume()

    # -- host side -------------------------------------------------------------------------
    def collect(self, parameters: Iterable[Tensor] | None = None) -> GradientRecord:
        """Reduce parameter gradients, move everything to the host at once, and disarm.

        Args:
            parameters: reduce the gradients of these of the monitored parameters only (the
                parameters of the optimizer about to step); default: all of them.

        Returns:
            The :class:`GradientRecord` of the step; empty when the monitor was not armed.
        """
        if not self._step.armed:
            return GradientRecord()
        self._collector.pause()  # for the record's many objects; already paused inside `with arm()`
        try:
            chosen = self._parameters.read(self._buffer, parameters, self._step.histograms)
            record = self._parameters.described(self._buffer.finish(), chosen, self.bins)
            if self.noise is not None:
                record.noise = self.noise.collect(parameters, squares=gradient_squares(record))
            return record
        finally:
            self.disarm()  # switches the collector back on

    def collect_parameters(self, parameters: Iterable[Tensor] | None = None) -> GradientRecord:
        """The parameter gradients alone, armed or not; hook statistics stay pending.

        For the ranks of a sharded job that log nothing themselves but hold shards of the
        parameters: every rank must reduce its pieces for the pooling.
        """
        buffer = StepBuffer(self.bins, self._buffer.scratch, self.compile_statistics)
        chosen = self._parameters.read(buffer, parameters, self._step.histograms)
        return self._parameters.described(buffer.finish(), chosen, self.bins)

    @property
    def parameters(self) -> dict[str, nn.Parameter]:
        """The chosen modules' own trainable parameters by qualified name, as they are now.

        Looked up at every call: ``fully_shard`` and ``parallelize_module`` replace a module's
        parameters with ``DTensor`` parameters after the monitor was made.
        """
        return self._parameters.parameters

    @property
    def sharded(self) -> list[str]:
        """Names of the parameters whose gradient each rank holds a piece of (``DTensor``
        parameters, FSDP1 ``use_orig_params`` views): their statistics need every rank's piece
        (:class:`~lightning_gradhooks.log.distributed.RankReducer`)."""
        return self._parameters.sharded(self.parameters)
