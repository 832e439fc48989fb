"""lightning_gradhooks: see inside the backward pass of PyTorch Lightning training.

``GradHooks`` is the Lightning callback, a thin shell over three plain-PyTorch pieces that work
in any training loop and never import Lightning: ``GradientMonitor`` (the core: hooks and
statistics), ``GradientLog`` (everything after: TensorBoard, update ratios, the flow picture,
the health report) and ``save_on_disk`` (disk offload of saved activations).
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gradhooks.summary.records import GradientEntry, GradientRecord, Kind
from lightning_gradhooks.summary.statistics import STATISTICS, StatsRow

if TYPE_CHECKING:
    from lightning_gradhooks.core.monitor import GradientMonitor
    from lightning_gradhooks.health import HealthReport, Thresholds
    from lightning_gradhooks.log import GradientLog
    from lightning_gradhooks.offload import DiskOffloadError, save_on_disk
    from lightning_gradhooks.shell.callback import GradHooks

__all__ = [
    "STATISTICS",
    "DiskOffloadError",
    "GradHooks",
    "GradientEntry",
    "GradientLog",
    "GradientMonitor",
    "GradientRecord",
    "HealthReport",
    "Kind",
    "StatsRow",
    "Thresholds",
    "save_on_disk",
]
__version__ = "0.1.0"


_LAZY = {
    "DiskOffloadError": "lightning_gradhooks.offload",
    "GradHooks": "lightning_gradhooks.shell.callback",
    "GradientMonitor": "lightning_gradhooks.core.monitor",
    "GradientLog": "lightning_gradhooks.log",
    "HealthReport": "lightning_gradhooks.health",
    "Thresholds": "lightning_gradhooks.health",
    "save_on_disk": "lightning_gradhooks.offload",
}


def __getattr__(name: str) -> Any:
    # What needs torch, Lightning or TensorBoard is imported only when asked for: the report
    # command and the health package stand on the torch-free summary layer alone.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
