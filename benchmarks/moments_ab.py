"""The moments kernel, one pass against two, inside one process: what the one-pass ``row_moments`` saves a logged step.

    python benchmarks/moments_ab.py [--models mlp500,resnet18,encoder] [--monitor grads|defaults] [--rounds 15]
        [--threads 1]

``stats.row_moments`` reads each row once, its sums taken about the row's first element. Until
2026-11-28 it took the row's mean first and then the sums about it (the corrected two-pass
formula: a second pass over the row, from cache), kept here as :func:`two_pass` for this
comparison only. Both are swapped into the same monitor in one process, each compiled once, and
timed in interleaved windows (the order rotated each round) with bare steps, so the machine's
swings between processes (±20 % here) do not enter the difference. A window is one untimed step
and the mean of 3 steps (forward, backward, ``collect``, ``zero_grad``; no optimizer), in process
CPU time. ``--monitor grads``: ``GradientMonitor(histograms=False, noise_scale=False,
activations=False)``; ``defaults``: ``GradientMonitor(model)``. Models: those of
``many_modules.py``. Prints per model the median window of each, its overhead per watched module
over bare, and the median per-round difference with its quartiles.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import Tensor

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.core import stats
from many_modules import cases


def two_pass(x: Tensor) -> Tensor:
    """The earlier ``row_moments``: the pivot is the row's mean, the sums are about it."""
    x = x.to(stats._compute_dtype(x.dtype))
    finite = x.isfinite()
    count = finite.sum(1, dtype=x.dtype)
    pivot = torch.where(finite, x, 0.0).sum(1) / count.clamp(min=1)
    shifted = torch.where(finite, x - pivot[:, None], 0.0)
    low = torch.where(finite, x, math.inf).amin(1)
    high = torch.where(finite, x, -math.inf).amax(1)
    zeros = (x == 0).sum(1, dtype=x.dtype)
    return torch.stack([count, pivot, shifted.sum(1), shifted.square().sum(1), zeros, low, high], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp500,resnet18,encoder")
    parser.add_argument("--monitor", default="grads", choices=["grads", "defaults"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"two passes": two_pass, "one pass": stats.row_moments}
    print(f"--monitor {args.monitor}, {args.threads} thread(s), process CPU time, {args.rounds} rounds of 3 steps; "
          f"torch {torch.__version__}")
    for name in args.models.split(","):
        case = cases()[name]
        model = case.make()
        options = {} if args.monitor == "defaults" else {"histograms": False, "noise_scale": False, "activations": False}
        monitor = GradientMonitor(model, **options)

        def step(armed: bool) -> float:
            start = time.process_time()
            if armed:
                with monitor.arm():
                    case.loss(model, case.batch).backward()
                    monitor.collect()
            else:
                case.loss(model, case.batch).backward()
            model.zero_grad(set_to_none=True)
            return time.process_time() - start

        times: dict[str, list[float]] = {"bare": [], **{k: [] for k in kernels}}
        names = list(times)
        try:
            with monitor.attach():
                for kernel in kernels.values():  # compile each, probe the read plans
                    stats.row_moments = kernel
                    step(True), step(True)
                for r in range(args.rounds):
                    for variant in names[r % 3:] + names[: r % 3]:
                        if variant != "bare":
                            stats.row_moments = kernels[variant]
                        step(variant != "bare")
                        times[variant].append(statistics.fmean(step(variant != "bare") for _ in range(3)))
        finally:
            stats.row_moments = kernels["one pass"]
        bare = times["bare"]
        print(f"\n{name} ({case.modules} watched modules)\n| variant | window (ms) | armed / bare | µs per module over bare |\n"
              "| --- | --- | --- | --- |")
        for variant, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, bare))
            extra = statistics.median((t - b) / case.modules * 1e6 for t, b in zip(ts, bare))
            print(f"| {variant} | {statistics.median(ts) * 1e3:.1f} | {ratio:.3f}x | {extra:.1f} |")
        diff = [(a - b) / case.modules * 1e6 for a, b in zip(times["one pass"], times["two passes"])]
        quartiles = ", ".join(f"{q:.1f}" for q in statistics.quantiles(diff, n=4))
        print(f"one pass minus two passes, per round: median {statistics.median(diff):.1f} µs per module "
              f"(quartiles {quartiles})")


if __name__ == "__main__":
    main()
