"""What the ``GradHooks`` shell reads off a Lightning ``Trainer``: its loggers, the AMP scale, a
batch's size, the parameters no optimizer holds, and what to say about the loggers at fit start.
Stateless functions; they work with either Lightning namespace (``pytorch_lightning`` or
``lightning.pytorch``), whichever the trainer comes from."""

from __future__ import annotations

import logging
import sys
from typing import Any

from lightning_gradhooks.log.updates import unheld, unwrapped


def tensorboard_loggers(trainer: Any) -> list[Any]:
    """The TensorBoardLoggers of the trainer, from whichever Lightning namespace is in use."""
    classes = tuple(
        sys.modules[f"{namespace}.loggers"].TensorBoardLogger
        for namespace in ("pytorch_lightning", "lightning.pytorch")
        if f"{namespace}.loggers" in sys.modules
    )
    return [lg for lg in trainer.loggers if isinstance(lg, classes)]


def writers(trainer: Any) -> list[Any]:
    """Where rank 0 writes: the SummaryWriters of the TensorBoard loggers (events), then the
    other loggers (scalars); nothing on other ranks or in ``fast_dev_run``."""
    if not trainer.is_global_zero or trainer.fast_dev_run:
        return []
    tensorboards = tensorboard_loggers(trainer)
    return [lg.experiment for lg in tensorboards] + [lg for lg in trainer.loggers if lg not in tensorboards]


def logger_warning(trainer: Any) -> str | None:
    """What to tell a user whose loggers cannot show everything; None when there is nothing to say."""
    if trainer.fast_dev_run:
        return None  # Lightning has switched logging off
    if not trainer.loggers:
        return ("GradHooks found no logger (`Trainer(logger=False)`?): no statistics, histograms or gradient-flow "
                "picture are written; the health report is still printed at the end of fit.")
    if tensorboard_loggers(trainer):
        return None
    wandb = any(type(lg).__name__ == "WandbLogger" for lg in trainer.loggers)
    return ("GradHooks found no TensorBoardLogger in `trainer.loggers`: the gradient-flow picture is not drawn"
            + (" (W&B gets the scalars, histograms and the report)." if wandb else
               ", histograms and the report's Text tab are not written, and the other loggers get the overview "
               "and the norms only; add a TensorBoardLogger (or a WandbLogger) to get them."))


def loss_scale(trainer: Any) -> float | None:
    """The gradient scaler's current scale under ``precision="16-mixed"``, else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def inverse_scale(trainer: Any, optimizer: Any) -> Any:
    """What ``optimizer``'s gradients are still to be multiplied by before its step, as a device
    tensor never read on the host: the scaler's inverse scale for an optimizer that unscales in
    its own step (Lightning unscales the others before ``on_before_optimizer_step``), else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled() or not optimizer_unscales(optimizer):
        return None
    scale = scaler._get_scale_async()  # the scale tensor; `get_scale()` would read it on the host
    return None if scale is None else scale.double().reciprocal()


def gradient_dtype(trainer: Any) -> Any:
    """The dtype of the gradients the hooks see under the trainer's precision: ``torch.bfloat16``
    or ``torch.float16`` for the mixed and true half precisions, None for float32 (or wider)."""
    import torch

    precision = str(getattr(trainer, "precision", ""))
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None


def optimizer_unscales(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales its gradients inside its own ``step()`` (fused Adam and
    AdamW, ``_step_supports_amp_scaling``): Lightning then skips ``scaler.unscale_`` before
    ``on_before_optimizer_step``, and ``.grad`` there is still multiplied by the loss scale."""
    return bool(getattr(unwrapped(optimizer), "_step_supports_amp_scaling", False))


def batch_size(batch: Any) -> int | None:
    """Examples in a batch, as Lightning counts them for logging; None when it cannot tell."""
    from pytorch_lightning.utilities.data import extract_batch_size

    try:
        return extract_batch_size(batch)
    except Exception:  # MisconfigurationException: no tensor in the batch
        return None


def unowned(trainer: Any, pl_module: Any) -> list[Any]:
    """Trainable parameters that no optimizer of the trainer holds (a head left out of
    ``configure_optimizers``): they get gradients and never move."""
    return [p for _, p in unheld(pl_module.named_parameters(), trainer.optimizers) if p.requires_grad]


def optimizer_params(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def echo(trainer: Any, callback: Any) -> Any:
    """How the report is printed: through the progress bar (above it, once), else Lightning's log."""
    bar = trainer.progress_bar_callback
    return bar.print if bar is not None and getattr(bar, "is_enabled", True) else logger_of(callback).info


def logger_of(callback: Any) -> logging.Logger:
    """A logger under the Lightning namespace of ``callback``'s class, which prints at INFO level."""
    lightning_pytorch = any(c.__module__.startswith("lightning.pytorch") for c in type(callback).__mro__)
    return logging.getLogger(f"{'lightning.pytorch' if lightning_pytorch else 'pytorch_lightning'}.callbacks.gradhooks")
