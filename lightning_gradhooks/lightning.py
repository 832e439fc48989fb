"""``GradHooks`` for the ``lightning.pytorch`` namespace (``pip install lightning``).

``lightning.pytorch`` and ``pytorch_lightning`` are separate class hierarchies: each Trainer
rejects the other's callbacks. Both classes share all their logic in
:class:`~lightning_gradhooks.shell.callback.GradHooksLogic`::

    from lightning.pytorch import Trainer
    from lightning_gradhooks.lightning import GradHooks
"""

import lightning.pytorch

from lightning_gradhooks.shell.callback import GradHooksLogic

__all__ = ["GradHooks"]


class GradHooks(GradHooksLogic, lightning.pytorch.Callback):
    __doc__ = GradHooksLogic.__doc__
