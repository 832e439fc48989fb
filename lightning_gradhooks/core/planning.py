"""Which modules a :class:`~lightning_gradhooks.GradientMonitor` watches, and how it reads each.

:func:`select_modules` chooses modules by qualified name. A :class:`Planner` holds each watched
module's read plan (:class:`Plan`: a :class:`Read` and why): the first logged step probes what
the modules do (in-place use, structured outputs, whether a layer's forward is one autograd op on
its input) and its backward plans each lastingly. Every plan is made by one function,
:func:`_decide`. The monitor owns the hooks; the planner only says which to put in and takes in
what the probe's hooks see.
"""

from __future__ import annotations

import enum
import fnmatch
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.summary.checks import check_patterns
from lightning_gradhooks.core.forward_checks import tensor_leaves

__all__ = ["ONE_OP", "Plan", "Planner", "Read", "input_edge", "select_modules"]


class Read(enum.Enum):
    """How the monitor reads a module's gradients on a logged step: see :attr:`GradientMonitor.plan`.

    Every mechanism reads what a full backward hook would receive, without its wrapping of every
    forward; ``param_grad`` entries come from :meth:`GradientMonitor.collect` whatever the plan.
    """

    #: The first logged step: ``grad_output`` only, while the tensors' version counters are
    #: watched for in-place use; its backward decides the lasting plan.
    PROBE = "probe"
    #: ``grad_output`` and ``grad_input`` from one hook on the node that made the output: the
    #: module is a torch.nn layer whose forward was one autograd op on its one input (:data:`ONE_OP`),
    #: so what that node sends along its input's edge is the gradient through this module alone.
    EDGE = "edge"
    #: ``grad_output`` from the node that made each output, ``grad_input`` from the node of a
    #: view that each input is passed through.
    VIEWS = "views"
    #: ``grad_output`` only (a view could not be used, or not safely): the reason says why.
    OUTPUT_ONLY = "output only"
    #: No hook (compiled code run on logged steps, a CUDA graph; the reason says which): parameter
    #: gradients only (see :mod:`lightning_gradhooks.core.compiled`).
    PARAMETERS_ONLY = "parameters only"


class Plan(NamedTuple):
    """A module's read plan: what is read (:class:`Read`) and why."""

    read: Read
    reason: str


#: What a module can show on logged steps, which :func:`_decide` plans from.
IN_PLACE, STRUCTURED, NOT_RUN, NOT_ONE_OP = "in place", "structured", "not run", "not one op"

#: torch.nn layers whose forward is one autograd op on their input and their own parameters, on
#: the inputs they usually get (a Linear on 2-D input, a convolution without padding modes, ...):
#: the candidates for :attr:`Read.EDGE`, by exact type (a subclass may compute more). Whether a
#: call was one op on its input is checked on the graph at every call (:func:`input_edge`): a
#: Linear on 3-D input (a view, ``addmm``, a view), a cast whose backward rounds the gradient, a
#: decomposed layer or a forward hook that adds the input to the output is not.
ONE_OP = frozenset({
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Embedding, nn.Dropout,
    nn.Tanh, nn.Sigmoid, nn.ReLU, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus, nn.Mish,
    nn.Softmax, nn.LogSoftmax,
})
#: :func:`input_edge` of a call whose input does not require grad: no ``grad_input`` to read.
NO_INPUT = -1


def input_edge(output: Any, args: tuple) -> int | None:
    """Where a module's one input reaches the autograd node that made its ``output``, when that
    node is the only way from the output to the input: the index of the input's edge in the
    node's ``next_functions``, there exactly once, every other edge leading away from the input
    (to nothing, or through nodes of one edge each to a node of none, such as a parameter's
    AccumulateGrad, in a few steps); :data:`NO_INPUT` when the input does not require grad; None
    when the call was not one op on its input (several inputs, no node, or another way).

    The edge may lead to the input through one cast that autocast made in the forward (a
    ``ToCopyBackward0`` node), when the output's dtype is narrower than the input's: that cast's
    backward only widens the gradient, exactly, so the statistics are those of ``grad_input``.
    """
    node = getattr(output, "grad_fn", None)
    if len(args) != 1 or node is None:
        return None
    x = args[0]
    if not (isinstance(x, Tensor) and x.requires_grad):
        return NO_INPUT
    fn, found = x.grad_fn, None
    narrowed = output.dtype != x.dtype and torch.promote_types(output.dtype, x.dtype) == x.dtype
    for i, edge in enumerate(node.next_functions):
        if _leads_to(edge, x, fn) or (narrowed and _cast_of(edge, x, fn)):
            if found is not None:
                return None  # the input twice: the op's gradient would be a sum over both
            found = i
        elif not _away(edge, x, fn):
            return None
    return found


