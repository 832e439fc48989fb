"""lightning_gradhooks: see inside the backward pass of PyTorch Lightning training.

``GradHooks`` is the Lightning callback; ``GradientMonitor`` and ``save_on_disk`` are the
plain-PyTorch core it builds on, which works in any training loop and never imports Lightning.
"""

from typing import TYPE_CHECKING, Any

from lightning_gradhooks.monitor import GradientEntry, GradientMonitor, GradientRecord
from lightning_gradhooks.offload import DiskOffloadError, save_on_disk
from lightning_gradhooks.stats import STATISTICS

if TYPE_CHECKING:
    from lightning_gradhooks.callback import GradHooks

__all__ = [
    "STATISTICS",
    "DiskOffloadError",
    "GradHooks",
    "GradientEntry",
    "GradientMonitor",
    "GradientRecord",
    "save_on_disk",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The callback (and with it Lightning) is imported only when asked for, so that plain
    # PyTorch and Fabric users of the core never pay for importing Lightning.
    if name == "GradHooks":
        from lightning_gradhooks.callback import GradHooks

        return GradHooks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
