"""What a :class:`~lightning_gradhooks.GradientMonitor` puts in the modules and what it pauses, each
with one owner: :class:`MonitorHandle` (every module hook; parked between logged steps, removed
for good once), :class:`CollectorPause` (Python's cyclic collector during an armed step) and
:class:`ArmedStep` (what ``arm()`` returns: a ``with`` block that disarms on leaving)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ArmedStep", "CollectorPause", "Hook", "MonitorHandle"]

#: A module hook: the module, whether it is a forward pre-hook, the hook (and, for a forward hook
#: that must run also when the forward raises, True).
Hook = tuple[nn.Module, bool, Callable] | tuple[nn.Module, bool, Callable, bool]


class CollectorPause:
    """Switches Python's cyclic garbage collector off, and back on only if it switched it off:
    a collector the user switched off stays off. Objects freed by reference counting are freed
    as always; only collecting reference cycles waits. Each monitor has one, the only owner of
    the pause in the library (:meth:`GradientMonitor.arm`)."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            gc.enable()


class MonitorHandle:
    """Removes every hook a :class:`GradientMonitor` attached; idempotent; a context manager.

    While the monitor is not armed its hooks are *parked*: removed from the modules, so a step
    that is not logged runs exactly as without the monitor.
    """

    def __init__(self, on_remove: Callable[[], None] = lambda: None) -> None:
        self._handles: list[RemovableHandle] = []
        self._on_remove = on_remove
        self.active = True

    def put(self, hooks: Sequence[Hook]) -> None:
        """Register hooks on their modules, until :meth:`park`."""
        handles = self._handles
        for module, pre, hook, *always in hooks:  # a fourth item True: a forward hook called also on an exception
            if pre:
                handles.append(module.register_forward_pre_hook(hook))
            else:
                handles.append(module.register_forward_hook(hook, always_call=bool(always)))

    def park(self) -> None:
        """Remove every hook from the modules; the monitor registers them again when armed."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def remove(self) -> None:
        """Take every hook out for good, and disarm the monitor."""
        self.active = False
        self.park()
        self._on_remove()

    def __enter__(self) -> MonitorHandle:
        return self

    def __exit__(self, *args: object) -> None:
        self.remove()


class ArmedStep:
    """What :meth:`GradientMonitor.arm` returns: a ``with`` block pauses the cyclic garbage
    collector while it runs and disarms on leaving, also by an exception."""

    def __init__(self, monitor: Any, collector: CollectorPause | None) -> None:  # the monitor: what `with` gives
        self._monitor = monitor
        self._collector = collector  # None: arm(when=False), a block that does nothing

    def __enter__(self) -> Any:
        if self._collector is not None:
            self._collector.pause()
        return self._monitor

    def __exit__(self, *args: Any) -> None:
        if self._collector is not None:
            self._monitor.disarm()  # switches the collector back on too