def _leads_to(edge: tuple[Any, int], x: Tensor, fn: Any) -> bool:
    """Whether ``edge`` is the edge of ``x`` (whose node is ``fn``; a leaf's edge leads to its
    AccumulateGrad node, whose ``variable`` is the leaf)."""
    n, k = edge
    return n is not None and (n is fn and k == x.output_nr if fn is not None else getattr(n, "variable", None) is x)


def _cast_of(edge: tuple[Any, int], x: Tensor, fn: Any) -> bool:
    """Whether ``edge`` leads to a cast of ``x`` (a ``ToCopyBackward0`` node whose one edge is ``x``'s)."""
    n = edge[0]
    if n is None or type(n).__name__ != "ToCopyBackward0":
        return False
    edges = n.next_functions
    return len(edges) == 1 and _leads_to(edges[0], x, fn)


#: How many nodes of one edge :func:`input_edge` follows from an edge before it gives up
#: (a parameter's is at most two away: ``TBackward0``, then its AccumulateGrad).
_CHAIN = 4


def _away(edge: tuple[Any, int], x: Tensor, fn: Any) -> bool:
    """Whether no gradient can flow from ``edge`` to ``x``: it leads to no node, or through
    nodes of one edge each (``x``'s not among them) to a node of none, within :data:`_CHAIN`."""
    for _ in range(_CHAIN):
        if _leads_to(edge, x, fn):
            return False
        node = edge[0]
        if node is None:
            return True
        edges = node.next_functions
        if len(edges) != 1:
            return not edges  # a node of no edges (AccumulateGrad) is where a gradient stops
        edge = edges[0]
    return False


def _one_op_type(module: nn.Module) -> bool:
    """Whether ``module`` is of a type of :data:`ONE_OP` (a candidate for :attr:`Read.EDGE`)."""
    return _shards.unsharded_type(module) in ONE_OP


def _decide(module: nn.Module, hidden: str | None, seen: frozenset[str] | None) -> Plan:
    """The read plan of ``module``, from why it gets no hook (``hidden``; None: it gets hooks) and
    what the logged steps showed of it (``seen``; None before the first logged step's backward).
    Every plan of the monitor is made here."""
    if hidden is not None:
        return Plan(Read.PARAMETERS_ONLY, hidden)
    if seen is None:
        return Plan(Read.PROBE, "first logged step: grad_output only, watching for in-place use")
    if IN_PLACE in seen:
        return Plan(Read.OUTPUT_ONLY, "its input or output is modified in place: a view would break")
    if STRUCTURED in seen:
        return Plan(Read.OUTPUT_ONLY, "its output is not a tensor or a flat tuple of tensors, as a full backward hook needs")
    if NOT_RUN in seen:
        return Plan(Read.OUTPUT_ONLY, "it did not run in the first logged step, so in-place use could not be ruled out")
    if not _one_op_type(module):
        return Plan(Read.VIEWS, "grad_input through a view of each input")
    if NOT_ONE_OP in seen:
        return Plan(Read.VIEWS, "grad_input through a view of its input: its forward was not one op on its "
                                "input on a logged step (another input shape, a cast that rounds the gradient, "
                                "a decomposed layer)")
    return Plan(Read.EDGE, "its forward is one op on its input: grad_input is what the op sends along the input's edge")


@dataclass
class _Probe:
    """What the first logged forward showed of each module (:data:`IN_PLACE`, ...)."""

    inputs: dict[str, list[list[tuple[Tensor, int]]]] = field(default_factory=dict)
    outputs: list[tuple[str, list[tuple[Tensor, int]]]] = field(default_factory=list)
    seen: dict[str, set[str]] = field(default_factory=dict)

    def add(self, name: str, observation: str) -> None:
        self.seen.setdefault(name, set()).add(observation)

    def observations(self, names: Iterable[str]) -> dict[str, frozenset[str]]:
        for name, outs in self.outputs:
            if any(t._version != v for t, v in outs):
                self.add(name, IN_PLACE)  # modified in place after the module returned it
        ran = {name for name, _ in self.outputs}
        return {name: frozenset(self.seen.get(name, set()) | ({NOT_RUN} if name not in ran else set())) for name in names}


