"""What a logged step costs: a plain loop, a Lightning fit, per watched module, beside another checkout.

    python benchmarks/logged_step.py [--models resnet18,mlp500,encoder] [--variants bare,logged,logged_tb]
        [--rounds 5] [--steps 5] [--threads 1 --clock cpu] [--device cuda] [--one-process] [--ref DIR]
    python benchmarks/logged_step.py --per-module [--floor] [--rounds 40 --steps 1]   # host µs per module
    python benchmarks/logged_step.py --lightning [--models encoder] [--steps 20] [--rounds 3]
    python benchmarks/logged_step.py --kernels [--models encoder]                   # time in the kernels
    python benchmarks/logged_step.py --compiled [--models encoder,gpt2s] [--every 50]  # a compiled model

A plain loop over a model of ``_common.make_case``, the same batch every step: forward, backward,
SGD step (lr 1e-4), ``zero_grad``. Variants (``BASES``), interleaved round by round, the order
rotated: ``bare``; ``armed`` (``monitor.arm()`` around forward, backward and ``collect()``),
``armed_eager`` (``compile_statistics=False``); ``logged`` (and ``GradientLog.write``, timed up to
``writer.flush()``), ``logged_tb`` (through TensorBoard's own writer); ``-no<part>`` leaves a default
out (``PARTS``); ``offload``, ``sentinel``, ``spikes`` (what ``GradHooks(spikes=True)`` adds to a step
that is not logged; on a GPU under ``set_sync_debug_mode("error")``), ``wandb`` (``watch(log="all")``);
``<variant>@ref``: with the library of the checkout in ``--ref DIR``.

By default each window (2 untimed steps, ``--steps`` timed) runs in a fresh process: the median
step, its ratio to ``bare``, µs per watched module, event bytes per step, the GPU's peak memory.
``--one-process``: every variant in this process (first deciles too). ``--per-module``: ``mlp500``,
1 thread, CPU time (``PER_MODULE``; ``--floor``: class ``Floor``). ``--lightning``: fits, plain and
``GradHooks`` every step and every 50. ``--kernels``: the time in the compiled statistics and the
attention logits. ``--compiled``: see :func:`compiled`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

C.use_repo()
import torch  # noqa: E402
from torch import nn  # noqa: E402

PARTS = {"hist": "histograms", "noise": "noise_scale", "outputs": "activations", "logits": "attention_logits"}
BASES = ("bare", "armed", "armed_eager", "logged", "logged_tb", "offload", "sentinel", "spikes", "wandb",
         "floor_hooks", "floor_read", "floor_outputs")
PER_MODULE = {"grads": "armed-nohist-nonoise-nooutputs", "outputs": "armed-nohist-nonoise",
              "outputs+noise": "armed-nohist", "outputs+histograms": "armed-nonoise"}


def parse(variant: str) -> tuple[str, dict[str, bool], bool]:
    """``armed-nohist@ref`` is ``("armed", {"histograms": False}, True)``."""
    name, ref = variant.removesuffix("@ref"), variant.endswith("@ref")
    base, *parts = PER_MODULE.get(name, name).split("-no")
    if base not in BASES or any(p not in PARTS for p in parts) or (parts and not base.startswith(("armed", "logged"))):
        raise SystemExit(f"variant expected one of {', '.join(BASES + tuple(PER_MODULE))}, armed and logged ones "
                         f"followed by -no<part> (part in {', '.join(PARTS)}), optionally @ref; got {variant!r}")
    return base, {PARTS[p]: False for p in parts}, ref


class Floor:
    """The floor of the monitor's design on Linear layers, in its interface: per Linear a forward hook
    that puts one post-hook on the output's node (``Read.EDGE``); ``floor_hooks``: it does nothing;
    ``floor_read``: it keeps ``grad_output`` and ``grad_input``, read at collect with the parameters'
    gradients by one copy into one buffer and one sum; ``floor_outputs``: each output read with them."""

    def __init__(self, model: nn.Module, read: bool, outputs: bool) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.parameters = [p for m in self.modules for p in m.parameters()]
        self.read, self.outputs, self.held = read, outputs, []

    @contextlib.contextmanager
    def arm(self):  # noqa: ANN201
        handles = [m.register_forward_hook(self._forward) for m in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _forward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.grad_fn.register_hook(self._keep if self.read else lambda grad_inputs, grad_outputs: None)
        if self.outputs:
            self.held.append(output.detach())

    def _keep(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.held += (grad_outputs[0], grad_inputs[1])  # Linear's AddmmBackward0: bias, input, weight

    def collect(self) -> None:
        held, self.held = self.held, []
        if self.read:
            grads = [g for g in held if g is not None] + [p.grad for p in self.parameters]
            torch.cat([g.reshape(-1) for g in grads]).sum().item()


class Loop:
    """One model, its optimizer and batch; :meth:`window` times a variant from the initial weights."""

    def __init__(self, name: str, device: str, optimizer: bool = True, ref: str | None = None) -> None:
        import lightning_gradhooks

        self.model, self.batch, self.loss = C.make_case(name, device)
        self.device, self.state = device, {k: v.clone() for k, v in self.model.state_dict().items()}
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4) if optimizer else None
        self.folder = tempfile.mkdtemp()
        self.packages = {False: lightning_gradhooks, True: C.import_checkout(ref, self.folder) if ref else None}
        self.monitors: dict[str, object] = {}
        self.modules = len(lightning_gradhooks.GradientMonitor(self.model).modules)
        self.wandb = None

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _attach(self, variant: str, stack: contextlib.ExitStack, folder: str) -> SimpleNamespace:
        """What ``variant`` puts in (a monitor or floor, a log and its writer, an offload engine, the
        sentinel), attached until ``stack`` closes."""
        base, options, ref = parse(variant)
        package, model = self.packages[ref], self.model
        p = SimpleNamespace(base=base, monitor=None, log=None, writer=None, engine=None, sentinel=None, spikes=None)
        if base.startswith(("armed", "logged")):
            key = f"{variant}/{base == 'armed_eager'}"
            if key not in self.monitors:  # one monitor per variant: compiled once
                self.monitors[key] = package.GradientMonitor(model, **options, compile_statistics=base != "armed_eager")
            p.monitor = self.monitors[key]
            stack.enter_context(p.monitor.attach())
        if base.startswith("floor"):
            p.monitor = Floor(model, base != "floor_hooks", base == "floor_outputs")
        if base.startswith("logged"):
            from torch.utils.tensorboard import SummaryWriter

            p.writer = stack.enter_context(contextlib.closing(SummaryWriter(folder)))
            p.log = package.GradientLog(p.writer, optimizers=[self.optimizer] if self.optimizer else [], echo=None)
            stack.callback(p.log.close)
            if base == "logged_tb":
                stack.enter_context(through_tensorboard(package))
        if base == "offload":
            p.engine = stack.enter_context(contextlib.closing(package.save_on_disk(C.MiB, folder)))
            p.engine.keep_in_memory(model)
        if base == "sentinel":
            p.sentinel = import_module(package.__name__ + ".core.sentinel").NonfiniteSentinel(model.named_parameters())
        if base == "spikes":  # what GradHooks(spikes=True) adds to a step that is not logged
            from torch.utils.tensorboard import SummaryWriter

            watch = import_module(package.__name__ + ".shell._spikes").SpikeWatch(model.named_parameters(),
                                                                                  package.Thresholds())
            p.writer = stack.enter_context(contextlib.closing(SummaryWriter(folder)))
            p.spikes, p.log = watch, package.GradientLog(p.writer, echo=None)
            stack.callback(p.log.close)
            if self.device == "cuda":  # a step that waits for the device raises
                torch.cuda.set_sync_debug_mode("error")
                stack.callback(torch.cuda.set_sync_debug_mode, 0)
        if base == "wandb":
            self.wandb = self.wandb or start_wandb(self.folder)
            self.wandb.watch(model, log="all", log_freq=1, idx=0)
            stack.callback(self.wandb.unwatch, model)
        return p

    def _step(self, p: SimpleNamespace, i: int) -> None:
        with p.monitor.arm() if p.monitor is not None else contextlib.nullcontext():
            with p.engine if p.engine is not None else contextlib.nullcontext():
                loss = self.loss(self.model, self.batch)
            loss.backward()
            if p.spikes is not None:
                for done, _, norm, spike in p.spikes.read():  # the steps whose norms have arrived
                    p.log.write_step_norm(done, norm, spike)
                p.spikes.keep(i, self.optimizer, [self.optimizer], list(self.model.parameters()))
            elif p.log is not None:
                p.log.write(p.monitor.collect(), i)
            elif p.monitor is not None:
                p.monitor.collect()
        if p.sentinel is not None:
            p.sentinel.check()
        if p.base == "wandb":
            self.wandb.log({})
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def _sync(self, p: SimpleNamespace) -> None:
        if p.writer is not None:
            p.writer.flush()  # waits for the checksums and writes
        if self.device == "cuda":
            torch.cuda.synchronize()

    def window(self, variant: str, steps: int, untimed: int, clock) -> float:  # noqa: ANN001
        """The mean of ``steps`` steps of ``variant`` after ``untimed`` ones, from the initial weights."""
        self.model.load_state_dict(self.state)
        with contextlib.ExitStack() as stack:
            p = self._attach(variant, stack, tempfile.mkdtemp(dir=self.folder))
            for i in range(untimed):
                self._step(p, i)
            self._sync(p)
            start = clock()
            for i in range(untimed, untimed + steps):
                self._step(p, i)
            self._sync(p)
            return (clock() - start) / steps


@contextlib.contextmanager
def through_tensorboard(package):  # noqa: ANN001, ANN201
    """While active, the log writes each step's event through the SummaryWriter's own file writer."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    log_module = import_module(package.__name__ + ".log.writers")  # whose write_step the log calls
    tb = import_module(package.__name__ + ".log._tensorboard")

    def write_step(writer, metrics, record, step, stats=None):  # noqa: ANN001, ANN202
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
        values += tb.histogram_values(record) if record is not None else []
        values += [tb.stats_value(stats)] if stats else []
        writer._get_file_writer().add_summary(Summary(value=values), step)

    kept, log_module.write_step = log_module.write_step, write_step
    try:
        yield
    finally:
        log_module.write_step = kept


