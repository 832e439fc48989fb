"""How far a logged step's statistics are from the memory floor, and what compiling them costs.

    python benchmarks/floor.py [--rounds 9] [--elements 4194304] [--modules 8] [--threads 0] [--device cuda]
    python benchmarks/floor.py --compile-time

The floor: a chain of ``--modules`` modules ``y = x * s`` (``s`` a parameter of shape (1,)) on an
activation of ``--elements`` float32 elements, so that backward is a few passes and the
statistics of the gradients are most of an armed step. Variants, interleaved, the order rotated
every round: ``bare`` (forward, backward), ``compiled`` and ``eager`` (armed
``GradientMonitor`` with ``compile_statistics`` True and False: forward, backward, collect;
64-bin histograms on, the defaults), and ``compiled, no histograms``; the noise probe off
(``noise_scale=False``: the statistics alone). The statistics' time (armed minus bare, median
over rounds) is given in *reads*: the time of one plain ``g.sum()`` over each big gradient the
monitor reduced (counted from the record), timed in the same rounds, and per module in µs. The
targets: at most 2 reads without histograms, 8 with.

``--compile-time``: the first logged step of a fresh process with an empty Inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` set to a new folder), less a later logged step, then the same in a
second process with that cache warm; and how many graphs Dynamo compiled.
``PYTHONPATH=DIR`` measures the checkout in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from lightning_gradhooks import GradientMonitor  # noqa: E402


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


def chain(modules: int) -> nn.Module:
    return nn.Sequential(*(Scale() for _ in range(modules)))


def elements(entry) -> float:
    """The element count of an entry (an older checkout's entries hold a dict and a count)."""
    if isinstance(entry.stats, dict):
        return entry.count + entry.stats["nonfinite"]
    return entry.stats.count + entry.stats.nonfinite


def timed(step, device: str) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def floor(args: argparse.Namespace) -> None:
    model = chain(args.modules).to(args.device)
    x = torch.randn(args.elements, generator=torch.Generator().manual_seed(0)).to(args.device).requires_grad_()
    try:
        monitors = {  # the statistics alone: the noise probe is timed by benchmarks/noise_scale.py cost
            "compiled": GradientMonitor(model, noise_scale=False),
            "compiled, no histograms": GradientMonitor(model, histograms=False, noise_scale=False),
            "eager": GradientMonitor(model, compile_statistics=False, noise_scale=False),
        }
    except TypeError:  # a checkout before compile_statistics (PYTHONPATH=/path/to/it): its one path
        monitors = {"armed": GradientMonitor(model)}
    big: list[int] = []

    def bare() -> None:
        model.zero_grad()
        model(x).sum().backward()

    def armed(monitor: GradientMonitor) -> None:
        model.zero_grad()
        with monitor.arm():
            model(x).sum().backward()
            record = monitor.collect()
        big[:] = [len([e for e in record.entries if elements(e) == args.elements])]

    g = torch.randn(args.elements, device=args.device)
    variants = {"bare": bare, "read": lambda: g.sum(), **{k: (lambda m=m: armed(m)) for k, m in monitors.items()}}
    for monitor in monitors.values():
        monitor.attach()
    for step in variants.values():  # compile, warm up
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in C.rotated(names, r):
            times[name].append(statistics.median(timed(variants[name], args.device) for _ in range(args.steps)))
    for monitor in monitors.values():
        monitor.remove()
    print(f"floor: {args.modules} x (y = x * s) on {args.elements} float32 elements; {C.machine(args.device)}")
    print(f"big gradients reduced per armed step: {big[0]}; {args.rounds} rounds of {args.steps} steps, medians")
    print("| variant | step ms | statistics ms (armed - bare) | us per module | reads of the gradient bytes |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("bare", *monitors):
        per_round = [(a - b) / (big[0] * s) for a, b, s in zip(times[name], times["bare"], times["read"])]
        extra = statistics.median(a - b for a, b in zip(times[name], times["bare"])) * 1e3
        reads = f"{statistics.median(per_round):.1f}" if name != "bare" else "-"
        per_module = f"{extra * 1e3 / args.modules:.0f}" if name != "bare" else "-"
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.2f} | {extra:.2f} | {per_module} | {reads} |")
    print(f"one read (g.sum() of {args.elements} float32): {statistics.median(times['read']) * 1e3:.2f} ms")


def first_step() -> None:
    """Child of --compile-time: the first and a later logged step of a small model, as JSON."""
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), chain(2))
    x = torch.randn(32, 64)
    monitor = GradientMonitor(model)
    steps = []
    with monitor.attach():
        for _ in range(3):
            start = time.perf_counter()
            with monitor.arm():
                model(x).sum().backward()
                monitor.collect()
            steps.append(time.perf_counter() - start)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(json.dumps({"first": steps[0], "later": min(steps[1:]), "graphs": graphs}))


def compile_time() -> None:
    print(f"compile time at the first logged step; {C.machine()}")
    print("| run | first logged step s | a later one s | compile s | graphs compiled |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for run in ("cold (empty Inductor cache)", "warm (the same cache, a new process)"):
            out = subprocess.run([sys.executable, __file__, "--first-step"], env=env, capture_output=True, text=True,
                                 check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {run} | {r['first']:.2f} | {r['later']:.4f} | {r['first'] - r['later']:.2f} | {r['graphs']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="steps per window (their median is the window's time)")
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--modules", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile-time", action="store_true")
    parser.add_argument("--first-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.first_step:
        first_step()
    elif args.compile_time:
        compile_time()
    else:
        floor(args)


if __name__ == "__main__":
    main()
