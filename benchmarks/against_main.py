"""An armed step of this checkout beside another checkout of the library (today's main), in one run.

    git worktree add /tmp/main-ref <commit>
    python benchmarks/against_main.py --other /tmp/main-ref [--models resnet18,mlp500,encoder]
        [--rounds 5] [--steps 5]

Each library runs in a worker process of its own (``PYTHONPATH`` set to its checkout), on the
models of ``many_modules.py`` (ResNet-18, the 500-layer MLP, the encoder; CPU, torch's default
threads or ``--threads``) from the same initial weights. This process sends the workers one window at a time, so
no two windows overlap and the rounds interleave every variant of both libraries (the order
rotated each round). A window is one untimed step and the mean of ``--steps`` steps (wall
clock and the worker's CPU time, steadier on a shared machine) of a plain loop: ``with monitor.arm(): loss.backward(); monitor.collect()``, then the optimizer step.

Variants: ``bare`` (no monitor), ``attached`` (a monitor attached, not armed: what a step that
is not logged pays), ``armed`` and ``armed, no histograms`` (a logged step off the histogram
cadence) in both (``--variants`` picks some); in a checkout with compiled statistics also
``armed, eager`` (``GradientMonitor(compile_statistics=False)``). The table gives the median window of each
variant and the medians over rounds of its ratios to its own worker's ``bare``, then of each
armed variant of this checkout to the same variant of the other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(models: list[str], threads: int) -> None:
    """Answer ``{"model":, "variant":, "steps":}`` lines on stdin with window means on stdout."""
    import warnings

    import torch

    if threads:
        torch.set_num_threads(threads)

    sys.path.insert(0, HERE)
    from many_modules import cases

    from lightning_gradhooks import GradientMonitor

    warnings.filterwarnings("ignore")
    loops: dict[str, Any] = {}
    for name in models:
        case = cases()[name]
        torch.manual_seed(0)
        model = case.make()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        # "armed, no histograms": a logged step off the histogram cadence (GradHooks' default:
        # histograms on one logged step in ten), the moments pass alone.
        monitors = {"armed": GradientMonitor(model), "attached": GradientMonitor(model),
                    "armed, no histograms": GradientMonitor(model, histograms=False)}
        try:  # a checkout with compiled statistics: its eager ops too
            monitors["armed, eager"] = GradientMonitor(model, compile_statistics=False)
        except TypeError:
            pass
        loops[name] = (case, model, state, torch.optim.SGD(model.parameters(), lr=1e-4), monitors)

    def step(name: str, monitor: Any, armed: bool) -> tuple[float, float]:
        case, model, _, optimizer, _ = loops[name]
        start, cpu = time.perf_counter(), time.process_time()
        if monitor is None:
            case.loss(model, case.batch).backward()
        else:
            with monitor.arm(when=armed):
                case.loss(model, case.batch).backward()
                monitor.collect()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start, time.process_time() - cpu

    def window(name: str, variant: str, steps: int) -> tuple[float, float]:
        _, model, state, _, monitors = loops[name]
        model.load_state_dict(state)
        monitor = monitors.get(variant)
        with monitor.attach() if monitor is not None else contextlib.nullcontext():
            step(name, monitor, True)  # untimed: for a monitor, its first armed step (the probe)
            times = [step(name, monitor, variant != "attached") for _ in range(steps)]
            return statistics.fmean(t for t, _ in times), statistics.fmean(c for _, c in times)

    print(json.dumps({"variants": ["bare", "attached", *[v for v in loops[models[0]][4] if v != "attached"]]}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps({"seconds": window(ask["model"], ask["variant"], ask["steps"])}), flush=True)  # wall, CPU


class Worker:
    def __init__(self, label: str, root: str, models: list[str], threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=root)
        self.label = label
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--models", ",".join(models), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root,
        )
        self.variants: list[str] = json.loads(self.process.stdout.readline())["variants"]

    def window(self, model: str, variant: str, steps: int) -> list[float]:
        self.process.stdin.write(json.dumps({"model": model, "variant": variant, "steps": steps}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the checkout to compare with (its root folder)")
    parser.add_argument("--other-label", default="main")
    parser.add_argument("--models", default="resnet18,mlp500,encoder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the workers (default: torch's)")
    parser.add_argument("--variants", default="", help="variants to time, separated by semicolons (default: all; bare always)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.worker:
        worker(models, args.threads)
        return
    if not args.other or not os.path.isdir(os.path.join(args.other, "lightning_gradhooks")):
        parser.error(f"--other expected a checkout holding lightning_gradhooks/, got {args.other!r}")
    sys.path.insert(0, HERE)
    from overhead import machine

    threads = args.threads or "torch's default"
    print(f"Machine: {machine()}; workers' threads: {threads}; load average {os.getloadavg()[0]:.1f}")
    print(f"Command: python {' '.join(sys.argv)}\n")
    started = time.perf_counter()
    workers = [Worker(label, root, models, args.threads) for label, root in (("this", os.path.dirname(HERE)), (args.other_label, args.other))]
    try:
        for model in models:
            chosen = {v.strip() for v in args.variants.split(";")} | {"bare"} if args.variants else None
            windows = [(w, v) for w in workers for v in w.variants if chosen is None or v in chosen]
            for w, v in windows:  # warm-up
                w.window(model, v, 1)
            times: dict[tuple[str, str], list[list[float]]] = {(w.label, v): [] for w, v in windows}
            for round_ in range(args.rounds):
                shift = round_ % len(windows)
                for w, v in windows[shift:] + windows[:shift]:
                    times[w.label, v].append(w.window(model, v, args.steps))
                print(f"{model} round {round_ + 1}/{args.rounds}", file=sys.stderr)
            print(f"{model}: {args.rounds} rounds x {args.steps} steps; medians (wall clock; process CPU time)")
            print("| library | variant | step (ms) | ratio to its bare | CPU ratio to its bare |\n| --- | --- | --- | --- | --- |")
            for (label, variant), values in times.items():
                bare = times[label, "bare"]
                ratios = [statistics.median(v[i] / b[i] for v, b in zip(values, bare)) for i in (0, 1)]
                step_ms = statistics.median(v[0] for v in values) * 1e3
                print(f"| {label} | {variant} | {step_ms:.1f} | {ratios[0]:.3f}x | {ratios[1]:.3f}x |")
            for variant in [v for w, v in windows if w is workers[1] and v.startswith("armed")]:
                this, other = times.get(("this", variant)), times[args.other_label, variant]
                if this is not None:
                    ratios = [statistics.median(t[i] / o[i] for t, o in zip(this, other)) for i in (0, 1)]
                    print(f"this {variant} / {args.other_label} {variant}: {ratios[0]:.3f}x wall, {ratios[1]:.3f}x CPU")
            print()
    finally:
        for w in workers:
            w.close()
    print(f"Wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
