"""Where a logged step's time goes, part by part, armed over bare, in one process per model.

    python benchmarks/forward_cost.py [--device cpu|cuda] [--models encoder,gpt2,resnet18] [--rounds 7] [--steps 3]
        [--variants bare,stats,hist,outputs,logits,noise,write,checks] [--threads 1 --clock cpu] [--repo DIR]
    python benchmarks/forward_cost.py --max-logits [--ref DIR] [--rounds 15]
    python benchmarks/forward_cost.py --count-ops
    python benchmarks/forward_cost.py --kernels [--models encoder] [--steps 5] [--threads 1] [--clock cpu]

Variants, interleaved round by round in one process, the order rotated each round (the models
of ``logged_step.py``), each adding one part of the monitor's defaults to the one before:
``bare`` (forward, backward, optimizer step); ``stats`` (armed and collected, the gradients'
statistics alone: ``histograms=False, noise_scale=False, activations=False,
attention_logits=False``); ``hist`` (their 64-bin histograms too); ``outputs`` (the output
statistics too); ``logits`` (the attention logits too); ``noise`` (the noise probe too: the
monitor's defaults); ``write`` (each step also written by ``GradientLog.write`` into a
``SummaryWriter``, up to ``flush()``: what ``logged_step.py``'s ``logged`` does; the log draws its
flow picture within 2 % of the wall time since its first step, which here counts every variant's
windows); ``checks`` (written, and the forward checks on: what ``GradHooks`` runs). Reported: the
median over rounds of the mean step, its ratio to ``bare`` (median of per-round ratios), what the
part adds over the variant before (the difference of those ratios), and the time spent in
``collect`` and in ``GradientLog.write`` (medians; the optimizer step's update-ratio hooks and
``flush()`` are outside both). ``--clock cpu`` times the process's CPU time (with ``--threads 1``, steadier
on a shared machine); ``--repo DIR`` imports the library of the checkout in DIR (run one process
per checkout, one after the other, to compare them).

``--max-logits [--ref DIR]``: instead, the CPU time of one attention call's maximum logit
(:func:`lightning_gradhooks.core.attention.max_logits`) on typical shapes and masks, 1 thread,
against the same function of the checkout in DIR, interleaved in one process (medians of
``--rounds`` rounds of 5 calls; the two must give the same maxima).

``--kernels``: instead, the time (``--clock``) a logged step with the defaults spends in the compiled
statistics (by row function) and in the attention logits' ``q·kᵀ``, beside a bare step: the
part of a logged step that no saving on the host side can remove.

``--count-ops``: instead, the aten ops an armed step dispatches on 20 ``Linear(64, 64)`` layers
with eager statistics (every op counted by a ``TorchDispatchMode``), with the gradients alone and
with the outputs too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else str(HERE.parent))
sys.path.insert(1, str(HERE))

#: Each variant's monitor options: each adds one part of the defaults to the one before.
VARIANTS = {"bare": None,
            "stats": {"histograms": False, "noise_scale": False, "activations": False, "attention_logits": False},
            "hist": {"noise_scale": False, "activations": False, "attention_logits": False},
            "outputs": {"noise_scale": False, "attention_logits": False},
            "logits": {"noise_scale": False},
            "noise": {},
            "write": {},
            "checks": {"forward_checks": True}}


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


def time_max_logits(ref: str | None, rounds: int) -> None:
    import importlib.util
    import os

    import torch

    def load(repo: str):  # noqa: ANN202
        spec = importlib.util.spec_from_file_location(f"attention_{len(repo)}_{hash(repo)}",
                                                      Path(repo) / "lightning_gradhooks" / "core" / "attention.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # its imports come from this checkout: only attention.py differs
        return module.max_logits

    torch.set_num_threads(1)
    functions = {"this": load(str(HERE.parent)), **({"ref": load(ref)} if ref else {})}
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    mha = lambda b, h, t, d: randn(t, b * h, d).transpose(0, 1).view(b, h, t, d)  # noqa: E731  # nn.MultiheadAttention's layout
    calls = {
        "encoder 16x4x128x64 (nn.MultiheadAttention), no mask": (mha(16, 4, 128, 64), mha(16, 4, 128, 64), {}),
        "16x4x128x64, is_causal": (randn(16, 4, 128, 64), randn(16, 4, 128, 64), {"is_causal": True}),
        "GPT-2 small 2x12x128x64, is_causal": (randn(2, 12, 128, 64), randn(2, 12, 128, 64), {"is_causal": True}),
        "16x4x128x64, boolean mask (T, T)": (randn(16, 4, 128, 64), randn(16, 4, 128, 64), {"attn_mask": randn(128, 128) > -0.5}),
        "16x4x128x64, boolean mask per head": (randn(16, 4, 128, 64), randn(16, 4, 128, 64),
                                               {"attn_mask": randn(16, 4, 128, 128) > -0.5}),
        "16x4x128x64, additive mask (T, T)": (randn(16, 4, 128, 64), randn(16, 4, 128, 64), {"attn_mask": randn(128, 128)}),
    }
    print(f"max_logits, CPU time per call, 1 thread, medians of {rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print("| call | " + " | ".join(f"{n} (ms)" for n in functions) + (" | this / ref |" if ref else " |"))
    print("| --- " * (len(functions) + 1 + bool(ref)) + "|")
    for name, (q, k, options) in calls.items():
        if ref:
            assert torch.equal(functions["this"](q, k, **options), functions["ref"](q, k, **options)), name
        times: dict[str, list[float]] = {n: [] for n in functions}
        for round_ in range(rounds):
            for n in (list(functions) if round_ % 2 else list(functions)[::-1]):
                t0 = time.process_time()
                for _ in range(5):
                    functions[n](q, k, **options)
                times[n].append((time.process_time() - t0) / 5)
        cells = [f"{statistics.median(t) * 1e3:.2f}" for t in times.values()]
        if ref:
            cells.append(f"{statistics.median(a / b for a, b in zip(times['this'], times['ref'])):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def time_kernels(models: list[str], steps: int, threads: int, clock_name: str) -> None:
    """The time (``--clock``) a logged step with the monitor's defaults spends in its compiled statistics
    (each :func:`lightning_gradhooks.core._kernels.run`, by row function) and in the attention
    logits' extra ``q·kᵀ`` (:func:`lightning_gradhooks.core.attention.max_logits`), against a bare
    step: what the step costs at least, however little the host adds around them. Timed by
    wrapping the two functions of this library for the run (this script's process only)."""
    import torch

    from lightning_gradhooks import GradientMonitor
    from lightning_gradhooks.core import _kernels, attention
    from logged_step import make_case

    torch.set_num_threads(threads or torch.get_num_threads())
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    spent: dict[str, float] = {}

    def timed(function, key):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                name = key(args)
                spent[name] = spent.get(name, 0.0) + clock() - start
        return call

    _kernels.run = timed(_kernels.run, lambda args: args[0].__name__)
    attention.max_logits = timed(attention.max_logits, lambda args: "max_logits")
    print(f"command: python {' '.join(sys.argv)}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
          f"{clock_name} clock")
    for name in models:
        model, batch, loss_fn = make_case(name, "cpu")
        monitor = GradientMonitor(model)
        bare, armed = [], []
        with monitor.attach():
            for step in range(steps + 2):
                start = clock()
                loss_fn(model, batch).backward()
                bare.append(clock() - start)
                model.zero_grad(set_to_none=True)
                if step == 2:
                    spent.clear()  # after the warm-up steps: plans, compiles
                start = clock()
                with monitor.arm():
                    loss_fn(model, batch).backward()
                    monitor.collect()
                armed.append(clock() - start)
                model.zero_grad(set_to_none=True)
        b, a = statistics.median(bare[2:]), statistics.median(armed[2:])
        print(f"{name}: bare step {b * 1e3:.1f} ms, logged step {a * 1e3:.1f} ms ({a / b:.3f}x); per logged step:")
        for key, seconds in sorted(spent.items()):
            print(f"  {key:<15} {seconds / steps * 1e3:8.1f} ms  {seconds / steps / b:7.2%} of a bare step")
        spent.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="encoder,gpt2,resnet18")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, starting with bare, of "
                        "%(default)s")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="wall time, or the process's CPU time")
    parser.add_argument("--repo", default=None, metavar="DIR", help="import the library of the checkout in DIR")
    parser.add_argument("--count-ops", action="store_true", help="count the aten ops of an armed step instead")
    parser.add_argument("--max-logits", action="store_true", help="time max_logits per attention call instead")
    parser.add_argument("--ref", default=None, metavar="DIR", help="with --max-logits: against the checkout in DIR")
    parser.add_argument("--kernels", action="store_true", help="the time a logged step spends in its kernels instead")
    args = parser.parse_args()
    if args.kernels:
        time_kernels(args.models.split(","), args.steps, args.threads, args.clock)
        return
    if args.count_ops:
        count_ops()
        return
    if args.max_logits:
        time_max_logits(args.ref, args.rounds)
        return
    variants = args.variants.split(",")
    if variants[0] != "bare" or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants expected bare, then some of {', '.join(list(VARIANTS)[1:])}; got {args.variants!r}")
    import torch
    from torch.utils.tensorboard import SummaryWriter

    import lightning_gradhooks
    from lightning_gradhooks import GradientLog, GradientMonitor
    from logged_step import make_case

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"command: python {' '.join(sys.argv)}")
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads; {args.clock} clock; library {Path(lightning_gradhooks.__file__).parent}")
    for name in args.models.split(","):
        model, batch, loss_fn = make_case(name, args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        monitors = {v: GradientMonitor(model, **VARIANTS[v]) for v in variants if VARIANTS[v] is not None}
        handles = [m.attach() for m in monitors.values()]
        folder = tempfile.TemporaryDirectory()
        writer = SummaryWriter(folder.name)
        log = GradientLog(writer, optimizers=[optimizer], echo=None) if {"write", "checks"} & set(variants) else None
        in_collect: dict[str, list[float]] = {v: [] for v in variants}
        in_write: dict[str, list[float]] = {v: [] for v in variants}
        logged = [0]  # the log's step

        def window(variant: str) -> float:
            monitor = monitors.get(variant)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0, collecting, writing = clock(), 0.0, 0.0
            for _ in range(args.steps):
                if monitor is not None:
                    monitor.arm()
                loss_fn(model, batch).backward()
                if monitor is not None:
                    c0 = clock()
                    record = monitor.collect()
                    collecting += clock() - c0
                    if log is not None and variant in ("write", "checks"):
                        w0 = clock()
                        log.write(record, logged[0])
                        writing += clock() - w0
                        logged[0] += 1
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if log is not None and variant in ("write", "checks"):
                writer.flush()
            if args.device == "cuda":
                torch.cuda.synchronize()
            in_collect[variant].append(collecting / args.steps)
            in_write[variant].append(writing / args.steps)
            return (clock() - t0) / args.steps

        for variant in variants:  # warm-up: plans, compiled kernels
            window(variant)
        times: dict[str, list[float]] = {v: [] for v in variants}
        in_collect, in_write = {v: [] for v in variants}, {v: [] for v in variants}
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                times[variant].append(window(variant))
            print(f"  {name} round {round_ + 1}: " + ", ".join(f"{v} {t[-1] * 1e3:.0f} ms" for v, t in times.items()),
                  flush=True)
        print(f"\n{name}: {args.rounds} rounds x {args.steps} steps, medians")
        print(f"  {'variant':<9}{'step':>11}{'vs bare':>9}{'part':>9}{'collect':>11}{'write':>11}")
        before = 1.0
        for variant, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, times["bare"]))
            print(f"  {variant:<9}{statistics.median(ts) * 1e3:>8.1f} ms{ratio:>8.3f}x{ratio - before:>+9.3f}"
                  f"{statistics.median(in_collect[variant]) * 1e3:>8.1f} ms"
                  f"{statistics.median(in_write[variant]) * 1e3:>8.1f} ms", flush=True)
            before = ratio
        if log is not None:
            log.close()
        writer.close()
        folder.cleanup()
        for handle in handles:
            handle.remove()


if __name__ == "__main__":
    main()
