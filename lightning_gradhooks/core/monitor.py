"""``GradientMonitor``: per-module gradient statistics of the backward pass, in plain PyTorch.

The monitor chooses modules and gives back one handle that removes everything it registers.
Between logged steps nothing of it is in the modules. When it is *armed*, a forward hook on each
chosen module hooks the autograd nodes that made the module's outputs; for a torch.nn layer whose
forward is one autograd op on its input, one post-hook on that node also takes ``grad_input``
from the edge that leads to the input (:attr:`Read.EDGE`), and for other modules a forward
pre-hook passes each input through a view whose node is hooked too (:attr:`Read.VIEWS`):
backward then hands the hooks ``grad_output`` and ``grad_input``, the same tensors a full
backward hook (``register_full_backward_hook``) receives, without the two Python autograd
functions per call that a full backward hook wraps around every forward. Every hook is
registered through torch's public APIs (``register_forward_hook``, ``register_forward_pre_hook``,
``Node.register_prehook``, ``Node.register_hook``, ``Tensor.register_hook``). The hooks reduce the
gradients to statistics on the device; :meth:`GradientMonitor.collect` adds the parameter
gradients and brings everything to the host in one transfer per device, as a
:class:`~lightning_gradhooks.core.records.GradientRecord`.
Which modules are watched and how each is read is planned in :mod:`lightning_gradhooks.core.planning`.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.core._checks import MAX_BINS, check_bool, check_int
from lightning_gradhooks.core._text import listed
from lightning_gradhooks.core.attention import AttentionLogits
from lightning_gradhooks.core.forward_checks import ForwardChecks, Hook, tensor_leaves
from lightning_gradhooks.core.noise import NoiseProbe, gradient_squares
from lightning_gradhooks.core.planning import (
    NO_INPUT, Plan, Planner, Read, _grad_tensors, _named_modules, input_edge, select_modules,
)
from lightning_gradhooks.core.compiled import CompiledCode
from lightning_gradhooks.core.records import GradientEntry, GradientRecord, Histogram, Kind, pool_entries, single_entry
from lightning_gradhooks.core.stats import Reducer, Scratch, StatsRow

__all__ = [
    "GradientEntry", "GradientMonitor", "GradientRecord", "Histogram", "MonitorHandle", "Plan", "Read", "select_modules",
]

#: Label used for the root module, whose qualified name is the empty string.
ROOT_NAME = "(model)"
DEFAULT_BINS = 64


def _label(name: str) -> str:
    return name or ROOT_NAME


class CollectorPause:
    """Switches Python's cyclic garbage collector off, and back on only if it switched it off:
    a collector the user switched off stays off. Objects freed by reference counting are freed
    as always; only collecting reference cycles waits. Each monitor has one, the only owner of
    the pause in the library (:meth:`GradientMonitor.arm`)."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            gc.enable()


