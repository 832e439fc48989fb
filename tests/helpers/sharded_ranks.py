"""Plain ``torch.distributed`` on CPU (gloo, two processes): FSDP1 views, HSDP on a 2-D mesh
(replicated across one dim, sharded across the other) and a Partial gradient.

Run by ``tests/shell/test_sharded.py`` as ``python sharded_ranks.py OUT_DIR``; starts both ranks
with ``torch.multiprocessing``. Rank ``r`` writes ``OUT_DIR/ranks-r.json``: the pooled
parameter entries of each step, the batches it trained on, and what the monitor skipped.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate

from gloo_exit import finish
from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.log.distributed import RankReducer

STEPS = 2


def fsdp1(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    wrapped = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    monitor = GradientMonitor(wrapped, compile_statistics=False)  # eager: see ddp_train.py
    reducer = RankReducer(monitor.bins, hooks=False)
    g = torch.Generator().manual_seed(rank)
    steps, batches = [], []
    with monitor.attach():
        for _ in range(STEPS):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
            batches.append([x.tolist(), y.tolist()])
            with monitor.arm():
                nn.functional.cross_entropy(wrapped(x), y).backward()
                record = reducer.reduce(monitor.collect(), monitor.sharded)
            steps.append(entries(record))
            optimizer.step()
            optimizer.zero_grad()
    local = {n: p.numel() for n, p in model.named_parameters()}  # this rank's part of each
    return {"steps": steps, "batches": batches, "local": local, "sharded": monitor.sharded,
            "gathers": reducer.collectives}


def entries(record) -> dict:  # noqa: ANN001
    return {e.name: [e.stats._asdict(), sum(e.histogram.counts)] for e in record.entries if e.kind == "param_grad"}


def hsdp(rank: int) -> dict:
    """FSDP2 on a 2 x 1 mesh: parameters ``(Replicate(), Shard(0))``; one rank reports each."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    monitor = GradientMonitor(model, compile_statistics=False)
    reducer = RankReducer(monitor.bins, hooks=False)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    local = monitor.collect_parameters()
    return {"placements": str(model[0].weight.placements), "local": [e.name for e in local.entries],
            "pooled": entries(reducer.reduce(local, monitor.sharded)), "batch": [x.tolist(), y.tolist()]}


def partial() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Replicate()]))
    layer.weight.grad = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
    layer.bias.grad = torch.ones(4)
    monitor = GradientMonitor(layer, compile_statistics=False)
    record = monitor.collect_parameters()
    return {"skipped": monitor.skipped, "entries": [e.name for e in record.entries]}


def run(rank: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2)
    facts = {"fsdp1": fsdp1(rank), "hsdp": hsdp(rank), "partial": partial()}
    (out / f"ranks-{rank}.json").write_text(json.dumps(facts))
    finish()


if __name__ == "__main__":
    mp.spawn(run, args=(Path(sys.argv[1]),), nprocs=2)
