"""GradientMonitor and GradHooks on models with many hooked modules: ResNet-18, a 500-layer MLP, the encoder.

    python benchmarks/many_modules.py [--models resnet18,mlp500,encoder] [--rounds 5] [--steps 5]
        [--lightning-steps 20] [--lightning-rounds 3] [--no-wandb] [--skip-lightning] [--skip-ops]
        [--breakdown] [--device cuda] [--threads 1 --clock cpu]
    python benchmarks/many_modules.py --lightning-only [--models encoder] [--lightning-steps 50] [--lightning-rounds 3]
    python benchmarks/many_modules.py --stages [--models mlp500] [--rounds 10] [--device cuda]

Models, on the CPU with torch's default threads (or with ``--device cuda`` on the GPU, every
step timed to ``torch.cuda.synchronize()``), SGD lr 1e-4, the same initial weights for every
window: ``resnet18`` (torchvision-style, written here; 41 hooked modules; 8x3x64x64, cross-entropy),
``mlp500`` (500 x Linear(64, 64) + Tanh; 500 hooked modules; 32x64) and ``encoder`` (a
4-layer Transformer encoder, d_model 256, 4 heads; 24 hooked modules; 16x128x256). One ``GradientMonitor(model)`` each.

A, plain loop: variants ``bare``, ``attached`` (one armed step after attach, then unarmed steps
that still call ``collect``), ``armed`` (arm, forward, backward, collect), ``armed, eager`` (the
same with ``compile_statistics=False``), ``per-param norm``
(``torch.stack([p.grad.norm() ...]).tolist()``), ``wandb idle`` / ``wandb logging``
(``wandb.watch(model, log="all")`` offline, log_freq 10**9 / 1). A window is one untimed step
and the mean of ``--steps`` steps; rounds run every window, the order rotated each round; the
tables show medians of window means and of per-round ratios to ``bare``. wandb.watch computes
its histograms in hooks: a tensor hook per parameter counts backward passes and a forward hook
on the root counts forwards; every ``log_freq``-th call reduces the tensor and publishes it to
the run; ``run.log({})`` commits the row each logging step. A check counts them first.
B, op counts (a TorchDispatchMode): extra aten ops of an armed step (arm, forward, backward,
collect) over a bare one, with the CPU's block sizes and with an accelerator's
(``stats.SIZES`` emptied: a block is a whole batch), and of an attached, unarmed step.
D, ``--stages`` (instead of A to C): where an armed step's time goes, in a plain loop without the
optimizer: ``bare``; ``hooks only`` (armed, the hooks registered and firing, their reduction
replaced by nothing); ``hooks + bookkeeping`` (every tensor added to its batch, no batch
reduced); ``hooks + reductions`` (armed, then ``disarm`` instead of ``collect``);
``armed + collect`` (the noise probe off in these); ``armed + collect, noise probe``; ``armed + collect, no grad_input`` (a third monitor whose plan gives no module a grad_input
hook: what grad_input costs); ``--rounds`` rounds of 3-step windows,
interleaved; the cost per module and per tensor by part (hooks, bookkeeping, reductions,
collect, noise probe); then the top aten ops of one ``collect`` (torch.profiler, self CPU time, profiler
overhead included).
C, Lightning + TensorBoardLogger (``--lightning-only``: this part alone): plain, GradHooks every step, every 50 steps, every step charting every statistic; ``--lightning-rounds``
fits of ``--lightning-steps`` steps each, interleaved; the first 2 steps of a fit are left out.
Two tables: the mean step of each fit (the headline), and its median step (without the rare slow
steps where the allocator returned freed memory to the kernel). With ``--breakdown`` also every
step without histograms, every step with the monitor's
reductions (hook and parameter gradients) replaced by nothing (what the callback costs besides
them).

A variant that raises is reported as failed and left out. The default run takes about 5 minutes
on 2 idle cores (part A 3.5, B 0.3, C 1.2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lightning_gradhooks import GradHooks, GradientMonitor  # noqa: E402

from lightning_gradhooks.core import stats  # noqa: E402
from lightning_gradhooks.log import LOGGED_STATISTICS  # noqa: E402


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return (
        f"{model}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), pytorch-lightning {pl.__version__}, Python {platform.python_version()}"
    )


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)


Batch = tuple[Tensor, ...]
#: What parts A, C and D time: wall time, or the process's CPU time (``--clock``).
clock = time.perf_counter


# -- models ----------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for i, (cin, cout, stride) in enumerate(widths, 1):
            self.add_module(f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    batch: Batch
    loss: Callable[[nn.Module, Batch], Tensor]
    modules: int  # hooked modules GradientMonitor selects by default


def squares(model: nn.Module, batch: Batch) -> Tensor:
    return model(batch[0]).pow(2).mean()


def cross_entropy(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def cases(device: str = "cpu") -> dict[str, Case]:
    """The three models, made on ``device``, with their batches there (the same values on any device)."""
    g = torch.Generator().manual_seed(0)
    mlp = lambda: nn.Sequential(*(m for _ in range(500) for m in (nn.Linear(64, 64), nn.Tanh())))  # noqa: E731
    resnet_batch = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
    found = {
        "resnet18": Case("resnet18", ResNet18, resnet_batch, cross_entropy, 41),
        "mlp500": Case("mlp500", mlp, (torch.randn(32, 64, generator=g),), squares, 500),
        "encoder": Case("encoder", encoder, (torch.randn(16, 128, 256, generator=g),), squares, 24),
    }
    for case in found.values():
        case.make = functools.partial(lambda make: make().to(device), case.make)
        case.batch = tuple(t.to(device) for t in case.batch)
    return found


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a step's time is its whole time (a no-op on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# -- part A: a plain loop --------------------------------------------------------------------
@dataclass
class Variant:
    """A step is ``before()``, forward and backward, ``after()``, optimizer step, zero_grad."""

    before: Callable[[], object] = lambda: None
    after: Callable[[], object] = lambda: None


class Loop:
    """One model, its optimizer and monitor; ``window`` times a variant from the initial weights."""

    def __init__(self, case: Case, state: dict[str, Tensor]) -> None:
        self.case, self.state, self.model = case, state, case.make()
        self.model.load_state_dict(state)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.monitor = GradientMonitor(self.model)
        self.eager = GradientMonitor(self.model, compile_statistics=False)  # the eager sequence, nothing compiled
        assert len(self.monitor.modules) == case.modules, (case.name, len(self.monitor.modules))

    def step(self, variant: Variant) -> float:
        synchronize()
        start = clock()
        variant.before()
        self.case.loss(self.model, self.case.batch).backward()
        variant.after()
        self.optimizer.step()
        self.optimizer.zero_grad()
        synchronize()
        return clock() - start

    def window(self, setup: Callable[[], contextlib.AbstractContextManager[Variant]], steps: int) -> float:
        """Mean time of ``steps`` steps, after the untimed step that ``setup`` runs."""
        self.model.load_state_dict(self.state)
        try:
            with setup() as variant:
                return statistics.fmean(self.step(variant) for _ in range(steps))
        except Exception:
            self.monitor.disarm()  # a step failed half-way: leave nothing armed or accumulated
            self.optimizer.zero_grad()
            raise

    @contextlib.contextmanager
    def plain(self, variant: Variant) -> Iterator[Variant]:
        self.step(variant)
        yield variant

    @contextlib.contextmanager
    def monitored(self, armed: bool, eager: bool = False) -> Iterator[Variant]:
        monitor = self.eager if eager else self.monitor
        with monitor.attach():
            # `arm().__enter__()`: what `with monitor.arm():` does, arm and pause the collector
            # until collect(), as the documented loop and GradHooks do (a bare arm() does not pause).
            self.step(Variant(lambda: monitor.arm().__enter__(), monitor.collect))  # the first armed step: in-place probe
            yield Variant((lambda: monitor.arm().__enter__()) if armed else lambda: None, monitor.collect)

    @contextlib.contextmanager
    def watched(self, run: Any, log_freq: int) -> Iterator[Variant]:
        run.watch(self.model, log="all", log_freq=log_freq, idx=0)  # idx=0: the same names every window
        try:
            self.step(Variant(after=lambda: run.log({})))
            yield Variant(after=lambda: run.log({}) if log_freq == 1 else None)
        finally:
            run.unwatch(self.model)

    def norms(self) -> list[float]:
        return torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None]).tolist()

    def variants(self, run: Any) -> dict[str, Callable[[], contextlib.AbstractContextManager[Variant]]]:
        setups = {
            "bare": lambda: self.plain(Variant()),
            "attached": lambda: self.monitored(False),
            "armed": lambda: self.monitored(True),
            "armed, eager": lambda: self.monitored(True, eager=True),
        }
        setups |= {
            "per-param norm": lambda: self.plain(Variant(after=self.norms)),
        }
        if run is not None:
            setups["wandb idle"] = lambda: self.watched(run, 10**9)
            setups["wandb logging"] = lambda: self.watched(run, 1)
        return setups

    def check_wandb(self, run: Any) -> str:
        """Count the histograms wandb.watch computes per step (through a private hook point)."""
        history = run._torch
        found = {}
        for log_freq in (10**9, 1):
            with mock.patch.object(history, "log_tensor_stats", wraps=history.log_tensor_stats) as spy:
                self.window(functools.partial(self.watched, run, log_freq), 1)  # 2 steps
            found[log_freq] = spy.call_count // 2
        params = len(list(self.model.parameters()))
        assert found == {10**9: 0, 1: 2 * params}, found
        return f"{found[1]} histograms per logging step ({params} gradients + {params} parameters), 0 idle"


class Timings:
    """Window means per variant; a variant that raises is reported and left out from then on.

    The library under test may fail on a model; the benchmark says so and goes on.
    """

    def __init__(self, label: str, names: list[str]) -> None:
        self.label = label
        self.times: dict[str, list[float]] = {name: [] for name in names}
        self.failed: dict[str, str] = {}

    def measure(self, name: str, window: Callable[[], float], keep: bool = True) -> None:
        if name in self.failed:
            return
        try:
            value = window()
        except Exception as error:
            self.failed[name] = f"{type(error).__name__}: {error}"
            print(f"{self.label}: {name} failed ({self.failed[name]}); left out from now on")
            return
        if keep:
            self.times[name].append(value)

    def rounds(self, windows: dict[str, Callable[[], float]], rounds: int) -> None:
        """``rounds`` rounds of every window, the order rotated each round."""
        order = list(windows)
        for round_ in range(rounds):
            shift = round_ % len(order)
            for name in order[shift:] + order[:shift]:
                self.measure(name, windows[name])
            done = ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in self.times.items() if n not in self.failed)
            print(f"{self.label} round {round_ + 1}/{rounds}: {done}")

    def table(self, base: str) -> None:
        print(f"| variant | median step (ms) | median ratio to {base} |\n| --- | --- | --- |")
        for name, values in self.times.items():
            if name in self.failed:
                print(f"| {name} | failed: {self.failed[name]} | |")
            else:
                ratios = [v / b for v, b in zip(values, self.times[base])]
                ratio = f"{statistics.median(ratios):.3f}x" if base not in self.failed else "n/a"
                print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {ratio} |")
        print()


def part_a(names: list[str], args: argparse.Namespace, run: Any) -> None:
    for case in (cases(args.device)[n] for n in names):
        torch.manual_seed(0)
        loop = Loop(case, {k: v.clone() for k, v in case.make().state_dict().items()})
        setups = loop.variants(run)
        if run is not None:
            print(f"{case.name}: wandb check: {loop.check_wandb(run)}")
        timings = Timings(case.name, list(setups))
        windows = {name: functools.partial(loop.window, setup, args.steps) for name, setup in setups.items()}
        for name, setup in setups.items():  # warm-up
            timings.measure(name, functools.partial(loop.window, setup, 1), keep=False)
        timings.rounds(windows, args.rounds)
        print(f"\n{case.name}, plain loop ({case.modules} hooked modules): {args.rounds} rounds x {args.steps} steps")
        timings.table("bare")


# -- part B: op counts -----------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active (forward, backward, hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Callable[[], int]) -> tuple[int, int]:
    """The ops ``step`` dispatches, and what it returns."""
    with OpCounter() as counter:
        result = step()
    return counter.ops, result


def op_counts(case: Case) -> list[str]:
    """The table row of one model: extra ops of an armed step on each path, of an unarmed one."""
    torch.manual_seed(0)
    model = case.make()
    monitor = GradientMonitor(model)

    def step(armed: bool) -> int:
        """Forward, backward, collect (no optimizer); the tensors reduced into the record."""
        model.zero_grad(set_to_none=True)
        if armed:
            monitor.arm()
        case.loss(model, case.batch).backward()
        record = monitor.collect()
        return sum(e.calls for e in record.entries)

    step(False)  # warm-up
    bare, _ = count_ops(lambda: step(False))
    cells: dict[str, list[str]] = {}
    for path in ("CPU", "accelerator"):
        # The same ops; an accelerator's blocks are whole batches.
        sizes = contextlib.nullcontext() if path == "CPU" else mock.patch.object(stats, "SIZES", {})
        with sizes, monitor.attach():
            step(True)  # in-place probe
            if path == "CPU":
                not_armed = count_ops(lambda: step(False))[0] - bare
            step(True)  # warm-up of this path (cached layouts)
            ops, reduced = count_ops(lambda: step(True))
            cells[path] = [str(ops - bare), f"{(ops - bare) / max(reduced, 1):.1f}"]
            cells.setdefault("reduced", [str(reduced)])
    return [case.name, *cells["reduced"], *cells["CPU"], *cells["accelerator"], str(not_armed)]


def part_b(names: list[str]) -> None:
    rows = []
    for name in names:
        try:
            rows.append(op_counts(cases()[name]))
        except Exception as error:  # the library under test failed on this model
            rows.append([name, f"failed: {type(error).__name__}: {error}", *[""] * 5])
    print("\nOp counts (aten ops dispatched; extra = monitored step - bare step, forward + backward, no optimizer)")
    print(
        "| model | reduced tensors | extra ops, CPU blocks | per tensor | extra ops, accelerator blocks | per tensor "
        "| extra ops when not armed |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


# -- part C: Lightning -----------------------------------------------------------------------
class Wrapped(pl.LightningModule):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.net = case.make()
        self.loss = case.loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class SyncedStepTimer(StepTimer):
    """Step times that include the GPU's queued work."""

    def on_train_batch_start(self, *args: object) -> None:
        synchronize()
        super().on_train_batch_start(*args)

    def on_train_batch_end(self, *args: object) -> None:
        synchronize()
        super().on_train_batch_end(*args)


