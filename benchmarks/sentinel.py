"""What ``GradHooks(catch_nonfinite=True)`` costs each step: the sentinel's one fused norm and one
host read, before the optimizer step, on the three models of many_modules.py.

    python benchmarks/sentinel.py [--models resnet18,mlp500,encoder] [--rounds 7] [--steps 5] [--device cuda]

A plain loop (forward, backward, the sentinel's check or not, SGD step, zero_grad), the same
initial weights for both variants; a window is one untimed step and the mean of ``--steps``
steps, the two variants alternate within each round (the order swapped every round), and the
table gives medians over rounds of the window means and of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from many_modules import cases, synchronize  # noqa: E402
from overhead import machine  # noqa: E402

from lightning_gradhooks.sentinel import NonfiniteSentinel  # noqa: E402


def window(model, optimizer, case, sentinel, steps: int) -> float:  # noqa: ANN001
    """Mean seconds of ``steps`` steps after one untimed step."""
    times = []
    for i in range(steps + 1):
        synchronize()
        start = time.perf_counter()
        case.loss(model, case.batch).backward()
        if sentinel is not None:
            assert sentinel.check() is None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mlp500,encoder")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(machine(), f"device {args.device}")
    print("| model | bare step (ms) | with the sentinel (ms) | ratio (median of rounds) |\n| --- | --- | --- | --- |")
    for name, case in cases(args.device).items():
        if name not in args.models.split(","):
            continue
        torch.manual_seed(0)
        model = case.make()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        sentinel = NonfiniteSentinel(model.named_parameters())
        bare, caught, ratios = [], [], []
        for r in range(args.rounds):
            order = [None, sentinel] if r % 2 == 0 else [sentinel, None]
            got = {id(s): window(model, optimizer, case, s, args.steps) for s in order}
            bare.append(got[id(None)])
            caught.append(got[id(sentinel)])
            ratios.append(caught[-1] / bare[-1])
        print(f"| {name} | {statistics.median(bare) * 1e3:.1f} | {statistics.median(caught) * 1e3:.1f} | "
              f"{statistics.median(ratios):.3f}x |")


if __name__ == "__main__":
    main()