def start_wandb(folder: str):  # noqa: ANN201
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    return wandb.init(mode="offline", dir=folder, project="gradhooks-bench")


def worker(args: argparse.Namespace) -> None:
    """One window of one variant in this process (see :func:`processes`)."""
    loop = Loop(args.model, args.device)
    mean = loop.window(args.worker.removesuffix("@ref"), args.steps, 2, C.clock(args.clock))
    files = [os.path.join(d, f) for d, _, fs in os.walk(loop.folder) for f in fs if "tfevents" in f]
    event_bytes = sum(os.path.getsize(f) for f in files) / (2 + args.steps)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    loop.close()
    C.result({"mean": mean, "peak": peak, "modules": loop.modules, "event_bytes": event_bytes})


def processes(args: argparse.Namespace, model: str, variants: list[str]) -> None:
    """Each window in a fresh process, the variants interleaved round by round."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in C.rotated(variants, r):
            results[variant].append(C.run_worker(Path(__file__), [
                "--worker", variant, "--model", model, "--device", args.device, "--steps", str(args.steps),
                "--threads", str(args.threads), "--clock", args.clock], args.ref if variant.endswith("@ref") else None))
            print(f"  {model} round {r + 1} {variant}: {results[variant][-1]['mean'] * 1e3:.1f} ms", flush=True)
    bare = results[variants[0]]
    print(f"\n{model}: {args.rounds} rounds x {args.steps} steps, medians\n| variant | step (ms) | vs bare | "
          f"µs per module | event bytes per step |" + (" peak memory |" if args.device == "cuda" else "")
          + "\n|---|---|---|---|---|" + "---|" * (args.device == "cuda"))
    for variant, res in results.items():
        modules = res[0]["modules"]
        ratio = statistics.median(r["mean"] / max(b["mean"], 1e-12) for r, b in zip(res, bare))
        extra = statistics.median((r["mean"] - b["mean"]) / modules * 1e6 for r, b in zip(res, bare))
        cells = [variant, f"{statistics.median(r['mean'] for r in res) * 1e3:.1f}",
                 f"{ratio:.3f}x", f"{extra:.0f}",
                 f"{statistics.median(r['event_bytes'] for r in res) / 1024:.0f} KiB"]
        if args.device == "cuda":
            cells.append(f"{statistics.median(r['peak'] for r in res) / C.MiB:.0f} MiB")
        print("| " + " | ".join(cells) + " |", flush=True)


def one_process(args: argparse.Namespace, model: str, variants: list[str]) -> None:
    """Every variant in this process, interleaved; a window is 1 untimed step and ``--steps`` timed."""
    loop = Loop(model, args.device, optimizer=not args.per_module, ref=args.ref)
    clock = C.clock(args.clock)
    try:
        for variant in variants:  # compile, plan the reads
            loop.window(variant, 1, 1, clock)
        windows = {v: (lambda v=v: loop.window(v, args.steps, 1, clock)) for v in variants}
        times = C.interleave(windows, args.rounds, f"{model} ")
    finally:
        loop.close()
    per = 500 if args.per_module else loop.modules
    print(f"\n{model}: {args.rounds} rounds x {args.steps} steps in one process; µs per watched module ({per})")
    C.table(times, variants[0], per=per, deciles=True)


def lightning(args: argparse.Namespace, model_name: str) -> None:
    """Fits with a TensorBoardLogger: plain, GradHooks every step and every 50 steps."""
    import logging
    import warnings

    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_gradhooks import GradHooks

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    model, batch, loss = C.make_case(model_name, args.device)
    state, clock = {k: v.clone() for k, v in model.state_dict().items()}, C.clock(args.clock)

    class Fit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, b, i):  # noqa: ANN001, ANN201
            return loss(self.model, b)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times, self.start = [], 0.0

        def on_train_batch_start(self, *a) -> None:  # noqa: ANN002
            self.start = clock()

        def on_train_batch_end(self, *a) -> None:  # noqa: ANN002
            self.times.append(clock() - self.start)

    medians: dict[str, list[float]] = {}

    def fit(name: str, callbacks: list, folder: str) -> float:
        model.load_state_dict(state)
        timer = Timer()
        trainer = pl.Trainer(max_steps=args.steps, logger=TensorBoardLogger(folder), callbacks=[*callbacks, timer],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             log_every_n_steps=50, accelerator=args.device)
        trainer.fit(Fit(), torch.utils.data.DataLoader([batch] * args.steps, batch_size=None))
        medians.setdefault(name, []).append(statistics.median(timer.times[2:]))
        return statistics.fmean(timer.times[2:])

    variants = {"plain": lambda: [], "GradHooks every step": lambda: [GradHooks(every_n_steps=1)],
                "GradHooks every 50 steps": lambda: [GradHooks(every_n_steps=50)]}
    with tempfile.TemporaryDirectory() as folder:
        fit("GradHooks every step", variants["GradHooks every step"](), folder)  # compile once
        medians.clear()
        times = C.interleave({n: (lambda n=n, m=m: fit(n, m(), folder)) for n, m in variants.items()}, args.rounds,
                             f"{model_name} ")
    print(f"\n{model_name}, Lightning: {args.rounds} fits of {args.steps} steps (first 2 left out); the mean step")
    C.table(times, "plain")
    print("the median step")
    C.table(medians, "plain")


def kernels(args: argparse.Namespace, model_name: str) -> None:
    """The time a logged step spends in its compiled statistics and attention logits (see the docstring)."""
    from lightning_gradhooks import GradientMonitor
    from lightning_gradhooks.core import _kernels, attention

    clock, spent = C.clock(args.clock), {}

    def timed(function, key):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            start = clock()
            try:
                return function(*a, **k)
            finally:
                spent[key(a)] = spent.get(key(a), 0.0) + clock() - start
        return call

    run, logits = _kernels.run, attention.max_logits
    _kernels.run, attention.max_logits = timed(run, lambda a: a[0].__name__), timed(logits, lambda a: "max_logits")
    try:
        model, batch, loss = C.make_case(model_name, args.device)
        monitor, bare, armed = GradientMonitor(model), [], []
        with monitor.attach():
            for step in range(args.steps + 2):
                start = clock()
                loss(model, batch).backward()
                bare.append(clock() - start)
                model.zero_grad(set_to_none=True)
                if step == 2:
                    spent.clear()  # after the warm-up steps: plans, compiles
                start = clock()
                with monitor.arm():
                    loss(model, batch).backward()
                    monitor.collect()
                armed.append(clock() - start)
                model.zero_grad(set_to_none=True)
    finally:
        _kernels.run, attention.max_logits = run, logits
    b, a = statistics.median(bare[2:]), statistics.median(armed[2:])
    print(f"{model_name}: bare step {b * 1e3:.1f} ms, logged step {a * 1e3:.1f} ms ({a / b:.3f}x); per logged step:")
    for key, seconds in sorted(spent.items()):
        print(f"  {key:<15} {seconds / args.steps * 1e3:8.1f} ms  {seconds / args.steps / b:7.2%} of a bare step")


def compiled(args: argparse.Namespace, model_name: str) -> None:
    """``--compiled``: the model under ``torch.compile`` (Inductor), windows interleaved: not logged,
    every step logged (eager: ``set_stance("force_eager")``), every step logged kept compiled
    (``eager_logged_steps=False``), and ``--every`` steps with the first logged against as many with
    none (the amortized cost); and the bytes autograd saves for backward in one step of each kind."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_gradhooks import GradientLog, GradientMonitor

    model, batch, loss = C.make_case(model_name, args.device)
    fast, optimizer, folder = torch.compile(model), torch.optim.SGD(model.parameters(), lr=1e-4), tempfile.mkdtemp()
    writer = SummaryWriter(folder)
    log = GradientLog(writer, optimizers=[optimizer], echo=None)
    monitors = {"logged": GradientMonitor(fast), "kept": GradientMonitor(fast, eager_logged_steps=False)}
    for monitor in monitors.values():
        monitor.attach()

    def step(monitor: GradientMonitor | None = None) -> None:
        with monitor.arm() if monitor is not None else contextlib.nullcontext():
            loss(fast, batch).backward()
            if monitor is not None:
                log.write(monitor.collect(), 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def saved(monitor: GradientMonitor | None) -> int:  # each storage once
        storages: dict[int, int] = {}
        pack = lambda t: storages.__setitem__(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(monitor)
        return sum(storages.values())

    def window(monitor: GradientMonitor | None, steps: int, first: bool = False) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for i in range(steps):
                step(monitor if not first or i == 0 else None)
            return (time.perf_counter() - start) / steps
        return run

    for monitor in (None, *monitors.values(), None):  # compiles, plans, warms up
        step(monitor)
    print(f"{model_name}: saved for backward " + ", ".join(
        f"{n} {saved(monitors.get(n)) / 2**20:.1f} MiB" for n in ("compiled", "logged", "kept")))
    times = C.interleave({"compiled": window(None, args.steps), "logged": window(monitors["logged"], args.steps),
                          "kept": window(monitors["kept"], args.steps),
                          "plain": window(None, args.every), "every": window(monitors["logged"], args.every, True)},
                         args.rounds, f"{model_name} ")
    every, plain = times.pop("every"), times.pop("plain")
    C.table(times, "compiled")
    print(f"amortized, one logged step in {args.every}: {C.quartiles([e / p for e, p in zip(every, plain)])[1]:.4f}x; "
          f"{torch._dynamo.utils.counters['stats']['unique_graphs']} graphs compiled by Dynamo")
    log.close()
    writer.close()
    shutil.rmtree(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet18,mlp500,encoder", help="of " + ", ".join(C.MODELS))
    parser.add_argument("--variants", default=None, help="comma-separated, starting with bare (default: "
                        "bare,logged,logged_tb; --per-module: bare,grads,outputs,outputs+noise,outputs+histograms)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window (--lightning: steps per fit)")
    parser.add_argument("--ref", default=None, metavar="DIR", help="the checkout that @ref variants run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--one-process", action="store_true", help="every variant in this process")
    parser.add_argument("--per-module", action="store_true", help="host µs per watched module on mlp500")
    parser.add_argument("--floor", action="store_true", help="with --per-module: the floors of the design too")
    parser.add_argument("--lightning", action="store_true", help="Lightning fits instead")
    parser.add_argument("--kernels", action="store_true", help="the time in the compiled statistics and logits")
    parser.add_argument("--compiled", action="store_true", help="the model compiled: unlogged, logged (eager), "
                        "kept-compiled and amortized steps")
    parser.add_argument("--every", type=int, default=50, help="--compiled: one logged step in this many")
    for hidden in ("--worker", "--model", "--repo"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.per_module:
        args.models, args.one_process, args.threads, args.clock = "mlp500", True, args.threads or 1, "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    C.header(args.device)
    default = "bare,grads,outputs,outputs+noise,outputs+histograms" if args.per_module else "bare,logged,logged_tb"
    variants = (args.variants or default).split(",") + ["floor_hooks", "floor_read", "floor_outputs"] * args.floor
    for variant in variants:
        parse(variant)  # an unknown variant: said before the first window
    if variants[0] != "bare" or (any(v.endswith("@ref") for v in variants) and not args.ref):
        raise SystemExit(f"--variants expected to start with bare, and --ref DIR with @ref variants; got {variants}")
    start = time.perf_counter()
    for model in args.models.split(","):
        if args.lightning:
            lightning(args, model)
        elif args.kernels:
            kernels(args, model)
        elif args.compiled:
            compiled(args, model)
        elif args.one_process:
            one_process(args, model, variants)
        else:
            processes(args, model, variants)
    print(f"wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