def fit_once(
    case: Case, state: dict[str, Tensor], callbacks: Callable[[], list[pl.Callback]], steps: int, logdir: str
) -> list[float]:
    """The step times of one fit, without the warm-up and probe steps."""
    module = Wrapped(case)
    module.net.load_state_dict(state)
    timer = SyncedStepTimer()
    on_gpu = case.batch[0].device.type == "cuda"
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        logger=TensorBoardLogger(logdir, name=case.name),
        callbacks=[*callbacks(), timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    trainer.fit(module, DataLoader([case.batch] * steps, batch_size=None))  # the same batch
    times = timer.cpu if clock is time.process_time else timer.times
    return times[2:] or times


class SkippedReductions(GradHooks):
    """GradHooks whose monitor reduces nothing (hooks, parameters): the callback's own cost."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._monitor._reduce = lambda *a: None


def part_c(names: list[str], args: argparse.Namespace) -> None:
    variants: dict[str, Callable[[], list[pl.Callback]]] = {
        "plain": lambda: [],
        "GradHooks every step": lambda: [GradHooks(every_n_steps=1)],
        "GradHooks every 50 steps": lambda: [GradHooks(every_n_steps=50)],
        # What the defaults chart (norm, update_ratio) against charting every statistic.
        "every step, every statistic": lambda: [GradHooks(every_n_steps=1, statistics=list(LOGGED_STATISTICS))],
    }
    if args.breakdown:
        variants["every step, no histograms"] = lambda: [GradHooks(every_n_steps=1, histograms=False)]
        variants["every step, eager statistics"] = lambda: [GradHooks(every_n_steps=1, compile_statistics=False)]
        variants["every step, reductions skipped"] = lambda: [SkippedReductions(every_n_steps=1)]
    for case in (cases(args.device)[n] for n in names):
        torch.manual_seed(0)
        state = case.make().state_dict()
        timings = Timings(f"{case.name} (Lightning)", list(variants))
        # The mean step of a fit counts its rare slow steps (the allocator returning freed
        # activations to the kernel, to be faulted in again); the median step leaves them out.
        typical = Timings(f"{case.name} (Lightning, median step)", list(variants))

        def fit(name: str, make: Callable[[], list[pl.Callback]]) -> float:
            times = fit_once(case, state, make, args.lightning_steps, logdir)
            typical.times[name].append(statistics.median(times))
            return statistics.fmean(times)

        with tempfile.TemporaryDirectory() as logdir:
            fits = {name: functools.partial(fit, name, make) for name, make in variants.items()}
            warm_up = functools.partial(fit_once, case, state, variants["GradHooks every step"], 3, logdir)
            timings.measure("GradHooks every step", warm_up, keep=False)
            timings.rounds(fits, args.lightning_rounds)
        typical.failed = timings.failed
        print(
            f"\n{case.name}, Lightning + TensorBoard: {args.lightning_rounds} rounds x {args.lightning_steps} "
            "steps (first 2 left out); mean step of each fit, medians over rounds"
        )
        timings.table("plain")
        print(f"{case.name}, the same fits: median step of each fit, medians over rounds")
        typical.table("plain")


@contextlib.contextmanager
def no_grad_input() -> Iterator[None]:
    """While active, the monitors' plans read no grad_input."""
    from lightning_gradhooks.core import planning as core

    decide = core._decide

    def changed(module: nn.Module, compiled: bool, seen: frozenset[str] | None) -> core.Plan:
        plan = decide(module, compiled, seen)
        if plan.read in (core.Read.VIEWS, core.Read.EDGE):
            return core.Plan(core.Read.OUTPUT_ONLY, "benchmark: no grad_input")
        return plan

    with mock.patch.object(core, "_decide", changed):
        yield


def part_d(names: list[str], args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    from lightning_gradhooks.core import stats

    for case in (cases(args.device)[n] for n in names):
        torch.manual_seed(0)
        model = case.make()
        monitor = GradientMonitor(model, noise_scale=False)
        # More monitors on the same model: no module with a grad_input hook; no histograms; the noise probe on.
        no_inputs = GradientMonitor(model, noise_scale=False)
        others = {"armed + collect, no grad_input": no_inputs,
                  "armed + collect, no histograms": GradientMonitor(model, histograms=False, noise_scale=False),
                  "armed + collect, noise probe": GradientMonitor(model)}

        def step(stage: str) -> float:
            m = others.get(stage, monitor)
            synchronize()
            start = clock()
            if stage != "bare":
                m.arm().__enter__()  # as `with m.arm():` does: the collector paused to collect/disarm
            if stage == "hooks only":  # the hooks fire, their reductions are left out
                m._reduce = lambda *a, **k: None
            try:
                if stage == "hooks + bookkeeping":  # every tensor added to its batch, no batch reduced
                    with mock.patch.object(stats.Reducer, "_flush", lambda self, histogram: self._open.pop(histogram)):
                        case.loss(model, case.batch).backward()
                else:
                    case.loss(model, case.batch).backward()
            finally:
                m.__dict__.pop("_reduce", None)
            if stage.startswith("armed + collect"):
                m.collect()
            else:
                m.disarm()
            model.zero_grad(set_to_none=True)
            synchronize()
            return clock() - start

        stages = ["bare", "hooks only", "hooks + bookkeeping", "hooks + reductions", "armed + collect",
                  "armed + collect, no grad_input", "armed + collect, no histograms", "armed + collect, noise probe"]
        timings = Timings(f"{case.name} (stages)", stages)
        with contextlib.ExitStack() as attached:
            for m in (monitor, *others.values()):
                attached.enter_context(m.attach())
            with no_grad_input():  # its probe step plans it
                step("armed + collect, no grad_input")
            for stage in ("armed + collect", "armed + collect, noise probe", *stages):  # the probe steps, then warm-up
                step(stage)
            windows = {stage: functools.partial(lambda s: statistics.fmean(step(s) for _ in range(3)), stage) for stage in stages}
            timings.rounds(windows, args.rounds)
            print(f"\n{case.name}, where an armed step's time goes ({case.modules} hooked modules, no optimizer)")
            timings.table("bare")
            per_module_table(case, model, monitor, timings)
            profile_table(case, model, monitor, timings)
            monitor.arm()
            case.loss(model, case.batch).backward()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                monitor.collect()
            model.zero_grad(set_to_none=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def per_module_table(case: Case, model: nn.Module, monitor: GradientMonitor, timings: Timings) -> None:
    """What an armed step adds per hooked module and per tensor reduced, by part (from the
    stages' medians): the hooks firing; the bookkeeping of each tensor (its batch); the
    reductions; ``collect`` (parameter gradients, the transfer, the record); the noise probe."""
    with monitor.arm():
        case.loss(model, case.batch).backward()
        tensors = len(monitor.collect().entries)
    model.zero_grad(set_to_none=True)
    # On a loaded machine the per-round ratios to bare are steadier than the times: each stage is
    # its median ratio times the median bare step.
    bare = timings.times["bare"]
    t = {name: statistics.median(a / b for a, b in zip(v, bare)) * statistics.median(bare)
         for name, v in timings.times.items() if v}
    parts = {
        "hooks": t["hooks only"] - t["bare"],
        "bookkeeping": t["hooks + bookkeeping"] - t["hooks only"],
        "reductions (in backward)": t["hooks + reductions"] - t["hooks + bookkeeping"],
        "collect (parameters, transfer, record)": t["armed + collect"] - t["hooks + reductions"],
        "noise probe": t["armed + collect, noise probe"] - t["armed + collect"],
        "all, without the noise probe": t["armed + collect"] - t["bare"],
        "all, without histograms or the noise probe": t["armed + collect, no histograms"] - t["bare"],
    }
    print(f"{case.name}: an armed step's cost per hooked module ({case.modules}) and per tensor reduced ({tensors}),"
          f" us (the stages' median ratios to bare, times the median bare step)\n| part | us per module | us per tensor |\n| --- | --- | --- |")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds * 1e6 / case.modules:.1f} | {seconds * 1e6 / tensors:.1f} |")
    print()


def profile_table(case: Case, model: nn.Module, monitor: GradientMonitor, timings: Timings) -> None:
    """A logged step's time by part: the device side from the stages (medians), the host side
    (``GradientLog.write``: TensorBoard events, the report's bookkeeping, the flow picture) from
    cProfile over 5 logged steps, each file's own time."""
    import cProfile
    import pstats

    from torch.utils.tensorboard import SummaryWriter

    from lightning_gradhooks import GradientLog

    t = {name: statistics.median(v) * 1e3 for name, v in timings.times.items() if v}
    parts = {
        "hooks (firing, no reduction)": t["hooks only"] - t["bare"],
        "reductions, statistics (in the hooks)": t["hooks + reductions"] - t["hooks only"] - (
            t["armed + collect"] - t["armed + collect, no histograms"]),
        "histograms": t["armed + collect"] - t["armed + collect, no histograms"],
        "collect: the transfer, rows, records": t["armed + collect"] - t["hooks + reductions"],
    }
    with tempfile.TemporaryDirectory() as folder:
        writer = SummaryWriter(folder)
        log = GradientLog(writer)
        records = []
        for _ in range(5):
            with monitor.arm():
                case.loss(model, case.batch).backward()
                records.append(monitor.collect())
            model.zero_grad(set_to_none=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for step, record in enumerate(records):
            log.write(record, step)
        writer.flush()
        profiler.disable()
        log.close()
        writer.close()
    own: dict[str, float] = {"write (TensorBoard events)": 0.0, "report": 0.0, "picture (gradient flow)": 0.0}
    for (file, _, _), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        part = ("report" if "/health/" in file or file.endswith("noise.py") else "picture (gradient flow)"
                if file.endswith("flow.py") or "matplotlib" in file or "PIL" in file else "write (TensorBoard events)")
        own[part] += tottime * 1e3 / len(records)
    parts |= own
    print(f"{case.name}: a logged step by part (ms; device side: medians of the stages; host side: cProfile, "
          "its own overhead included)\n| part | ms |\n| --- | --- |")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.1f} |")
    print()


def start_wandb(disabled: bool, logdir: str) -> Any:
    if disabled:
        print("wandb variants left out (--no-wandb)")
        return None
    try:
        import wandb
    except ImportError:
        print("wandb is not installed: its variants are left out")
        return None
    os.environ["WANDB_SILENT"] = "true"
    print(f"wandb {wandb.__version__}, offline")
    return wandb.init(mode="offline", dir=logdir, project="gradhooks-bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mlp500,encoder", help="comma-separated, of " + ", ".join(cases()))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the plain loop (part A)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window (part A)")
    parser.add_argument("--lightning-steps", type=int, default=20, help="optimizer steps per fit (part C)")
    parser.add_argument("--lightning-rounds", type=int, default=3, help="rounds of fits (part C)")
    parser.add_argument("--no-wandb", action="store_true", help="leave the wandb.watch variants out")
    parser.add_argument("--skip-lightning", action="store_true")
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--lightning-only", action="store_true", help="part C only: what GradHooks costs a Lightning fit")
    parser.add_argument(
        "--breakdown", action="store_true", help="part C also fits GradHooks without histograms, and with every reduction skipped"
    )
    parser.add_argument("--stages", action="store_true", help="part D only: where an armed step's time goes")
    parser.add_argument("--device", default="cpu", help="where parts A, C and D run: cpu or cuda (part B counts ops on the CPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="what parts A, C and D time: wall time, or the process's CPU time (with --threads 1, "
                             "steadier on a shared machine)")
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device expected cpu, or cuda where a GPU is present; got {args.device!r}")
    names = args.models.split(",")
    unknown = set(names) - set(cases())
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(cases())}")

    print(f"Machine: {machine()}" + (f", GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print(f"Command: python {' '.join(sys.argv)}\n{args.clock} clock; load average {os.getloadavg()[0]:.1f}\n")
    # Keep the tables readable: Lightning's info lines and the expected warnings go.
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    for message in ("does not have many workers", "smaller than the logging interval", "in-place operations", "LeafSpec"):
        warnings.filterwarnings("ignore", message=f".*{message}")
    start = time.perf_counter()
    if args.stages:
        part_d(names, args)
        print(f"Wall time: {time.perf_counter() - start:.0f} s")
        return
    if args.lightning_only:
        part_c(names, args)
        print(f"Wall time: {time.perf_counter() - start:.0f} s")
        return
    with tempfile.TemporaryDirectory() as logdir:
        run = start_wandb(args.no_wandb, logdir)
        part_a(names, args, run)
        if run is not None:
            run.finish()
    if not args.skip_ops:
        part_b(names)
    if not args.skip_lightning:
        part_c(names, args)
    print(f"Wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
