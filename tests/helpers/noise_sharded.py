"""Fits a student of ``test_noise.models()`` at learning rate 0 with Lightning's
``ModelParallelStrategy`` on two CPU processes (gloo), every step logged.

Run by ``tests/core/test_noise.py`` as ``python noise_sharded.py OUT_DIR MODE:NAME,MODE:NAME...``, each
fit into ``OUT_DIR/MODE-NAME``, one after the other in one pair of processes: MODE ``fsdp2``
(``fully_shard``, data parallel 2, 16 examples a rank) or ``tp`` (tensor parallel 2: the first
Linear column-wise, the last row-wise; both ranks see the same 32 examples); NAME ``linear`` or
``mlp``; ``ddp:mlp``: :func:`noise_ddp.fit`. Lightning starts rank 1 by running this script again. Rank 0 writes the events and
``facts.json``: the noise probe's ``all_reduce`` calls and the logged steps.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from gloo_exit import finish
from lightning_gradhooks import GradHooks
import noise_ddp
from noise_ddp import trainer
from test_noise import Fit, models

STEPS = 16


class Sharded(Fit):
    def __init__(self, model, mode: str) -> None:  # noqa: ANN001
        super().__init__(model)
        self.mode = mode

    def configure_model(self) -> None:
        linears = [m for m in self.model.modules() if type(m).__name__ == "Linear"]
        if self.mode == "fsdp2":
            for module in [*linears, self.model] if len(linears) > 1 else [self.model]:
                fully_shard(module, mesh=self.device_mesh["data_parallel"])
            return
        mesh = self.device_mesh["tensor_parallel"]
        if len(linears) == 1:  # Linear(6, 1): its inputs split between the ranks
            parallelize_module(self.model, mesh, RowwiseParallel(input_layouts=Replicate()))
        else:
            parallelize_module(self.model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def fit(out: Path, mode: str, name: str) -> None:
    out.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model, x, y = models()[name]
    gradhooks = GradHooks(every_n_steps=1, histograms=False, compile_statistics=False)  # eager: see ddp_train.py
    fsdp = mode == "fsdp2"
    run = trainer(out, ModelParallelStrategy(data_parallel_size=2 if fsdp else 1, tensor_parallel_size=1 if fsdp else 2,
                                             timeout=timedelta(seconds=60)), gradhooks, STEPS)
    # FSDP2: each rank its own half, shuffled (a DistributedSampler); TP: both ranks the same batches
    run.fit(Sharded(model, mode), DataLoader(TensorDataset(x, y), batch_size=16 if fsdp else 32, shuffle=True))


def main() -> None:
    out = Path(sys.argv[1])
    for run in sys.argv[2].split(","):
        mode, name = run.split(":")
        if mode == "ddp":
            noise_ddp.fit(out / f"{mode}-{name}")
        else:
            fit(out / f"{mode}-{name}", mode, name)
    finish()


if __name__ == "__main__":
    main()
