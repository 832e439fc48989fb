"""Compiled models on logged steps: run eagerly, so that every module is seen.

Module hooks inside code compiled by ``torch.compile`` would break its graph (and leave the
broken code in Dynamo's cache). So a :class:`~lightning_gradhooks.GradientMonitor` runs the armed
step of a compiled model eagerly, with torch's public ``torch.compiler.set_stance("force_eager")``,
from :meth:`~lightning_gradhooks.GradientMonitor.arm` to :meth:`~lightning_gradhooks.GradientMonitor.collect`
(or ``disarm``, the end of a ``with monitor.arm():`` block, ``remove``): the compiled code is
skipped, not recompiled, and the hooks see every module as they do uncompiled. The stance in
force before is restored after the step, also when the step raises. Steps that are not armed run
the user's compiled code untouched: nothing of ours is in the modules, no stance is set, no
graph of ours is compiled (the statistics of a compiled model are reduced with eager ops).

:class:`CompiledCode` says, once per monitor, what stays hidden even so, and why:

- with ``eager_logged_steps=False``, modules in compiled code (parameter gradients only);
- modules in CUDA graphs the user captured (``torch.cuda.make_graphed_callables``): the graph is
  replayed without running their forward;
- a user's Dynamo setting under which an eager step still compiles:
  ``torch._dynamo.config.compiled_autograd`` (compiled code compiles its backward, and our
  gradient hooks with it, whatever the stance), so logged steps keep their compiled code.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_gradhooks.core.planning import _compiled_modules

__all__ = ["COMPILED", "FORCED", "GRAPHED", "CompiledCode"]

#: Why a module gets no hook: its compiled code runs on logged steps too.
COMPILED = "in compiled code that logged steps run (eager_logged_steps=False): a hook would split the compiled graph"
#: ... because a Dynamo setting of the user's compiles it whatever the stance.
FORCED = "in compiled code that logged steps run ({}): a hook would split the compiled graph"
#: Why a module gets no hook: a CUDA graph the user captured replays it.
GRAPHED = "in a CUDA graph captured by torch.cuda.make_graphed_callables: replayed without its forward"


def _graphed(model: nn.Module) -> set[int]:
    """Ids of the modules in callables of ``torch.cuda.make_graphed_callables`` (which replaces a
    module's ``forward`` with one that replays its graph) and of their submodules."""
    roots = [m for m in model.modules()
             if getattr(m.__dict__.get("forward"), "__qualname__", "").startswith("make_graphed_callables.<locals>")]
    return {id(sub) for root in roots for sub in root.modules()}


def forcing_settings() -> list[str]:
    """The user's Dynamo settings under which a step run with ``set_stance("force_eager")`` would
    still compile: ``compiled_autograd`` compiles the backward of compiled code whatever the stance."""
    return ["torch._dynamo.config.compiled_autograd"] if getattr(torch._dynamo.config, "compiled_autograd", False) else []


class CompiledCode:
    """What of ``model`` runs compiled, how its logged steps run, and the stance they run under.

    Args:
        model: the monitored model.
        eager: run armed steps of a compiled model eagerly (``eager_logged_steps``).

    Attributes:
        compiled: ids of the modules in code compiled by ``torch.compile``.
        hidden: ids of the modules that get no hook (parameter gradients only), each with why.
        eager: whether armed steps enter ``set_stance("force_eager")``.
        notes: what cannot be seen and why, said once by the monitor.
    """

    def __init__(self, model: nn.Module, eager: bool = True) -> None:
        self.compiled = _compiled_modules(model)
        self.notes: list[str] = []
        forcing = forcing_settings() if self.compiled else []
        stance = getattr(torch.compiler, "set_stance", None)
        self.eager = eager and bool(self.compiled) and not forcing and stance is not None
        if self.compiled and eager and not self.eager:
            why = f"{', '.join(forcing)} is set: its backward compiles whatever the stance" if forcing \
                else "this torch has no torch.compiler.set_stance (torch >= 2.6)"
            self.notes.append(f"logged steps run compiled: {why}")
        why = FORCED.format(", ".join(forcing)) if forcing else COMPILED
        self.hidden: dict[int, str] = {} if self.eager else dict.fromkeys(self.compiled, why)
        self.hidden.update(dict.fromkeys(_graphed(model), GRAPHED))
        self._stance = None  # the set_stance object while entered: its __exit__ restores the stance before

    def hidden_by_reason(self, labels: Mapping[str, nn.Module]) -> dict[str, list[str]]:
        """The labels of the hidden modules among ``labels``, by reason."""
        found: dict[str, list[str]] = {}
        for label, module in labels.items():
            if id(module) in self.hidden:
                found.setdefault(self.hidden[id(module)], []).append(label)
        return found

    def enter(self) -> None:
        """Run what follows eagerly (compiled code skipped, not recompiled), until :meth:`leave`."""
        if self.eager and self._stance is None:
            self._stance = torch.compiler.set_stance("force_eager")  # set now; its __exit__ restores the one before

    def leave(self) -> None:
        """Restore the stance in force before :meth:`enter`; idempotent."""
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)
