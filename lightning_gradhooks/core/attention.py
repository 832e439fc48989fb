"""``AttentionCapture``: the maximum attention logit of every attention call on the monitor's armed steps.

The logit is measured as the softmax sees it: the scaled ``q·kᵀ`` of the call's own query and
key (after RoPE or QK-norm, which happen before the call), with the call's scale, plus its
additive mask, over the positions its boolean mask or ``is_causal`` lets through (GQA: each
query head against its key head). It is exact: the maximum over heads, queries and keys of one
more ``q·kᵀ``, computed in float32 in chunks of queries, so that no more than
:data:`CHUNK_ELEMENTS` logits are held at once, and never read to the host before ``collect``.

Calls are seen through a :class:`torch.overrides.TorchFunctionMode`, torch's supported way to
intercept its functions, without patching anything: the mode is entered only while a module of
the model that may make an attention call runs its forward on an armed step (its forward pre-hook
enters it, its forward hook leaves it, also when the forward raises). torch.nn's own modules
(layers, activations, containers) make none but ``nn.MultiheadAttention``: they get no hook, and
while one called by such a module runs, the mode is left (each call that the mode sees costs
the host about a microsecond). The mode sees
``F.scaled_dot_product_attention`` (your modules, ``transformers`` models with
``attn_implementation="sdpa"``) and ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``:
with ``need_weights=False`` its own SDPA call, with ``need_weights=True`` the input of its
softmax, which it already computed). A call belongs to the innermost module of the model
running when it is made. An attention module (its class name says so) that ran on an armed step
without a call seen (eager attention, a custom kernel) is named once in a warning: its outputs and
gradients are measured, its logits are not. Modules that get no hook at all (compiled code run on
logged steps, CUDA graphs) are named by the monitor (:mod:`lightning_gradhooks.core.compiled`).
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, redispatch_function

from lightning_gradhooks.core._shards import unsharded_type
from lightning_gradhooks.summary.records import Kind

#: Logits held at once per chunk of queries (16 MiB in float32).
CHUNK_ELEMENTS = 1 << 22
#: Class names of attention modules (to name those whose attention was not seen).
_ATTENTION = re.compile("attention|attn", re.IGNORECASE)
_MHA = inspect.signature(F.multi_head_attention_forward)
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def max_logits(query: Tensor, key: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """The largest logit per head of a ``F.scaled_dot_product_attention`` call with these
    arguments (float32, shape ``(heads,)`` for 4-D or longer inputs, ``(1,)`` otherwise;
    ``-inf`` for a head whose every position is masked out), in chunks of queries.

    Example:
        >>> q, k = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]]), torch.tensor([[[[3.0, 0.0], [0.0, 1.0]]]])
        >>> max_logits(q, k, is_causal=True)  # q0·k0 = 3 and q1·k1 = 2 are let through, scaled by 1/√2
        tensor([2.1213])
    """
    q, k = query.detach(), key.detach()
    length, keys, width = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = width**-0.5 if scale is None else scale
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    k = k.float().transpose(-1, -2)
    heads = q.dim() >= 4
    per_query = max(1, q[..., :1, :1].numel() * keys)  # logits per query row, over batch and heads
    chunk = max(1, CHUNK_ELEMENTS // per_query)
    best = None
    for start in range(0, length, chunk):
        logits = torch.matmul(q[..., start : start + chunk, :].float() * scale, k)
        if attn_mask is not None:
            mask = attn_mask[..., start : start + chunk, :] if attn_mask.dim() >= 2 and attn_mask.shape[-2] == length else attn_mask
            logits = _mask(logits, mask.logical_not()) if mask.dtype == torch.bool else logits.add_(mask)
        if is_causal:
            rows = logits.shape[-2]
            logits = _mask(logits, torch.ones(rows, keys, dtype=torch.bool, device=logits.device).triu_(start + 1))
        found = logits.flatten(0, -4).amax(dim=(0, 2, 3)) if heads else logits.amax().reshape(1)
        best = found if best is None else torch.maximum(best, found)
    return best


def _mask(logits: Tensor, masked: Tensor) -> Tensor:
    """``logits`` with -inf where ``masked`` (in place). A mask smaller than the logits (the
    causal triangle, one mask for every head) is added as 0 or -inf, as SDPA adds a boolean
    mask: on a CPU, a ``masked_fill_`` through a broadcast mask costs about half the ``q·kᵀ``
    again, an add a tenth; a mask as large as the logits is filled directly."""
    if masked.numel() >= logits.numel():
        return logits.masked_fill_(masked, -torch.inf)
    return logits.add_(torch.zeros(masked.shape, dtype=logits.dtype, device=logits.device).masked_fill_(masked, -torch.inf))


def _may_call(module: nn.Module) -> bool:
    """Whether ``module``'s own forward may make an attention call: torch.nn's own modules make
    none, except ``nn.MultiheadAttention`` (their children's calls are their children's)."""
    cls = unsharded_type(module)
    return not cls.__module__.startswith("torch.nn.modules.") or issubclass(cls, nn.MultiheadAttention)


class _Mode(TorchFunctionMode):
    """Sees the attention calls of a forward (see the module's docstring)."""

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self._capture = capture
        self._heads: list[int | None] = []  # per MultiheadAttention call being run: its heads if need_weights

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = dict(zip(_SDPA, args), **kwargs)
            self._capture.saw(max_logits(call["query"], call["key"], call.get("attn_mask"), call.get("is_causal", False),
                                         call.get("scale"), call.get("enable_gqa", False)))
        elif func is F.multi_head_attention_forward:
            call = _MHA.bind(*args, **kwargs).arguments
            self._heads.append(call["num_heads"] if call.get("need_weights", True) else None)
            try:
                with self:  # its body's SDPA call or softmax is seen
                    return redispatch_function(func, types, args, kwargs)
            finally:
                self._heads.pop()
        elif func is F.softmax and self._heads and self._heads[-1] is not None:
            logits = args[0].detach()  # (batch * heads, queries, keys): as the softmax sees them
            self._capture.saw(logits.unflatten(0, (-1, self._heads[-1])).float().amax(dim=(0, 2, 3)))
            self._heads[-1] = None  # its only softmax
        return func(*args, **kwargs)


class AttentionCapture:
    """The attention-logit capture of one monitor.

    Args:
        modules: every module of the model outside (and not around) hidden code, by label: each that may make
            an attention call, and each of torch.nn's called by one, gets a forward pre-hook and a
            forward hook (:attr:`hooks`) that the monitor puts in on armed steps.
        reduce: the monitor's ``(kind, label, tensor, histogram)`` reduction.
        armed: whether the monitor is armed.
    """

    def __init__(self, modules: Mapping[str, nn.Module],
                 reduce: Callable[[Kind, str, Tensor, bool], None], armed: Callable[[], bool]) -> None:
        self._reduce = reduce
        self._armed = armed
        self._mode = _Mode(self)
        #: Whether the mode is entered (by a module's pre-hook, or again after a module that left it), and not left since.
        self.on = False
        # The modules whose forward runs, outermost first, each with whether its pre-hook entered the mode.
        self._running: list[tuple[str, bool]] = []
        self._seen: set[str] = set()  # modules a call belonged to, this armed step
        self._ran: set[str] = set()  # attention modules that ran, this armed step
        callers = {label: m for label, m in modules.items() if _may_call(m)}
        self._attention = {label for label, m in callers.items() if _ATTENTION.search(type(m).__name__)}
        self._said: set[str] = set()
        # Left while they run: torch.nn's modules that a module making calls calls (its children).
        inside = {id(m) for m in modules.values()}
        quiet = {id(child): child for m in callers.values() for child in m.children()
                 if id(child) in inside and not _may_call(child)}
        #: The hooks, forward hooks called also when the forward raises (``always_call``).
        self.hooks = [hook for label, m in callers.items()
                      for hook in ((m, True, functools.partial(self._enter, label)),
                                   (m, False, functools.partial(self._leave, label), True))]
        self.hooks += [hook for m in quiet.values()
                       for hook in ((m, True, self._pause), (m, False, self._resume, True))]
        self._paused: list[bool] = []  # per such module running: whether it left the mode

    def _enter(self, label: str, module: nn.Module, args: tuple) -> None:
        if not self._armed() or torch._C._current_graph_task_id() != -1:  # a recomputation in backward
            return
        entered = not self.on
        if entered:
            self._mode.__enter__()
            self.on = True
        self._running.append((label, entered))
        if label in self._attention:
            self._ran.add(label)

    def _leave(self, label: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self._running and self._running[-1][0] == label and self._running.pop()[1]:
            self._mode.__exit__(None, None, None)
            self.on = False

    def saw(self, maxima: Tensor) -> None:
        """A call's per-head maxima, for the innermost module running (none: not attributed)."""
        if self._running:
            label = self._running[-1][0]
            self._seen.add(label)
            self._reduce(Kind.ATTENTION_LOGIT, label, maxima, False)

    def _pause(self, module: nn.Module, args: tuple) -> None:
        ours = self.on and torch.overrides._get_current_function_mode() is self._mode
        if ours:
            self._mode.__exit__(None, None, None)
            self.on = False
        self._paused.append(ours)

    def _resume(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._paused and self._paused.pop():
            self._mode.__enter__()
            self.on = True

    @contextmanager
    def outside(self) -> Iterator[None]:
        """The mode left for the block (our own reductions in a forward hook), if it is the
        innermost mode; entered again after."""
        ours = self.on and torch.overrides._get_current_function_mode() is self._mode
        if ours:
            self._mode.__exit__(None, None, None)
        try:
            yield
        finally:
            if ours:
                self._mode.__enter__()

    def reset(self) -> None:
        """The armed step is over: name, once, the attention modules that ran without a call seen."""
        if self.on:  # a forward left without its forward hook (cannot happen with always_call)
            self._mode.__exit__(None, None, None)
            self.on = False
        self._running.clear()
        self._paused.clear()
        unseen = [label for label in sorted(self._ran) if label not in self._said
                  and not any(s == label or s.startswith(f"{label}.") or label == "(model)" for s in self._seen)]
        self._seen, self._ran = set(), set()
        if unseen:
            self._said.update(unseen)
            warnings.warn(
                "attention_logits: no F.scaled_dot_product_attention or nn.MultiheadAttention call was seen in "
                f"{', '.join(unseen)} on a logged step (eager attention, or a custom kernel such as flash-attn's), so "
                "their attention logits are not measured (their outputs and gradients are); with transformers, "
                "attn_implementation='sdpa' measures them",
                stacklevel=3,
            )
