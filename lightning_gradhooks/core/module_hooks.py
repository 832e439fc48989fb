"""The hooks that read the watched modules on armed steps: each module's ``grad_output`` and
``grad_input`` (what a full backward hook receives) and its outputs, by its read plan
(:class:`~lightning_gradhooks.core.planning.Planner`).

When the monitor is armed, a forward hook on each watched module hooks the autograd nodes that
made the module's outputs; for a torch.nn layer whose forward is one autograd op on its input, one
post-hook on that node also takes ``grad_input`` from the edge that leads to the input
(:attr:`Read.EDGE`), and for other modules a forward pre-hook passes each input through a view
whose node is hooked too (:attr:`Read.VIEWS`): backward then hands the hooks the same tensors a
full backward hook (``register_full_backward_hook``) receives, without the two Python autograd
functions per call that a full backward hook wraps around every forward. Every hook is registered
through torch's public APIs (``register_forward_hook``, ``register_forward_pre_hook``,
``Node.register_prehook``, ``Node.register_hook``, ``Tensor.register_hook``). What they read is
reduced on the device into the step's :class:`~lightning_gradhooks.core.step_buffer.StepBuffer`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gradhooks.core.attention import AttentionCapture
from lightning_gradhooks.core.forward_checks import ForwardChecks, tensor_leaves
from lightning_gradhooks.core.handles import Hook
from lightning_gradhooks.core.noise import NoiseProbe
from lightning_gradhooks.core.planning import NO_INPUT, Planner, Read, _grad_tensors, input_edge
from lightning_gradhooks.core.step_buffer import StepBuffer
from lightning_gradhooks.summary.records import Kind

__all__ = ["ArmedState", "ModuleHooks"]


@dataclass
class ArmedState:
    """Whether the monitor is armed, and whether this armed step counts histograms: one object,
    read by every part's hooks, written by the monitor's ``arm`` and ``disarm`` alone."""

    armed: bool = False
    histograms: bool = True


class ModuleHooks:
    """The watched modules' hooks of one monitor.

    Args:
        planner: each watched module's read plan.
        step: the monitor's :class:`ArmedState`.
        buffer: where the step's tensors are reduced.
        activations: also reduce each watched module's floating outputs.
        replan: parks every hook, and puts the hooks of the new plans in if armed (called when
            the probe's backward has planned every module).
        checks, noise, attention: the monitor's forward checks, noise probe and attention
            capture (None where off), which these hooks feed.
    """

    def __init__(self, planner: Planner, step: ArmedState, buffer: StepBuffer, activations: bool,
                 replan: Callable[[], None], checks: ForwardChecks | None, noise: NoiseProbe | None,
                 attention: AttentionCapture | None) -> None:
        self._planner, self._step, self._buffer, self._activations = planner, step, buffer, activations
        self._replan, self._checks, self._noise, self._attention = replan, checks, noise, attention
        self._hooks: list[Hook] | None = None  # the hooks of the plan: made again when it changes
        # The gradient hooks that take no noise callback, made once per (reading, label, histogram,
        # output index, edge) and put on the nodes of every logged step: no new objects per step
        # for the cyclic collector to walk (:meth:`_gradient_hook`).
        self._gradient_hooks: dict[tuple, Callable] = {}

    def hooks(self, hooked: Mapping[str, nn.Module]) -> list[Hook]:
        """The forward hooks of each watched module's plan (made once per plan)."""
        if self._hooks is None:
            self._hooks = []
            for label, module in hooked.items():
                read = self._planner.plans[label].read
                if read is Read.PROBE:
                    self._hooks.append((module, True, functools.partial(self._probe_inputs, label)))
                    self._hooks.append((module, False, functools.partial(self._probe_outputs, label)))
                else:
                    if read is Read.VIEWS:
                        self._hooks.append((module, True, functools.partial(self._watch_inputs, label)))
                    watch = functools.partial(self._watch_forward, label, read is Read.EDGE)
                    self._hooks.append((module, False, watch))
        return self._hooks

    def _probe_inputs(self, name: str, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._planner.probe_inputs(name, args)

    def _probe_outputs(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and self._planner.probe_outputs(name, args, output):
            self._watch_forward(name, False, module, args, output)
        elif self._activations and self._step.armed and torch._C._current_graph_task_id() == -1:
            self._watch_outputs(name, output)

    def _finish_probe(self) -> None:
        """Plan each probed module lastingly, once the first armed backward has started; the
        hooks of the new plans are made when next put in."""
        in_place = self._planner.finish()
        self._buffer.copied.update(in_place)  # their outputs are batched as copies (_reduce_output)
        self._hooks = None
        self._replan()  # the probe's hooks out; if armed, the new plans' in (later micro-batches are hooked)
        if in_place:
            warnings.warn(
                "in-place operations touch these modules' outputs or inputs, so their grad_output is "
                f"read with tensor hooks and grad_input is not logged: {', '.join(in_place)}",
                stacklevel=2,
            )

    def _watch_inputs(self, name: str, module: nn.Module, args: tuple) -> tuple | None:
        """Pass each input that requires grad through a view of its own, whose node's gradient
        is this module's ``grad_input``: what reaches the input through this module alone."""
        if not (self._step.armed and torch.is_grad_enabled()):
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
        if not self._step.armed:
            return
        grad = torch.is_grad_enabled()
        # The outputs' statistics, not in a recomputation in backward; the check sums them otherwise.
        reads = self._activations and torch._C._current_graph_task_id() == -1
        checked = self._checks is not None and grad and module.training
        if checked:
            self._checks.check(name, args, output, outputs=not reads)
        if reads:
            start = len(self._buffer.pending)
            self._watch_outputs(name, output)
            if checked and len(self._buffer.pending) > start:  # the forward check of these outputs: _finish
                self._buffer.checked.append((name, start, len(self._buffer.pending)))
        if not grad:
            return
        if isinstance(output, Tensor):
            if output.requires_grad:
                noise = None if self._noise is None else self._noise.saw(module, args, output)
                if edge:
                    self._hook_edge(name, args, output, noise)
                else:
                    self._hook(output, Kind.GRAD_OUTPUT, name, self._step.histograms, noise)
        else:
            for path, t in _grad_tensors(output):
                self._hook(t, Kind.GRAD_OUTPUT, "/".join((name, *path)), self._step.histograms)

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
        copy = module in self._buffer.copied or self._planner.probing
        t = t.detach().clone() if copy else t
        if self._attention is None or not self._attention.on:  # no context manager on the common path
            self._buffer.reduce(Kind.OUTPUT, label, t, False, watch=not copy)
            return
        with self._attention.outside():
            self._buffer.reduce(Kind.OUTPUT, label, t, False, watch=not copy)

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
            self._hook(output, Kind.GRAD_OUTPUT, label, self._step.histograms, noise)
            return
        edge = None if edge == NO_INPUT else edge
        if noise is None:
            hook = self._gradient_hook(self._edge_grads, label, self._step.histograms, output.output_nr, edge, None)
        else:
            hook = functools.partial(self._edge_grads, label, self._step.histograms, output.output_nr, edge, noise)
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
        if self._step.armed:
            self._buffer.reduce(Kind.GRAD_OUTPUT, label, grad, histogram)
            if edge is not None:
                self._buffer.reduce(Kind.GRAD_INPUT, label, grad_inputs[edge], False)

    def _output_grad(self, kind: Kind, label: str, histogram: bool, index: int, grads: tuple) -> None:
        if self._step.armed:
            self._buffer.reduce(kind, label, grads[index], histogram)

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
