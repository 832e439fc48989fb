"""Trains a small model with Lightning's ``ModelParallelStrategy`` on CPU (gloo, two processes).

Run by ``tests/shell/test_sharded.py`` as ``python sharded_train.py OUT_DIR MODE,MODE...``, each
mode into ``OUT_DIR/MODE``, one after the other in one pair of processes: ``fsdp2``
(``fully_shard`` in ``configure_model``, data parallel 2, ``sync_dist=True``, offload on) or
``tp`` (``ColwiseParallel``/``RowwiseParallel``, tensor parallel 2, ``sync_dist=False``).
Lightning starts rank 1 by running this script again. Each rank saves the batches it trained
on, the gradient of ``net.0``'s output, the collectives made inside GradHooks' logging, and
the hooks left on the model. With ``fsdp2``, the script then trains a plain ``fully_shard``
model with and without ``save_on_disk`` and records whether the results are bitwise equal.
``fp16``: :func:`sharded_fp16.fit`.
"""

import functools
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import sharded_fp16
from gloo_exit import finish
from lightning_gradhooks import GradHooks, save_on_disk

STEPS = 3
COLLECTIVES = {
    dist: ["all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
           "all_to_all", "gather", "scatter", "reduce", "barrier"],
    funcol: ["all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single"],
}


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class Net(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = build()

    def configure_model(self) -> None:
        if self.mode == "fsdp2":
            mesh = self.device_mesh["data_parallel"]
            for module in (self.net[0], self.net[2], self.net):
                fully_shard(module, mesh=mesh)
        else:
            mesh = self.device_mesh["tensor_parallel"]
            parallelize_module(self.net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def hooks_on(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()]


class Reference(pl.Callback):
    """What each rank trained on and saw, and what GradHooks did on it."""

    def __init__(self, out: Path, gradhooks: GradHooks) -> None:
        self.out, self.gradhooks = out, gradhooks
        self.batches, self.grads, self.collectives = [], [], []
        self.counting = False

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001
        self.hooks_before = hooks_on(pl_module)

        def forward_hook(module, args, output):  # noqa: ANN001, ANN202
            output.register_hook(lambda grad: self.grads.append(grad.clone()))

        self.handle = pl_module.net[0].register_forward_hook(forward_hook)
        # Count the collectives made while GradHooks logs a step.
        for module, names in COLLECTIVES.items():
            for name in (n for n in [*names, "all_gather_single"] if hasattr(module, n)):
                setattr(module, name, self._counted(getattr(module, name)))
        original = self.gradhooks.on_before_optimizer_step

        def logging(*args):  # noqa: ANN002, ANN202
            self.counting, before = True, self.calls
            try:
                original(*args)
            finally:
                self.counting = False
                self.collectives.append(self.calls - before)

        self.calls = 0
        self.gradhooks.on_before_optimizer_step = logging

    def _counted(self, function):  # noqa: ANN001, ANN202
        @functools.wraps(function)
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.counting:
                self.calls += 1
            return function(*args, **kwargs)

        return wrapper

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self.batches.append([t.clone() for t in batch])

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        self.handle.remove()
        rank = trainer.global_rank
        torch.save({"batches": self.batches, "grads": self.grads}, self.out / f"seen-rank{rank}.pt")
        self.facts = {"collectives": self.collectives, "gathers": self.gradhooks.gradient_log.collectives}

    def teardown(self, trainer, pl_module, stage):  # noqa: ANN001
        self.facts["hooks_left"] = hooks_on(pl_module) != self.hooks_before
        self.facts["offload_dir"] = self.gradhooks.offload_dir
        (self.out / f"facts-rank{trainer.global_rank}.json").write_text(json.dumps(self.facts))


def offload_is_transparent(out: Path) -> dict:
    """Plain FSDP2 steps with and without save_on_disk: bitwise equal, parameters never written."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results, written = [], []
    for offload in (None, save_on_disk(threshold_bytes=12 << 10, directory=str(out))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        for batch in (32, 64, 64):  # 8 KiB activations stay; 16 KiB ones (and weights) would go
            x = torch.randn(batch, 64, generator=g)
            with offload or torch.enable_grad():
                loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if offload is not None:
                written.append(offload.stats().bytes_offloaded)
        results.append([p.to_local().clone() for p in model.parameters()])
        if offload is not None:
            offload.close()
    equal = all(torch.equal(a, b) for a, b in zip(*results))
    return {"offload_equal": equal, "offload_written": written}


def fit(out: Path, mode: str) -> None:
    out.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    offload = {"offload_threshold_bytes": 256, "offload_dir": str(out / "offload")} if mode == "fsdp2" else {}
    gradhooks = GradHooks(every_n_steps=1, statistics=["norm", "mean", "std", "absmax"], sync_dist=mode == "fsdp2",
                          histogram_every_n_steps=1, compile_statistics=False, **offload)  # eager: see ddp_train.py
    (out / "offload").mkdir(exist_ok=True)
    strategy = ModelParallelStrategy(
        data_parallel_size=2 if mode == "fsdp2" else 1,
        tensor_parallel_size=1 if mode == "fsdp2" else 2,
        timeout=timedelta(seconds=60),
    )
    reference = Reference(out, gradhooks)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=TensorBoardLogger(str(out), name="logs"),
        callbacks=[gradhooks, reference],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(mode), DataLoader(data, batch_size=8))
    if mode == "fsdp2":
        facts_file = out / f"facts-rank{trainer.global_rank}.json"
        facts = json.loads(facts_file.read_text())
        facts.update(offload_is_transparent(out / "offload"))
        facts_file.write_text(json.dumps(facts))


def main() -> None:
    out = Path(sys.argv[1])
    for mode in sys.argv[2].split(","):
        if mode == "fp16":
            sharded_fp16.fit(out / mode)
        else:
            fit(out / mode, mode)
    finish()


if __name__ == "__main__":
    main()