def _grad_tensors(value: Any) -> list[tuple[tuple[str, ...], Tensor]]:
    """The tensors requiring grad in ``value``, with their key paths."""
    return [(path, t) for path, t in tensor_leaves(value) if t.requires_grad]


def _full_hook_sees(output: Any) -> bool:
    """Whether a full backward hook sees every tensor of ``output``: a tensor or a flat tuple."""
    return isinstance(output, Tensor) or (type(output) is tuple and all(isinstance(o, Tensor) for o in output))


#: Attribute names that wrappers insert in qualified names: torch.compile, FSDP1, checkpointing,
#: Lightning Fabric's ``fabric.setup(model)``.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"})


def _without_wrappers(name: str) -> str:
    """``net._orig_mod.0`` -> ``net.0``: names as in the model before ``torch.compile``, FSDP1
    wrapping and checkpoint wrapping."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _is_compile_wrapper(module: nn.Module) -> bool:
    return "_orig_mod" in module._modules  # what torch.compile(module) returns


def _named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()``, named as before ``torch.compile`` (wrappers left out)."""
    return {
        _without_wrappers(name): module
        for name, module in model.named_modules()
        if not _is_compile_wrapper(module)
    }


def _compiled_modules(model: nn.Module) -> set[int]:
    """The ids of the modules whose forward runs in code compiled by ``torch.compile``.

    ``torch.compile(module)``, ``module.compile()``, and (duck-typed, for Lightning) a model
    whose ``forward`` or ``training_step`` was compiled or that ``Trainer.fit`` unwrapped from
    ``torch.compile``.
    """
    roots = [m for m in model.modules() if _is_compile_wrapper(m) or getattr(m, "_compiled_call_impl", None)]
    compiled_entry = any(
        hasattr(getattr(model, attr, None), "_torchdynamo_orig_callable") for attr in ("forward", "training_step")
    )
    if compiled_entry or getattr(model, "_compiler_ctx", None):
        roots.append(model)
    return {id(sub) for root in roots for sub in root.modules()}


def _did_you_mean(pattern: str, names: Mapping[str, nn.Module]) -> str:
    """``'; did you mean "model.encoder.*"?'`` where a module's name + ``.`` + ``pattern`` matches
    (the shortest such prefix: a model held as ``self.model``); ``""`` where none does."""
    prefixes = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            if fnmatch.fnmatchcase(".".join(parts[i:]), pattern):
                prefixes.add(".".join(parts[:i]))
                break  # the shortest prefix of this name
    if not prefixes:
        return ""
    prefix = min(prefixes, key=lambda n: (n.count("."), len(n), n))
    return f'; did you mean "{prefix}.{pattern}"?'


