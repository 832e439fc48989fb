"""What the forward statistics add to a logged step, armed over bare, in one process per model.

    python benchmarks/forward_cost.py [--device cpu|cuda] [--models encoder,gpt2,resnet18] [--rounds 7] [--steps 3]

Variants, interleaved round by round in one process (the models of ``logged_step.py``):
``bare`` (forward, backward, optimizer step), ``grads`` (armed and collected with
``activations=False, attention_logits=False``), ``outputs`` (the output statistics too) and
``all`` (the defaults: output statistics and attention logits). Nothing is written: the monitor
alone (``logged_step.py --variants bare,logged_grads,logged_outputs,logged`` times the whole
logged step with its writing). Reported: the median over rounds of the mean step, and its ratio
to ``bare`` (median of per-round ratios).

``--count-ops``: instead, the aten ops an armed step dispatches on 20 ``Linear(64, 64)`` layers
with eager statistics (every op counted by a ``TorchDispatchMode``), with the gradients alone and
with the outputs too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

VARIANTS = {"bare": None, "grads": {"activations": False, "attention_logits": False},
            "outputs": {"attention_logits": False}, "all": {}}


def count_ops() -> None:
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_gradhooks import GradientMonitor

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    model, x = nn.Sequential(*[nn.Linear(64, 64) for _ in range(20)]), torch.randn(32, 64)
    counts = {}
    for name, options in (("grads", {"activations": False}), ("outputs", {"activations": True})):
        monitor = GradientMonitor(model, compile_statistics=False, noise_scale=False, **options)
        with monitor.attach():
            for _ in range(2):  # the second step: read plans settled
                Count.ops = 0
                with Count(), monitor.arm():
                    model(x).sum().backward()
                    monitor.collect()
        counts[name] = Count.ops
    print(f"aten ops of an armed step: {counts}; {(counts['outputs'] - counts['grads']) / 20:.0f} per output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="encoder,gpt2,resnet18")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--count-ops", action="store_true", help="count the aten ops of an armed step instead")
    args = parser.parse_args()
    if args.count_ops:
        count_ops()
        return
    import torch

    from lightning_gradhooks import GradientMonitor
    from logged_step import make_case

    print(f"command: python {' '.join(sys.argv)}")
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; torch {torch.__version__}")
    for name in args.models.split(","):
        model, batch, loss_fn = make_case(name, args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        monitors = {v: GradientMonitor(model, **o) for v, o in VARIANTS.items() if o is not None}
        handles = [m.attach() for m in monitors.values()]

        def window(variant: str) -> float:
            monitor = monitors.get(variant)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if monitor is not None:
                    monitor.arm()
                loss_fn(model, batch).backward()
                if monitor is not None:
                    monitor.collect()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if args.device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / args.steps

        for variant in VARIANTS:  # warm-up: plans, compiled kernels
            window(variant)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                times[variant].append(window(variant))
        print(f"\n{name}: {args.rounds} rounds x {args.steps} steps, medians")
        for variant, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, times["bare"]))
            print(f"  {variant:<8}{statistics.median(ts) * 1e3:>9.2f} ms {ratio:>7.3f}x", flush=True)
        for handle in handles:
            handle.remove()


if __name__ == "__main__":
    main()
