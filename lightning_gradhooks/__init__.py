"""lightning_gradhooks: see inside the backward pass of PyTorch Lightning training.

``GradHooks`` is the Lightning callback; ``GradientMonitor`` and ``save_on_disk`` are the
plain-PyTorch core it builds on, which works in any training loop and never imports Lightning.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gradhooks.monitor import GradientMonitor
from lightning_gradhooks.records import GradientEntry, GradientRecord
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk
from lightning_gradhooks.stats import STATISTICS

if TYPE_CHECKING:
    from lightning_gradhooks._tensorboard import write_record
    from lightning_gradhooks.callback import GradHooks

__all__ = [
    "STATISTICS",
    "DiskOffloadError",
    "GradHooks",
    "GradientEntry",
    "GradientMonitor",
    "GradientRecord",
    "save_on_disk",
    "write_record",
]
__version__ = "0.1.0"


_LAZY = {"GradHooks": "lightning_gradhooks.callback", "write_record": "lightning_gradhooks._tensorboard"}


def __getattr__(name: str) -> Any:
    # The callback (and with it Lightning) and the TensorBoard writer are imported only when
    # asked for, so that users of the plain-PyTorch core never pay for importing Lightning.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