class MonitorHandle:
    """Removes every hook a :class:`GradientMonitor` attached; idempotent; a context manager.

    While the monitor is not armed its hooks are *parked*: removed from the modules, so a step
    that is not logged runs exactly as without the monitor.
    """

    def __init__(self, on_remove: Callable[[], None] = lambda: None) -> None:
        self._handles: list[RemovableHandle] = []
        self._on_remove = on_remove
        self.active = True

    def put(self, hooks: Sequence[Hook]) -> None:
        """Register hooks on their modules, until :meth:`park`."""
        handles = self._handles
        for module, pre, hook, *always in hooks:  # a fourth item True: a forward hook called also on an exception
            if pre:
                handles.append(module.register_forward_pre_hook(hook))
            else:
                handles.append(module.register_forward_hook(hook, always_call=bool(always)))

    def park(self) -> None:
        """Remove every hook from the modules; the monitor registers them again when armed."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def remove(self) -> None:
        """Take every hook out for good, and disarm the monitor."""
        self.active = False
        self.park()
        self._on_remove()

    def __enter__(self) -> MonitorHandle:
        return self

    def __exit__(self, *args: object) -> None:
        self.remove()


class _Armed:
    """What :meth:`GradientMonitor.arm` returns: a ``with`` block pauses the cyclic garbage
    collector while it runs and disarms on leaving, also by an exception."""

    def __init__(self, monitor: GradientMonitor, collector: CollectorPause | None) -> None:
        self._monitor = monitor
        self._collector = collector  # None: arm(when=False), a block that does nothing

    def __enter__(self) -> GradientMonitor:
        if self._collector is not None:
            self._collector.pause()
        return self._monitor

    def __exit__(self, *args: object) -> None:
        if self._collector is not None:
            self._monitor.disarm()  # switches the collector back on too




#: The forward check's entry of a module whose outputs hold NaN/Inf (:func:`_born`): the row of
#: a one-element sum that is not finite, as the check's own sum gives it.
_NONFINITE_SUM = StatsRow(0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)


def _born(pending: list, results: list, checked: Sequence[tuple[str, int, int]]) -> tuple[list, list]:
    """``pending`` and ``results`` with a ``"forward"`` entry before the ``"output"`` rows of each
    checked forward (``(module, start, end)`` slices of them) that hold NaN/Inf, where the
    forward check would have summed those outputs; unchanged when every output is finite."""
    bad = [(module, start) for module, start, end in checked
           if any(r is not None and r[0][4] > 0 for r in results[start:end])]
    if not bad:
        return pending, results
    pending, results = list(pending), list(results)
    for module, start in reversed(bad):  # from the end: the earlier positions stay
        pending.insert(start, (Kind.FORWARD, module, pending[start][2]))
        results.insert(start, (_NONFINITE_SUM, None))
    return pending, results


def _frozen(model: nn.Module, chosen: Mapping[str, nn.Module]) -> list[str]:
    """Modules left out because they own parameters and none of them requires grad."""
    return [
        _label(name)
        for name, module in _named_modules(model).items()
        if name not in chosen
        and list(module.parameters(recurse=False))
        and not any(p.requires_grad for p in module.parameters(recurse=False))
    ]

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
        self._say_hidden()
        self.histograms, self._step_histograms, self.bins = histograms, histograms, bins  # _step: arm(histograms=)
        # No graph of ours beside a compiled model's (Dynamo's count of graphs is the user's): eager ops.
        self.compile_statistics = compile_statistics and not self._code.compiled
        self._model, self._with_parameters = model, parameters
        self._read_forward(model, set(hidden), forward_checks, activations, attention_logits)
        #: Chosen parameters that gave no entry at the last collect, with the reason.
        self.skipped: dict[str, str] = {}
        self._armed = False
        self._collector = CollectorPause()  # in a `with arm()` block, to collect() or disarm()
        # Per tensor reduced since arming: (kind, label, device); the reductions, per device.
        self._pending: list[tuple[str, str, torch.device]] = []
        # This step's checked forwards whose outputs are read from their rows: (module, slice of _pending).
        self._checked: list[tuple[str, int, int]] = []
        self._reducers: dict[torch.device, Reducer] = {}
        # CPU buffers reused from one logged step to the next (bounded; freed by remove()).
        self._scratch = Scratch()
        self._handle: MonitorHandle | None = None
        self._hooks: list[Hook] | None = None  # the hooks of the plan: made again when it changes
        # The gradient hooks that take no noise callback, made once per (reading, label, histogram, output
        # index, edge): no new objects per logged step for the cyclic collector (:meth:`_gradient_hook`).
        self._gradient_hooks: dict[tuple, Callable] = {}
        #: The :class:`~lightning_gradhooks.core.noise.NoiseProbe`, armed and collected with the
        #: monitor; None with ``noise_scale=False``.
        self.noise = NoiseProbe(model, skip=hidden) if noise_scale else None  # no hook where none runs

    # -- lifecycle -------------------------------------------------------------------------

    def _read_forward(self, model: nn.Module, compiled: set[int], forward_checks: bool, activations: bool,
                       attention_logits: bool) -> None:
        """What the monitor reads of the forward pass on armed steps."""
        # With forward checks, every other module (parameterless ones too) gets a forward hook
        # on armed steps that checks its inputs and outputs only: a NaN is named where it is made.
        labels = {_label(name): module for name, module in _named_modules(model).items()}
        unmonitored = {label: m for label, m in labels.items() if label not in self._hooked and id(m) not in compiled}
        self._checks = ForwardChecks(model, unmonitored, self._reduce, lambda: self._armed, ROOT_NAME) \
            if forward_checks else None
        self.activations = activations  # the watched modules' outputs, read by their forward hook (_watch_outputs)
        self._copied: set[str] = set()  # modules whose outputs were seen changed in place (_reduce_output)
        # No attention capture around hidden code: its mode active there would make Dynamo recompile it.
        around = {id(m) for m in labels.values() if any(id(sub) in compiled for sub in m.modules())}
        self._attention = AttentionLogits(
            {label: m for label, m in labels.items() if id(m) not in around}, self._reduce, lambda: self._armed,
        ) if attention_logits else None

    def _say_hidden(self) -> None:
        """Say once what of the model cannot be seen on logged steps, by name, and what is measured instead."""
        for note in self._code.notes:
            warnings.warn(f"torch.compile: {note}", stacklevel=3)
        for reason, labels in self._code.hidden_by_reason({_label(n): m for n, m in self.modules.items()}).items():
            warnings.warn(f"{len(labels)} modules report parameter gradients only (no grad_output, grad_input, "
                          f"outputs, attention logits or noise probe), {reason}: {listed(labels)}", stacklevel=3)
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
            if self._armed:
                self._register()
        return self._handle

    def _register(self) -> None:
        """Put the hooks of each module's plan in the modules."""
        for part in (self._checks, self._attention):
            if part is not None:
                self._handle.put(part.hooks)
        self._planner.start()
        if self._hooks is None:  # made once per plan, registered and removed at every logged step
            self._hooks = []
            for label, module in self._hooked.items():
                read = self._planner.plans[label].read
                if read is Read.PROBE:
                    self._hooks.append((module, True, functools.partial(self._probe_inputs, label)))
                    self._hooks.append((module, False, functools.partial(self._probe_outputs, label)))
                else:
                    if read is Read.VIEWS:
                        self._hooks.append((module, True, functools.partial(self._watch_inputs, label)))
                    watch = functools.partial(self._watch_forward, label, read is Read.EDGE)
                    self._hooks.append((module, False, watch))
        self._handle.put(self._hooks)

    @property
    def plan(self) -> dict[str, Plan]:
        """Each chosen module's read plan, by name: :class:`Plan` ``(read, reason)``, as it stands.

        Every module with hooks (all but :attr:`parameters_only`) starts with :attr:`Read.PROBE`; the first logged
        step's backward plans each lastingly (see ``docs/usage.md``, "How the gradients are
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

    def _park(self) -> None:
        if self._checks is not None:
            self._checks.reset()
        if self._attention is not None and not self._armed:
            self._attention.reset()
        self._planner.stop()  # a probe whose backward never came is run again at the next arm
        if self._handle is not None:
            self._handle.park()

    def _probe_inputs(self, name: str, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._planner.probe_inputs(name, args)

    def _probe_outputs(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and self._planner.probe_outputs(name, args, output):
            self._watch_forward(name, False, module, args, output)
        elif self.activations and self._armed and torch._C._current_graph_task_id() == -1:
            self._watch_outputs(name, output)

    def _finish_probe(self) -> None:
        """Plan each probed module lastingly, once the first armed backward has started; the
        hooks of the new plans are made when next put in."""
        self._handle.park()  # the probe's hooks, the only ones in
        in_place = self._planner.finish()
        self._copied.update(in_place)  # their outputs are batched as copies (_reduce_output)
        self._hooks = None
        if self._armed:
            self._register()  # later forwards of this logged step (micro-batches) are hooked
        if in_place:
            warnings.warn(
                "in-place operations touch these modules' outputs or inputs, so their grad_output is "
                f"read with tensor hooks and grad_input is not logged: {', '.join(in_place)}",
                stacklevel=2,
            )

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
        self._scratch = Scratch()

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def scratch_bytes(self) -> int:
        """Memory the monitor keeps between logged steps to reduce the next one into, on the
        gradients' devices: buffers of at most :data:`~lightning_gradhooks.core.stats.SCRATCH_KEPT`
        elements each (a fresh buffer of megabytes costs more in page faults than its
        reduction), the noise probe's included. Freed when the hooks are removed."""
        return self._scratch.nbytes + (0 if self.noise is None else self.noise.scratch_bytes)

    @property
    def pending(self) -> bool:
        """Whether the hooks collected anything that :meth:`collect` has not returned yet."""
        return bool(self._pending)

    def arm(self, when: bool = True, *, batch_size: int | None = None, accumulation: int = 1,
            noise: bool = True, histograms: bool | None = None) -> _Armed:
        """Put the hooks in and make them collect until :meth:`collect` or :meth:`disarm`.

        Arm before the forward of the step to log; for gradient accumulation, once before the
        first micro-batch (:meth:`collect` after the last pools them). The result is a context
        manager that disarms on leaving, also by an exception; ``when=False`` gives one that does
        nothing, so one loop serves logged and other steps::

            for step, (x, y) in enumerate(loader):
                with monitor.arm(when=step % 50 == 0):
                    loss_fn(model(x), y).backward()
                    record = monitor.collect()  # empty unless armed

        Inside the ``with`` block Python's cyclic garbage collector is paused (if it was on;
        :meth:`collect` and leaving the block switch it back on), and inside :meth:`collect` after
        a bare ``arm()``: an armed step's short-lived objects per module could set off full
        collections, a third of a 500-module MLP's armed step (docs/benchmarks.md). Yours stays off.

        Arming a monitor still armed (a step that raised before its :meth:`collect`, in a loop that
        went on without :meth:`disarm`) drops that step's partial statistics, with a warning. On a
        model with compiled code, the armed step runs eagerly until :meth:`collect` or :meth:`disarm`
        (``eager_logged_steps``): disarm also after a step that raised, or arm with ``with``.

        ``batch_size`` (examples per micro-batch on this rank) and ``accumulation`` (backward passes
        into the step) tell the noise probe where its two batches come from (core.noise);
        ``noise=False`` leaves it out of this step (one sample a step: its first optimizer's).
        ``histograms=False`` leaves histograms out of this step (a log's cadence:
        :meth:`GradientLog.arm`); None (the default) follows the monitor's ``histograms``.
        """
        if histograms is not None and not isinstance(histograms, bool):
            raise ValueError(f"`histograms` expected True, False or None, got {histograms!r}")
        if not check_bool("when", when):
            return _Armed(self, None)
        if self._armed:
            warnings.warn(
                "GradientMonitor.arm(): the monitor was still armed from a step that was neither "
                "collected nor disarmed (did it raise?); its partial statistics are dropped. Call "
                "collect() or disarm() after every armed step, or arm with `with monitor.arm():`, "
                "which disarms also when the step raises.",
                UserWarning,
                stacklevel=2,
            )
            self.disarm()
        self._armed = True
        self._step_histograms = self.histograms and histograms is not False
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
        return _Armed(self, self._collector)

    def arm_noise(self, batch_size: int | None = None, accumulation: int = 1) -> None:
        """Measure this rank's gradient for the noise scale alone, on a step the monitor is not
        armed for: in a distributed job, a rank that logs nothing itself still takes part in the
        noise probe's ``all_reduce`` (:meth:`collect_noise`). Nothing when already armed."""
        if self.noise is not None and not self._armed and not self.noise.armed:
            self.noise.arm(batch_size, accumulation)

    def collect_noise(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Collect what :meth:`arm_noise` measured (its ``all_reduce``); nothing when the
        monitor is armed (:meth:`collect` collects it then) or the noise probe is not."""
        if self.noise is not None and not self._armed and self.noise.armed:
            self.noise.collect(parameters)

    def disarm(self, noise: bool = False) -> None:
        """Stop collecting, take the hooks out and drop what was collected but not returned;
        ``noise``: also a noise probe armed on its own (:meth:`arm_noise`), which otherwise
        stays armed until its optimizer step."""
        if self.noise is not None and (self._armed or noise):
            self.noise.disarm()
        self._armed = False
        self._code.leave()  # the stance before arm(), also after a step that raised
        self._pending.clear()
        self._checked.clear()
        self._reducers.clear()
        self._park()
        self._collector.resume()

    # -- hot path: armed steps only ----------------------------------------------------------
    def _watch_inputs(self, name: str, module: nn.Module, args: tuple) -> tuple | None:
        """Pass each input that requires grad through a view of its own, whose node's gradient
        is this module's ``grad_input``: what reaches the input through this module alone."""
        if not (self._armed and torch.is_grad_enabled()):
            return None
        watched = None
        for i, arg in enumerate(args):
            if isinstance(arg, Tensor) and arg.requires_grad:
                if watched is None:
                    watched = list(args)
                watched[i] = arg.view_as(arg)
                if self._checks is not None:  # the view is not summed again
                    self._checks.same_as(watched[i], arg)
                self._hook(watched[i], Kind.GRAD_INPUT, name if len(args) == 1 else f"{name}/{i}", False)
        return None if watched is None else tuple(watched)

    def _watch_forward(self, name: str, edge: bool, module: nn.Module, args: tuple, output: Any) -> None:
        """A watched module returned ``output``: read its statistics, hook its gradients (``edge``:
        also ``grad_input``, from the node that made the output: :attr:`Read.EDGE`)."""
        if not self._armed:
            return
        grad = torch.is_grad_enabled()
        # The outputs' statistics, not in a recomputation in backward; the check sums them otherwise.
        reads = self.activations and torch._C._current_graph_task_id() == -1
        checked = self._checks is not None and grad and module.training
        if checked:
            self._checks.check(name, args, output, outputs=not reads)
        if reads:
            start = len(self._pending)
            self._watch_outputs(name, output)
            if checked and len(self._pending) > start:  # the forward check of these outputs: _finish
                self._checked.append((name, start, len(self._pending)))
        if not grad:
            return
        if isinstance(output, Tensor):
            if output.requires_grad:
                noise = None if self.noise is None else self.noise.saw(module, args, output)
                if edge:
                    self._hook_edge(name, args, output, noise)
                else:
                    self._hook(output, Kind.GRAD_OUTPUT, name, self._step_histograms, noise)
        else:
            for path, t in _grad_tensors(output):
                self._hook(t, Kind.GRAD_OUTPUT, "/".join((name, *path)), self._step_histograms)

    def _watch_outputs(self, name: str, output: Any) -> None:
        """The floating outputs of a watched module (``activations``): a row per tensor
        (``"lstm/0"``, ``"gpt/logits"``), as for the gradients (the callers leave out a
        recomputation in backward)."""
        if isinstance(output, Tensor):  # the common case, without the walk
            if output.is_floating_point():
                self._reduce_output(name, name, output)
            return
        for path, t in tensor_leaves(output):
            if t.is_floating_point():
                self._reduce_output(name, "/".join((name, *path)), t)

    def _reduce_output(self, module: str, label: str, t: Tensor) -> None:
        """A module's output, batched with the gradients and read as it was returned: a later
        in-place op (``relu_``, ``out += identity``) could change it before its batch runs, so
        where that was seen (the probe's first logged step, or a batch that found its version
        counter moved: :meth:`_finish`), and while the probe has not seen it yet, a copy is
        batched instead; elsewhere the output itself, its version counter checked when read.
        (Outside the attention mode: a batch that fills up runs the compiled kernels.)"""
        copy = module in self._copied or self._planner.probing
        t = t.detach().clone() if copy else t
        if self._attention is None or not self._attention.on:  # no context manager on the common path
            self._reduce(Kind.OUTPUT, label, t, False, watch=not copy)
            return
        with self._attention.outside():
            self._reduce(Kind.OUTPUT, label, t, False, watch=not copy)

    def _hook(self, t: Tensor, kind: Kind, label: str, histogram: bool,
              noise: Callable[[Tensor], None] | None = None) -> None:
        """Reduce the gradient of ``t`` when backward computes it (and hand it to ``noise``, the
        noise probe's). A hook on the node that made ``t`` fires with the gradient of this version
        of ``t``, even if ``t`` is modified in place later, and lives as long as the step's graph."""
        node = t.grad_fn
        if node is None:  # a leaf: a module that returns a parameter
            t.register_hook(functools.partial(self._leaf_grad, kind, label, histogram, noise))
        elif noise is None and not self._planner.probing:  # the common case: one call, no check of its own
            node.register_prehook(self._gradient_hook(self._output_grad, kind, label, histogram, t.output_nr))
        else:
            node.register_prehook(functools.partial(self._node_grad, kind, label, histogram, t.output_nr, noise))

    def _hook_edge(self, label: str, args: tuple, output: Tensor, noise: Callable[[Tensor], None] | None) -> None:
        """One hook (a post-hook) on the node that made ``output``, for ``grad_output`` and, from
        the gradient the node sends along its input's edge, ``grad_input`` (:attr:`Read.EDGE`). A
        call that was not one op on its input reads ``grad_output`` alone, and the module is read
        through a view from the next logged step on, said once."""
        edge = input_edge(output, args)
        if edge is None:
            if self._planner.not_one_op(label):
                self._hooks = None  # made again, with the new plan, at the next arm
                warnings.warn(
                    f"{label}: its forward was not one autograd op on its input on this logged step (as it was "
                    "on the first one), so its grad_input is not logged for this call; it is read through a "
                    "view from the next logged step", stacklevel=4)
            self._hook(output, Kind.GRAD_OUTPUT, label, self._step_histograms, noise)
            return
        edge = None if edge == NO_INPUT else edge
        if noise is None:
            hook = self._gradient_hook(self._edge_grads, label, self._step_histograms, output.output_nr, edge, None)
        else:
            hook = functools.partial(self._edge_grads, label, self._step_histograms, output.output_nr, edge, noise)
        output.grad_fn.register_hook(hook)

    def _gradient_hook(self, method: Callable, *arguments: Any) -> Callable:
        """``functools.partial(method, *arguments)``, made once per monitor: a logged step of a
        500-module model otherwise leaves a thousand objects more (the partial and its bound
        method, alive with the step's graph) for the cyclic collector's next pass."""
        key = (method.__func__, *arguments)
        hook = self._gradient_hooks.get(key)
        if hook is None:
            hook = self._gradient_hooks[key] = functools.partial(method, *arguments)
        return hook

    def _edge_grads(self, label: str, histogram: bool, index: int, edge: int | None,
                    noise: Callable[[Tensor], None] | None, grad_inputs: tuple, grad_outputs: tuple) -> None:
        grad = grad_outputs[index]
        if noise is not None and grad is not None:
            noise(grad)  # stale after a disarm: it checks that itself
        if self._armed:
            self._reduce(Kind.GRAD_OUTPUT, label, grad, histogram)
            if edge is not None:
                self._reduce(Kind.GRAD_INPUT, label, grad_inputs[edge], False)

    def _output_grad(self, kind: Kind, label: str, histogram: bool, index: int, grads: tuple) -> None:
        if self._armed:
            self._reduce(kind, label, grads[index], histogram)

    def _node_grad(self, kind: Kind, label: str, histogram: bool, index: int,
                   noise: Callable[[Tensor], None] | None, grads: tuple) -> None:
        if self._planner.probing:
            self._finish_probe()
        if noise is not None and grads[index] is not None:
            noise(grads[index])  # stale after the probe's disarm: it checks that itself
        self._output_grad(kind, label, histogram, index, grads)

    def _leaf_grad(self, kind: Kind, label: str, histogram: bool, noise: Callable[[Tensor], None] | None,
                   grad: Tensor) -> None:
        self._node_grad(kind, label, histogram, 0, noise, (grad,))

    def _reduce(self, kind: Kind, name: str, grad: Tensor | None, histogram: bool, watch: bool = False) -> None:
        """Reduce ``grad`` into the armed step's pending rows and reducers; ``watch``: see
        :meth:`Reducer.add`."""
        if grad is None or not grad.is_floating_point():
            return
        if type(grad) is not Tensor and _shards.is_dtensor(grad):  # tensor parallel: this rank's piece
            grad = _shards.local_piece(grad)[0]
            if grad is None or grad.numel() == 0:
                return
        device = grad.device
        self._reducer(self._reducers, device).add(grad, histogram, watch)
        self._pending.append((kind, name, device))

    def _reducer(self, reducers: dict[torch.device, Reducer], device: torch.device) -> Reducer:
        """The reducer of ``device`` in ``reducers``, made there if it is not yet."""
        reducer = reducers.get(device)
        if reducer is None:
            reducer = reducers[device] = Reducer(self.bins, self._scratch, self.compile_statistics)
        return reducer

    # -- host side -------------------------------------------------------------------------
    def collect(self, parameters: Iterable[Tensor] | None = None) -> GradientRecord:
        """Reduce parameter gradients, move everything to the host at once, and disarm.

        Args:
            parameters: reduce the gradients of these of the monitored parameters only (the
                parameters of the optimizer about to step); default: all of them.

        Returns:
            The :class:`GradientRecord` of the step; empty when the monitor was not armed.
        """
        if not self._armed:
            return GradientRecord()
        self._collector.pause()  # for the record's many objects; already paused inside `with arm()`
        try:
            reduced = self._reduce_parameters(parameters)
            pending, reducers = self._pending, self._reducers
            self._pending, self._reducers = [], {}
            checked, self._checked = self._checked, []
            record = self._described(self._finish(pending, reducers, checked), reduced)
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
        pending: list[tuple[str, str, torch.device]] = []
        reducers: dict[torch.device, Reducer] = {}
        reduced = self._reduce_parameters(parameters, (pending, reducers))
        return self._described(self._finish(pending, reducers), reduced)

    @property
    def parameters(self) -> dict[str, nn.Parameter]:
        """The chosen modules' own trainable parameters by qualified name, as they are now.

        Looked up at every call: ``fully_shard`` and ``parallelize_module`` replace a module's
        parameters with ``DTensor`` parameters after the monitor was made.
        """
        found: dict[str, nn.Parameter] = {}
        if self._with_parameters:
            seen: set[int] = set()  # a tied parameter is reduced once, under its first name
            for name, module in self.modules.items():
                for pname, param in module._parameters.items():  # named_parameters(recurse=False), faster
                    if param is not None and param.requires_grad and id(param) not in seen:
                        seen.add(id(param))
                        found[f"{name}.{pname}" if name else pname] = param
        return found

    @property
    def sharded(self) -> list[str]:
        """Names of the parameters whose gradient each rank holds a piece of (``DTensor``
        parameters, FSDP1 ``use_orig_params`` views): their statistics need every rank's piece
        (:class:`~lightning_gradhooks.log.distributed.RankReducer`)."""
        return self._sharded(self.parameters)

    def _sharded(self, parameters: dict[str, nn.Parameter]) -> list[str]:
        views, _ = _shards.fsdp1_sharded(self._model)
        return [n for n, p in parameters.items() if id(p) in views or (type(p) is not nn.Parameter and _shards.is_dtensor(p))]

    def _reduce_parameters(self, parameters: Iterable[Tensor] | None,
                           into: tuple[list, dict] | None = None) -> dict[str, nn.Parameter]:
        """Reduce the chosen parameters' gradients (those in ``parameters`` only, if given) and
        return all the chosen parameters, by name; ``into``: the ``(pending, reducers)`` to reduce
        into instead of the armed step's (:meth:`collect_parameters`)."""
        wanted = None if parameters is None else {id(p) for p in parameters}
        views, flat = _shards.fsdp1_sharded(self._model)
        self.skipped = {"(FSDP1 flat parameters)": _shards.FLAT} if flat else {}
        chosen = self.parameters
        by_device: dict[torch.device, tuple[list[str], list[Tensor]]] = {}  # one Reducer call per device
        for name, piece, reason in _shards.pieces(chosen, views, wanted):
            if reason is not None:
                self.skipped[name] = reason
            elif piece is not None and piece.is_floating_point():
                names, grads = by_device.setdefault(piece.device, ([], []))
                names.append(name)
                grads.append(piece)
        pending, reducers = into or (self._pending, self._reducers)
        for device, (names, grads) in by_device.items():
            self._reducer(reducers, device).extend(grads, self._step_histograms)
            pending.extend([(Kind.PARAM_GRAD, name, device) for name in names])
        return chosen

    def _described(self, record: GradientRecord, parameters: dict[str, nn.Parameter]) -> GradientRecord:
        """The record with what the log needs to know of this monitor (see :class:`GradientRecord`)."""
        record.parameters, record.skipped, record.bins = parameters, dict(self.skipped), self.bins
        record.sharded = tuple(self._sharded(parameters))  # the parameters just looked up, not again
        return record

    def _changed(self, labels: list[str]) -> None:
        """Outputs that an in-place op changed before their batch read them (a module that did
        not show it in the probe's step) give no row this step, said once, and their module's
        outputs are batched as copies from now on."""
        modules = sorted({label.split("/")[0] for label in labels} - self._copied)
        self._copied.update(modules)
        if modules:
            warnings.warn(
                "an in-place operation changed the outputs of these modules before their statistics were "
                f"read: no output statistics for them on this logged step, read from a copy from the next "
                f"one: {listed(modules)}",
                stacklevel=3,
            )

    def _finish(self, pending: list[tuple[str, str, torch.device]], reducers: dict[torch.device, Reducer],
                checked: Sequence[tuple[str, int, int]] = ()) -> GradientRecord:
        # One transfer per device; then the rows of each name are pooled (GradientEntry.calls).
        if len(reducers) == 1:
            results = reducers.popitem()[1].finish()
        else:
            by_device = {device: iter(reducer.finish()) for device, reducer in reducers.items()}
            results = [next(by_device[device]) for _, _, device in pending]
        if checked:
            pending, results = _born(pending, results, checked)
        if None in results:  # outputs changed in place before their batch ran (Reducer.add's watch)
            kept = [(p, r) for p, r in zip(pending, results) if r is not None]
            self._changed([label for (_, label, _), r in zip(pending, results) if r is None])
            pending, results = [p for p, _ in kept], [r for _, r in kept]
        keys = [(kind, label) for kind, label, _ in pending]
        if len(set(keys)) == len(keys):  # no module called twice: nothing to pool
            return GradientRecord([single_entry(kind, label, *result) for (kind, label), result in zip(keys, results)])
        groups: dict[tuple[str, str], list[tuple[StatsRow, list[float] | None]]] = {}
        for key, result in zip(keys, results):
            groups.setdefault(key, []).append(result)
        return GradientRecord([pool_entries(kind, label, parts, self.bins) for (kind, label), parts in groups.items()])
