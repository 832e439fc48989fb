"""Does pausing Python's garbage collector during a logged step pay? An armed plain-loop step with
the monitor's pause (``with monitor.arm():`` pauses the collector up to ``collect()``), against
the same step with the pause switched off (the monitor's ``CollectorPause`` replaced by one that
does nothing).

    python benchmarks/collector.py [--models mlp500,resnet18] [--rounds 7] [--steps 5] [--threads 1]

The models of ``many_modules.py``, in a process that has imported Lightning and TensorBoard (a
few hundred thousand objects the collector walks in a full collection). A window is the mean
process CPU time of ``--steps`` armed steps (arm, forward, backward, ``collect``, optimizer
step); rounds alternate the order of the two windows. Prints medians and the median per-round
ratio of "not paused" to "paused".
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import pytorch_lightning  # noqa: F401  (imported for the objects it holds, as in a Lightning run)
import torch
from torch.utils import tensorboard  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from many_modules import cases  # noqa: E402

from lightning_gradhooks import GradientMonitor  # noqa: E402
from lightning_gradhooks.monitor import CollectorPause  # noqa: E402


class NoPause(CollectorPause):
    def pause(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp500,resnet18")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"{len(gc.get_objects())} objects tracked by the collector; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    print("| model | not paused (ms CPU) | paused (ms CPU) | not paused / paused |\n| --- | --- | --- | --- |")
    for name in args.models.split(","):
        case = cases()[name]
        torch.manual_seed(0)
        model = case.make()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        monitor = GradientMonitor(model)

        def window(paused: bool, steps: int) -> float:
            times = []
            monitor._collector = CollectorPause() if paused else NoPause()
            for _ in range(steps):
                start = time.process_time()
                with monitor.arm():
                    case.loss(model, case.batch).backward()
                    monitor.collect()
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.process_time() - start)
            return statistics.fmean(times)

        with monitor.attach():
            window(False, 2)  # the probe step, warm-up
            found: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(args.rounds):
                for paused in (False, True) if round_ % 2 else (True, False):
                    found[paused].append(window(paused, args.steps))
        ratio = statistics.median(on / off for on, off in zip(found[False], found[True]))
        print(f"| {name} | {statistics.median(found[False]) * 1e3:.1f} | {statistics.median(found[True]) * 1e3:.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
