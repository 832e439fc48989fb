"""Two gloo ranks pool a step's statistics with ``RankReducer``, in plain PyTorch.

Run by ``tests/log/test_distributed.py`` through ``torch.multiprocessing``: ``run(rank, out)``
writes ``out/rank{rank}.json``. Each rank fits the same model on its own batch (a sum loss, so a
module's output gradients on the global batch are the ranks' gradients concatenated); at the
second step only rank 1 calls the module ``extra`` (which leaves the other gradients as they
were), so the ranks must agree on a new layout.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gloo_exit import finish
from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.log.distributed import RankReducer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.extra = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        y = self.body(x)
        return y + 0 * self.extra(y) if extra else y  # `extra` is read; the other gradients are unchanged


def batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))


def entries(record) -> dict:  # noqa: ANN001
    """``"kind name" -> [stats, calls, count, histogram counts]`` of a record, as JSON can hold it."""
    return {f"{e.kind} {e.name}": [e.stats._asdict(), e.calls, e.count, e.histogram.counts if e.histogram else None]
            for e in record.entries}


def steps(model: Net, x: torch.Tensor, extra_at_second: bool, reducer: RankReducer | None) -> list[dict]:
    """Two logged steps of ``model`` on ``x``: each step's record, pooled when ``reducer`` is given."""
    monitor = GradientMonitor(model, compile_statistics=False)  # eager: see ddp_train.py
    out = []
    with monitor.attach():
        for step in range(2):
            with monitor.arm():
                model(x, extra=extra_at_second and step == 1).sum().backward()
                record = monitor.collect()
            out.append({"local": entries(record), "pooled": entries(reducer.reduce(record)) if reducer else None})
            model.zero_grad()
    return out


def run(rank: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2)
    reducer = RankReducer(GradientMonitor(nn.Linear(1, 1)).bins)
    facts = {"steps": steps(Net(), batch(rank), rank == 1, reducer), "collectives": reducer.collectives}
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    finish()
