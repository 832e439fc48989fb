"""Runs that end badly, for tests/offload/test_offload_signals.py. ``python tests/helpers/offload_victim.py MODE DIR``:

- ``kill``: a Lightning fit offloading to DIR prints ``READY <bytes written>`` in the middle of
  step 2 (graph alive, everything on disk) and sleeps; the test kills it with SIGKILL.
- ``ddp_fork``: the same under ``strategy="ddp_fork"`` on two CPU processes; each worker prints
  ``READY`` mid-step and leaves through ``os._exit``, as a failing forked worker does.
- ``lightning_sigint``: a Lightning fit that would run for hours prints ``READY`` at step 1;
  the test presses Ctrl-C once, and Lightning's graceful shutdown must end it.
- ``sigint``: a plain loop under ``save_on_disk`` that counts the KeyboardInterrupts it catches,
  printing ``CAUGHT <n>`` for each, until 40; then, after ``flush()``,
  ``DONE <files open> <bytes pending>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn



def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])


def sigint_loop(folder: str) -> None:
    from lightning_gradhooks.offload import save_on_disk

    # Small budgets, so that interrupts also land while the forward waits for the writer and
    # the backward waits for the reader.
    offload = save_on_disk(1 << 16, folder, max_bytes_in_flight=1 << 20, prefetch_bytes=1 << 20)
    model, x = mlp(), torch.randn(512, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    caught = 0
    print("START", flush=True)
    while caught < 40:
        try:
            while True:
                optimizer.zero_grad()
                with offload:
                    loss = model(x).square().mean()
                loss.backward()
                optimizer.step()
                loss = None
        except KeyboardInterrupt:
            loss = None
            caught += 1
            print(f"CAUGHT {caught}", flush=True)
    # A write the last interrupt left running may still be on its way to disk: flush waits for
    # it, and would hang (the test times out) if an interrupt had left bytes counted forever.
    offload.flush()
    stats = offload.stats()
    offload.close()
    print(f"DONE {stats.files_on_disk} {stats.bytes_pending_write}", flush=True)


def lightning_fit(folder: str, ddp_fork: bool, forever: bool = False) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradhooks import GradHooks

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = self.net(batch[0]).square().mean()
            if forever:
                if self.global_step == 1:
                    print("READY", flush=True)
                return loss
            if self.global_step == 2:
                offload = next(c for c in self.trainer.callbacks if isinstance(c, GradHooks)).offload
                offload.flush()
                print(f"READY {offload.stats().bytes_on_disk}", flush=True)  # this step's files
                if ddp_fork:
                    os._exit(3)  # what a forked worker does when it fails
                time.sleep(120)
            return loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(torch.randn(4096, 256)), batch_size=1024)
    trainer = pl.Trainer(
        max_steps=10**6 if forever else 4, max_epochs=-1, accelerator="cpu", devices=2 if ddp_fork else 1, strategy="ddp_fork" if ddp_fork else "auto",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        # Eager statistics: the signal tests' time limits leave no room for a compile at step 0.
        callbacks=[GradHooks(offload_threshold_bytes=1 << 16, offload_dir=folder, compile_statistics=False)],
    )
    trainer.fit(Model(), data)


if __name__ == "__main__":  # imported (pytest's doctest collection), it runs nothing
    mode, folder = sys.argv[1], sys.argv[2]
    # What the tests press is Python's Ctrl-C: a process started in the background by a shell
    # without job control ignores SIGINT, and so would this one if it kept what it inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode == "sigint":
        sigint_loop(folder)
    else:
        lightning_fit(folder, ddp_fork=mode == "ddp_fork", forever=mode == "lightning_sigint")
