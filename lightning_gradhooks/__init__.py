"""lightning_gradhooks: see inside the backward pass of PyTorch Lightning training.

``GradHooks`` is the Lightning callback; ``GradientMonitor`` is the plain-PyTorch core it builds
on, which works in any training loop.
"""

from lightning_gradhooks.callback import GradHooks
from lightning_gradhooks.monitor import GradientEntry, GradientMonitor, GradientRecord
from lightning_gradhooks.stats import STATISTICS

__all__ = ["GradHooks", "GradientEntry", "GradientMonitor", "GradientRecord", "STATISTICS"]
__version__ = "0.1.0"
