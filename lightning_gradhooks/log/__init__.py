"""The log: everything after ``GradientMonitor.collect()``, Lightning-free.

``gradient_log`` holds :class:`GradientLog`, which calls the units around it: ``writers`` (the
one way a step reaches every writer), ``_tensorboard`` (events and tags), ``flow`` (the
gradient-flow picture and the custom-scalars layout), ``updates`` (update ratios from the
optimizers' step hooks) and ``distributed`` (pooling over ranks).
"""

from lightning_gradhooks.log.gradient_log import (
    DEFAULT_HISTOGRAM_EVERY_N_STEPS,
    DEFAULT_STATISTICS,
    LOGGED_STATISTICS,
    UPDATE_STATISTICS,
    GradientLog,
    LoggedStatistic,
)

__all__ = [
    "DEFAULT_HISTOGRAM_EVERY_N_STEPS",
    "DEFAULT_STATISTICS",
    "LOGGED_STATISTICS",
    "UPDATE_STATISTICS",
    "GradientLog",
    "LoggedStatistic",
]
