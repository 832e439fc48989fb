"""FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``, 2 gloo ranks on the CPU) under
fp16 autocast with FSDP2's ``ShardedGradScaler``, whose scale starts too high (2^24): rank 0
writes the report it printed to ``OUT/report.txt``. Run by ``tests/shell/test_sharded.py`` through
``python sharded_train.py OUT_DIR fp16`` (:func:`fit`)."""

from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for module in (self.net[0], self.net[2], self.net[4], self.net):
            fully_shard(module, mesh=mesh)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def fit(out: Path) -> None:
    out.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    gradhooks = GradHooks(every_n_steps=1, sync_dist=True, histograms=False, noise_scale=False,
                          compile_statistics=False)  # eager: see ddp_train.py
    scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 24)
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=60)),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], accelerator="cpu", devices=2, max_steps=12,
        logger=TensorBoardLogger(str(out), name="logs"), callbacks=[gradhooks], enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=16))
    if trainer.global_rank == 0:
        (out / "report.txt").write_text(gradhooks.gradient_log.report.table())
        (out / "log_dir.txt").write_text(trainer.logger.log_dir)
