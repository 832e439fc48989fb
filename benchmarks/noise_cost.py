"""What the gradient noise scale adds to a logged step, on the three models of many_modules.py.

    python benchmarks/noise_cost.py [--models resnet18,mlp500,encoder] [--rounds 15] [--threads 1] [--probe-alone]

A logged step in a plain loop: ``monitor.arm(...)``, forward and backward (one batch, or the
same batch as two micro-batches of half its size), ``monitor.collect()``, ``GradientLog.write``
to a ``SummaryWriter`` in a temporary folder (histograms on, the defaults), SGD step, zero_grad.
Two monitors on the same model, attached together (an unarmed monitor has no hook in): one with
``noise_scale=False`` (``off``), one with the default ``noise_scale=True`` (``on``). Variants:
``off`` / ``on`` with one backward (the noise probe reads per-example norms) and ``off, k=2`` /
``on, k=2`` with two micro-batches (the probe reads each micro-batch's gradient). Every
round runs one step of each variant, in an order rotated each round, after two untimed rounds.
Each step is timed twice: wall clock and the process's CPU time (``time.process_time``, all
threads), which a host shared with other work disturbs less. Prints the median of each
variant and the median of the per-round ratios ``on / off`` (same model, same k), both clocks.

``--probe-alone``: the ``NoiseProbe`` by itself (armed, forward and backward, collected) against
the bare step, interleaved, process CPU time: the probe's share without the monitor's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_modules import cases  # noqa: E402

from lightning_gradhooks import GradientLog, GradientMonitor  # noqa: E402
from lightning_gradhooks.noise import NoiseProbe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mlp500,encoder")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--probe-alone", action="store_true", help="the noise probe alone against bare steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.probe_alone:
        for name in args.models.split(","):
            probe_alone(cases()[name], args.rounds)
        return
    folder = tempfile.TemporaryDirectory()
    for name in args.models.split(","):
        case = cases()[name]
        torch.manual_seed(0)
        model = case.make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay, so every window is alike
        monitors = {"off": GradientMonitor(model, noise_scale=False), "on": GradientMonitor(model)}
        writer = SummaryWriter(f"{folder.name}/{name}")
        logs = {key: GradientLog(writer, [optimizer], echo=None) for key in monitors}
        handles = [m.attach() for m in monitors.values()]
        batch = case.batch
        half = tuple(t[: len(t) // 2] for t in batch), tuple(t[len(t) // 2:] for t in batch)
        step_no = [0]

        def step(key: str, k: int) -> tuple[float, float]:
            monitor = monitors[key]
            start, cpu = time.perf_counter(), time.process_time()
            with monitor.arm(batch_size=len(batch[0]) // k, accumulation=k):
                for part in ((batch,) if k == 1 else half):
                    (case.loss(model, part) / k).backward()
                logs[key].write(monitor.collect(), step_no[0])
            optimizer.step()
            optimizer.zero_grad()
            step_no[0] += 1
            return time.perf_counter() - start, time.process_time() - cpu

        variants = [("off", 1), ("on", 1), ("off", 2), ("on", 2)]
        times: dict[tuple[str, int], list[tuple[float, float]]] = {v: [] for v in variants}
        for r in range(-2, args.rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for v in order:
                took = step(*v)
                if r >= 0:
                    times[v].append(took)
        for v in variants:
            wall, cpu = (statistics.median(t[i] for t in times[v]) for i in (0, 1))
            print(f"{name:9s} {v[0]:3s} k={v[1]}  wall {1000 * wall:8.1f} ms  cpu {1000 * cpu:8.1f} ms")
        for k in (1, 2):
            for i, clock in enumerate(("wall", "cpu")):
                ratios = sorted(on[i] / off[i] for on, off in zip(times["on", k], times["off", k]))
                print(f"{name:9s} on/off k={k} {clock:4s} median {statistics.median(ratios):.3f}  "
                      f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})")
        sample = logs["on"].noise_scale.value
        print(f"{name:9s} noise scale of its batch: {sample if sample is None else round(sample, 1)}")
        for h in handles:
            h.remove()
        for log in logs.values():
            log.close()
        writer.close()
    folder.cleanup()


def probe_alone(case, rounds: int) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = case.make()
    probe = NoiseProbe(model)

    def step(on: bool) -> float:
        cpu = time.process_time()
        if on:
            probe.arm()
        case.loss(model, case.batch).backward()
        if on:
            probe.collect()
        model.zero_grad()
        return time.process_time() - cpu

    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(-2, rounds):
        for on in ((True, False) if r % 2 else (False, True)):
            took = step(on)
            if r >= 0:
                times[on].append(took)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{case.name:9s} probe alone: bare {1000 * off:.1f} ms, the probe adds {1000 * (on - off):.1f} ms "
          f"({(on - off) / on:.1%} of the step with it), CPU medians")


if __name__ == "__main__":
    main()
