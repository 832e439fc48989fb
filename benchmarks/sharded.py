"""The parameter statistics of a logged FSDP2 step: pooled from shards vs ``full_tensor()``.

Two CPU processes (gloo), a ``fully_shard`` MLP (data parallel 2). Each round runs one
training step, then reduces every parameter gradient to statistics and histograms twice,
side by side, in alternating order:

- ``sharded``: :meth:`GradientMonitor.collect_parameters` on the local shards and
  :class:`RankReducer` (one all-gather of one flat tensor for every parameter);
- ``full_tensor``: ``grad.full_tensor()`` for each parameter (one all-gather per parameter),
  then the same reduction of the full tensors on every rank.

Prints the median time of each and the median of the per-round ratio, measured on rank 0.

    python benchmarks/sharded.py --layers 8 --width 1024 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.distributed import RankReducer
from lightning_gradhooks.stats import reduce


def sharded(monitor: GradientMonitor, reducer: RankReducer) -> int:
    record = reducer.reduce(monitor.collect_parameters(), monitor.sharded)
    return len(record.entries)


def full_tensor(model: nn.Module, bins: int) -> int:
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return len(reduce(grads, bins=bins))


def run(rank: int, args: argparse.Namespace, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
    model = nn.Sequential(*layers)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    monitor = GradientMonitor(model)
    reducer = RankReducer(monitor.bins, hooks=False)
    times: dict[str, list[float]] = {"sharded": [], "full_tensor": []}
    for i in range(args.rounds + 1):
        model(torch.randn(64, args.width)).square().mean().backward()
        order = ["sharded", "full_tensor"] if i % 2 else ["full_tensor", "sharded"]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            n = sharded(monitor, reducer) if name == "sharded" else full_tensor(model, monitor.bins)
            dist.barrier()
            if i:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
        assert n == 2 * args.layers
        model.zero_grad()
    if rank == 0:
        ratios = [f / s for s, f in zip(times["sharded"], times["full_tensor"])]
        numel = sum(p.numel() for p in model.parameters())
        print(f"{2 * args.layers} parameters, {numel / 1e6:.1f} M elements, {args.rounds} rounds, 2 ranks (gloo)")
        for name, values in times.items():
            print(f"{name:>12}: median {1e3 * statistics.median(values):.1f} ms")
        print(f"full_tensor / sharded: median ratio {statistics.median(ratios):.2f}")
        print(f"gathers by RankReducer: {reducer.collectives} for {args.rounds + 1} logged steps")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(run, args=(args, str(Path(folder) / "store")), nprocs=2)


if __name__ == "__main__":
    main()
