"""Python time per module of a logged step: a 500-layer ``Linear(16, 16) + Tanh`` plain loop.

    python benchmarks/python_per_module.py [--layers 500] [--rounds 7] [--steps 5]

The model is so small that a step is bound by Python, not by arithmetic: what a logged step
costs beyond a bare one, divided by the modules the monitor reads (the Linear layers), is the
Python time of our hooks, reductions, record, summary and report per module. One process, the
variants interleaved in every round: ``bare`` (no monitor) and ``logged`` (armed, ``collect``,
``GradientLog.write`` without a writer: the record, the summary and the report's judging, the
forward checks on as the callback has them). Prints the median over rounds of
(logged - bare) / layers, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from lightning_gradhooks import GradientLog, GradientMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round (their median)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(16, 16), nn.Tanh())])
    x = torch.randn(4, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = GradientMonitor(model, forward_checks=True)
    log = GradientLog(None, [optimizer], echo=None)
    handle = monitor.attach()

    def step(logged: bool, number: int) -> float:
        start = time.perf_counter()
        with monitor.arm(when=logged):
            model(x).square().mean().backward()
            if logged:
                log.write(monitor.collect(), number)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    number = 0
    for _ in range(3):  # warm-up; the first logged step plans the reads
        step(True, number := number + 1)
        step(False, number := number + 1)
    costs = []
    for _ in range(args.rounds):
        bare = statistics.median(step(False, number := number + 1) for _ in range(args.steps))
        logged = statistics.median(step(True, number := number + 1) for _ in range(args.steps))
        costs.append((logged - bare) / args.layers * 1e6)
    handle.remove()
    log.close()
    print(f"{statistics.median(costs):.1f} us per module per logged step (median of {args.rounds} rounds; "
          f"bare step {bare * 1e3:.1f} ms, logged {logged * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
