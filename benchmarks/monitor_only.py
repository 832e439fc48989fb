"""The cost of GradientMonitor alone, without Lightning or TensorBoard, on the overhead model.

    python benchmarks/monitor_only.py [--rounds 6] [--steps 3]

One process, the three variants interleaved in every round: ``bare`` (no hooks), ``attached``
(hooks attached, not armed: what a step that is not logged pays) and ``armed`` (every statistic
and histogram of the 24 default modules, then ``collect``). A step is forward, backward,
``collect`` and the optimizer step; each variant's window is the mean of ``--steps`` steps. Prints the median step time of each variant and the median of
its per-round ratio to ``bare``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_gradhooks import GradientMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round (their mean)")
    args = parser.parse_args()

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    x = torch.randn(16, 128, 256, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    monitor = GradientMonitor(model)

    def step(armed: bool) -> float:
        start = time.perf_counter()
        with monitor.arm(when=armed):
            model(x).pow(2).mean().backward()
            monitor.collect()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"bare": [], "attached": [], "armed": []}
    step(False)  # warm-up
    for _ in range(args.rounds):
        for variant in times:
            if variant == "bare":
                times[variant].append(statistics.fmean(step(False) for _ in range(args.steps)))
                continue
            with monitor.attach():
                step(True)  # the first backward after attach settles which hooks to use
                times[variant].append(statistics.fmean(step(variant == "armed") for _ in range(args.steps)))
    print(f"{args.rounds} rounds; medians; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| variant | step (ms) | ratio to bare (median of per-round ratios) |\n| --- | --- | --- |")
    for variant, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, times["bare"]))
        print(f"| {variant} | {statistics.median(values) * 1e3:.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
