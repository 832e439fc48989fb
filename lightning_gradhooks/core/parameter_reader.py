"""The parameter gradients of a :class:`~lightning_gradhooks.GradientMonitor`'s chosen modules:
which parameters they are (looked up at every read: sharding replaces parameters), which are
sharded, and their gradients reduced into a :class:`~lightning_gradhooks.core.step_buffer.StepBuffer`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

import lightning_gradhooks.core._shards as _shards
from lightning_gradhooks.core.step_buffer import StepBuffer
from lightning_gradhooks.summary.records import GradientRecord, Kind

__all__ = ["ParameterReader"]


class ParameterReader:
    """Reads the gradients of the chosen modules' own trainable parameters.

    Args:
        model: the model (its FSDP1 flat parameters are found from it).
        modules: the chosen modules, by qualified name.
        on: False: no parameter is read (``GradientMonitor(parameters=False)``).
    """

    def __init__(self, model: nn.Module, modules: Mapping[str, nn.Module], on: bool) -> None:
        self._model, self._modules, self._on = model, modules, on
        #: Chosen parameters that gave no entry at the last read, with the reason.
        self.skipped: dict[str, str] = {}

    @property
    def parameters(self) -> dict[str, nn.Parameter]:
        """The chosen modules' own trainable parameters by qualified name, as they are now (a
        tied parameter once, under its first name)."""
        found: dict[str, nn.Parameter] = {}
        if self._on:
            seen: set[int] = set()
            for name, module in self._modules.items():
                for pname, param in module._parameters.items():  # named_parameters(recurse=False), faster
                    if param is not None and param.requires_grad and id(param) not in seen:
                        seen.add(id(param))
                        found[f"{name}.{pname}" if name else pname] = param
        return found

    def sharded(self, parameters: dict[str, nn.Parameter]) -> list[str]:
        """The names of ``parameters`` whose gradient each rank holds a piece of."""
        views, _ = _shards.fsdp1_sharded(self._model)
        return [n for n, p in parameters.items() if id(p) in views or (type(p) is not nn.Parameter and _shards.is_dtensor(p))]

    def read(self, buffer: StepBuffer, wanted: Iterable[Tensor] | None, histograms: bool) -> dict[str, nn.Parameter]:
        """Reduce the chosen parameters' gradients (those in ``wanted`` only, if given) into
        ``buffer``; returns every chosen parameter, by name."""
        wanted_ids = None if wanted is None else {id(p) for p in wanted}
        views, flat = _shards.fsdp1_sharded(self._model)
        self.skipped = {"(FSDP1 flat parameters)": _shards.FLAT} if flat else {}
        chosen = self.parameters
        by_device: dict[torch.device, tuple[list[str], list[Tensor]]] = {}  # one Reducer call per device
        for name, piece, reason in _shards.pieces(chosen, views, wanted_ids):
            if reason is not None:
                self.skipped[name] = reason
            elif piece is not None and piece.is_floating_point():
                names, grads = by_device.setdefault(piece.device, ([], []))
                names.append(name)
                grads.append(piece)
        for names, grads in by_device.values():
            buffer.extend(Kind.PARAM_GRAD, names, grads, histograms)
        return chosen

    def described(self, record: GradientRecord, parameters: dict[str, nn.Parameter], bins: int) -> GradientRecord:
        """The record with what the log needs to know of the parameters (see :class:`GradientRecord`)."""
        record.parameters, record.skipped, record.bins = parameters, dict(self.skipped), bins
        record.sharded = tuple(self.sharded(parameters))  # the parameters just looked up, not again
        return record
