"""lightning_gradhooks: see inside the backward pass of PyTorch Lightning training.

``GradHooks`` is the Lightning callback, a thin shell over three plain-PyTorch pieces that work
in any training loop and never import Lightning: ``GradientMonitor`` (the core: hooks and
statistics), ``GradientLog`` (everything after: TensorBoard, update ratios, the flow picture,
the health report) and ``save_on_disk`` (disk offload of saved activations).
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gradhooks.core.monitor import GradientMonitor
from lightning_gradhooks.core.records import GradientEntry, GradientRecord, Kind
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk
from lightning_gradhooks.core.stats import STATISTICS, StatsRow

if TYPE_CHECKING:
    from lightning_gradhooks.shell.callback import GradHooks
    from lightning_gradhooks.health import HealthReport, Thresholds
    from lightning_gradhooks.log import GradientLog

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
    "GradHooks": "lightning_gradhooks.shell.callback",
    "GradientLog": "lightning_gradhooks.log",
    "HealthReport": "lightning_gradhooks.health",
    "Thresholds": "lightning_gradhooks.health",
}


def __getattr__(name: str) -> Any:
    # The callback (and with it Lightning) and the TensorBoard writers are imported only when
    # asked for, so that users of the core never pay for importing Lightning or TensorBoard.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