def select_modules(
    model: nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> dict[str, nn.Module]:
    """Choose the modules to monitor, by qualified name as ``model.named_modules()`` gives it.

    Without ``include``, every module that directly owns a parameter requiring grad is chosen.
    Patterns are ``fnmatch`` globs matched case-sensitively against the whole name; the root
    module's name is the empty string. Names are those of the model before ``torch.compile``
    (no ``_orig_mod.``).

    An ``exclude`` pattern that matches no module excludes nothing, which is harmless: it is
    warned about once (a ``UserWarning`` naming it), so a shared configuration such as
    ``exclude=["*.dropout"]`` works on a model without dropout.

    Raises:
        ValueError: an ``include`` pattern matches no module (the message shows names that
            exist), or the selection is empty.
    """
    include = check_patterns("include", include, allow_empty=False) or []
    exclude = check_patterns("exclude", exclude) or []
    names = _named_modules(model)
    for argument, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                shown = ", ".join(repr(n) for n in list(names)[:12])
                message = (
                    f"`{argument}` pattern {pattern!r} matches no module of "
                    f"{type(model).__name__}; module names look like: {shown}"
                )
                if argument == "exclude":
                    warnings.warn(f"{message}. It excludes nothing.", UserWarning, stacklevel=2)
                    continue
                raise ValueError(message + _did_you_mean(pattern, names))

    def chosen(name: str, module: nn.Module) -> bool:
        if include:
            picked = any(fnmatch.fnmatchcase(name, p) for p in include)
        else:
            picked = any(p.requires_grad for p in module.parameters(recurse=False))
        return picked and not any(fnmatch.fnmatchcase(name, p) for p in exclude)

    selected = {name: module for name, module in names.items() if chosen(name, module)}
    if not selected:
        raise ValueError(
            f"no module of {type(model).__name__} was selected (include={include!r}, "
            f"exclude={exclude!r}); without `include`, modules that own trainable parameters "
            "are chosen"
        )
    return selected


class Planner:
    """The read plans of the watched modules (by label), and the first logged step's probe.

    Args:
        modules: the watched modules, by label.
        hidden: ids of the modules that get no hook (parameter gradients only), each with why
            (:class:`~lightning_gradhooks.core.compiled.CompiledCode`).

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
        >>> planner = Planner({"0": net[0]}, hidden={})
        >>> planner.plans["0"].read
        <Read.PROBE: 'probe'>
        >>> planner.start()
        >>> x = torch.randn(3, 2, requires_grad=True)
        >>> out = net[0](x)
        >>> planner.probe_outputs("0", (x,), out)
        True
        >>> _ = net[1](out)  # modifies the Linear's output in place
        >>> planner.finish()
        ['0']
        >>> planner.plans["0"].read
        <Read.OUTPUT_ONLY: 'output only'>
    """

    def __init__(self, modules: Mapping[str, nn.Module], hidden: Mapping[int, str]) -> None:
        #: Each module's :class:`Plan`, by label, as it stands.
        self.plans = {label: _decide(module, hidden.get(id(module)), None) for label, module in modules.items()}
        #: The modules that get hooks (all but the hidden ones), by label.
        self.hooked = {label: module for label, module in modules.items() if id(module) not in hidden}
        self._probe: _Probe | None = None  # what the first logged forward shows, until its backward
        self._seen: dict[str, frozenset[str]] = {}  # what the logged steps showed of each planned module

    @property
    def probing(self) -> bool:
        """Whether a probe is waiting for its backward (:meth:`finish`)."""
        return self._probe is not None

    def start(self) -> None:
        """Begin a probe where a module still has :attr:`Read.PROBE` (again, if a probe's
        backward never came)."""
        if self._probe is None and any(p.read is Read.PROBE for p in self.plans.values()):
            self._probe = _Probe()

    def stop(self) -> None:
        """Drop a probe whose backward never came; the next :meth:`start` runs it again."""
        self._probe = None

    def probe_inputs(self, label: str, args: tuple) -> None:
        """A probed module's forward begins: remember its inputs' versions."""
        if self._probe is not None:
            self._probe.inputs.setdefault(label, []).append([(t, t._version) for _, t in _grad_tensors(args)])

    def probe_outputs(self, label: str, args: tuple, output: Any) -> bool:
        """A probed module's forward of ``args`` returned ``output``; False when no probe is running."""
        probe = self._probe
        if probe is None:
            return False
        calls = probe.inputs.get(label)
        if calls and any(t._version != v for t, v in calls.pop()):
            probe.add(label, IN_PLACE)  # the module modified its own input in place
        outputs = _grad_tensors(output)
        if outputs and not _full_hook_sees(output):
            probe.add(label, STRUCTURED)
        if outputs and _one_op_type(self.hooked[label]) and input_edge(output, args) is None:  # (others: VIEWS)
            probe.add(label, NOT_ONE_OP)
        probe.outputs.append((label, [(t, t._version) for _, t in outputs]))
        return True

    def finish(self) -> list[str]:
        """Plan each probed module lastingly (the first armed backward has started); returns
        the modules seen modified in place, sorted."""
        probe, self._probe = self._probe, None
        seen = probe.observations(label for label, p in self.plans.items() if p.read is Read.PROBE)
        self._seen.update(seen)
        for label, shown in seen.items():
            self.plans[label] = _decide(self.hooked[label], None, shown)
        return sorted(label for label, shown in seen.items() if IN_PLACE in shown)

    def not_one_op(self, label: str) -> bool:
        """A call of a module planned :attr:`Read.EDGE` was not one op on its input (see
        :func:`input_edge`): plan it again; True the first time (its plan changed)."""
        if self.plans[label].read is not Read.EDGE:
            return False
        self._seen[label] = self._seen[label] | {NOT_ONE_OP}
        self.plans[label] = _decide(self.hooked[label], None, self._seen[label])
        return True
