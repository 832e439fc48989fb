"""This checkout against another, inside one process: what a change to the host side saves.

    python benchmarks/ab_inprocess.py --ref DIR [--what reducer|steps] [--variants grads,outputs] [--rounds 80]
        [--threads 1]

Runs of separate processes swing by 15-20 µs per module on a shared 2-vCPU machine, more than most
changes to the host side save. Here the package of the checkout in ``DIR`` is copied, under the
name ``lightning_gradhooks_ref``, into a temporary folder (removed at the end) and imported beside
this checkout's, and the two alternate call by call (the order swapped each round), on the model
of ``host_per_module.py``, 500 x (Linear(64, 64) + Tanh) on a batch of 32, in process CPU time:

- ``--what reducer`` (default): the 2,000 gradients of one logged step (each module's
  ``grad_output``-sized and ``grad_input``-sized tensors, the weight's and the bias's gradients),
  reduced by each checkout's ``Reducer`` (``extend``, then ``finish``), with ``--histograms`` too;
- ``--what steps``: logged steps of the MLP (forward, backward, ``collect``, ``zero_grad``), one per
  call, with each checkout's ``GradientMonitor`` of each of ``--variants`` (those of
  ``host_per_module.py``) and bare steps between them.

Prints per checkout (and bare) the median and the first decile of the calls, in µs per module,
and the median per-round difference (this checkout minus the other) with its quartiles. Two
copies of one checkout differ by about ±0.5 µs per module here (``--ref .``).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from host_per_module import VARIANTS

REF = "lightning_gradhooks_ref"


def import_ref(checkout: Path, folder: Path):  # noqa: ANN201
    """The package of ``checkout``, copied into ``folder`` as :data:`REF` and imported."""
    source = checkout / "lightning_gradhooks"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--ref expected a checkout holding lightning_gradhooks/, got {checkout}")
    target = folder / REF
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        path.write_text(path.read_text().replace("lightning_gradhooks", REF))
    sys.path.insert(0, str(folder))
    return importlib.import_module(REF)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, type=Path, help="the other checkout (a folder holding lightning_gradhooks/)")
    parser.add_argument("--what", default="reducer", choices=["reducer", "steps"])
    parser.add_argument("--variants", default="grads,outputs", help="with --what steps: of " + ", ".join(VARIANTS))
    parser.add_argument("--histograms", action="store_true", help="with --what reducer: histograms too")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS) - {"bare"}:
        parser.error(f"--variants expected some of {', '.join(v for v in VARIANTS if v != 'bare')}; got {args.variants!r}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import lightning_gradhooks as new

    with tempfile.TemporaryDirectory() as folder:
        old = import_ref(args.ref.resolve(), Path(folder))
        packages = {"this checkout": new, f"--ref {args.ref}": old}
        model = nn.Sequential(*(m for _ in range(500) for m in (nn.Linear(64, 64), nn.Tanh())))
        x = torch.randn(32, 64)
        if args.what == "reducer":
            model(x).square().mean().backward()
            grads = [torch.randn(32, 64) for _ in range(999)] + [p.grad for p in model.parameters()]
            scratch = {name: p.core.stats.Scratch() for name, p in packages.items()}

            def call(name: str) -> None:
                reducer = packages[name].core.stats.Reducer(64, scratch[name])
                reducer.extend(grads, args.histograms)
                reducer.finish()

            calls = list(packages)
        else:
            monitors = {f"{name}: {v}": package.GradientMonitor(model, **VARIANTS[v])
                        for name, package in packages.items() for v in variants}
            handles = [m.attach() for m in monitors.values()]

            def call(name: str) -> None:
                monitor = monitors.get(name)
                if monitor is None:
                    loss = model(x).square().mean()
                    loss.backward()
                else:
                    with monitor.arm():
                        loss = model(x).square().mean()
                        loss.backward()
                        monitor.collect()
                model.zero_grad(set_to_none=True)

            calls = ["bare", *monitors]
        for name in calls * 2:  # compile, probe
            call(name)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(args.rounds):
            for name in calls if r % 2 else calls[::-1]:
                start = time.process_time()
                call(name)
                times[name].append((time.process_time() - start) * 1e6 / 500)
        if args.what == "steps":
            for handle in handles:
                handle.remove()
    print(f"command: python benchmarks/ab_inprocess.py --ref {args.ref} --what {args.what} --rounds {args.rounds} "
          f"--threads {args.threads}{' --histograms' if args.histograms else ''}"
          f"{' --variants ' + args.variants if args.what == 'steps' else ''}; torch {torch.__version__}; µs per module")
    print("| calls | median | first decile |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.1f} | {statistics.quantiles(ts, n=10)[0]:.1f} |")
    pairs = [("this checkout", f"--ref {args.ref}")] if args.what == "reducer" else \
        [(f"this checkout: {v}", f"--ref {args.ref}: {v}") for v in variants]
    for a, b in pairs:
        low, middle, high = quartiles([n - o for n, o in zip(times[a], times[b])])
        print(f"{a} minus the other: median {middle:+.2f} µs per module (quartiles {low:+.2f} to {high:+.2f})")


if __name__ == "__main__":
    main()
