"""Host time per watched module of a logged step, with and without the output statistics.

    python benchmarks/host_per_module.py [--layers 500] [--rounds 9] [--steps 4] [--threads 1] [--clock cpu|wall]
    python benchmarks/host_per_module.py --profile "outputs"    # cProfile of one variant's steps
    python benchmarks/host_per_module.py --ops                  # aten ops of a logged step beyond a bare one
    python benchmarks/host_per_module.py --floor                # also the floors of the hooks and reads (class Floor)

The model, 500 x (Linear(64, 64) + Tanh) on a batch of 32, is so small that a step is bound by
the host: what an armed step costs beyond a bare one, divided by the watched modules (the Linear
layers), is the host time of our hooks, bookkeeping, reductions and ``collect`` per module. A step
is forward, backward, ``collect`` (armed variants) and ``zero_grad``; no optimizer, no writing.
Variants, interleaved round by round in one process, each window one untimed step and the mean
of ``--steps`` steps: ``bare`` (no monitor), ``grads`` (``GradientMonitor(histograms=False,
noise_scale=False, activations=False)``), ``outputs`` (the same with ``activations=True``),
``outputs + noise`` (the noise probe too), ``outputs + histograms`` (64-bin histograms too).
Prints per variant the median window, the median per-round ratio to ``bare`` and the median
per-round (variant - bare) / layers in microseconds, and the first decile of the variant's windows
less bare's (with ``--steps 1`` and many rounds, the steadiest figure on a shared machine: noise
only adds), then the same split by phase (:data:`PHASES`).
``--clock cpu`` (default) times the process's CPU time (``time.process_time``; with one thread,
the host's own work, steadier on a shared machine than wall time), ``--clock wall`` wall time. ``--ops`` counts instead the aten ops that one
logged step (forward, backward, ``collect``) dispatches beyond a bare step, per variant, and those
that are not views (on a GPU, each of those is a kernel launch): a change to the host side must not
add any. Under the counting mode the statistics run as their eager ops.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.core.stats import Reducer, Scratch

#: Ops that make no kernel: views and the like.
VIEWS = frozenset({"aten.view", "aten.detach", "aten.slice", "aten.unbind", "aten.select", "aten.as_strided",
                   "aten.alias", "aten.t", "aten.transpose", "aten.expand", "aten.unsqueeze", "aten.squeeze"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


#: The phases of a step, timed apart: registering the hooks (``attach`` and ``arm``); the forward
#: (module hooks, input views, the output statistics' bookkeeping); the backward (gradient hooks,
#: their bookkeeping, batches reduced as they fill); ``collect`` (parameter gradients, the last
#: batches, the one transfer, the record); leaving (``disarm``: the hooks taken out; ``zero_grad``).
PHASES = ("arm", "forward", "backward", "collect", "leave")

VARIANTS = {
    "bare": None,
    "grads": {"histograms": False, "noise_scale": False, "activations": False},
    "outputs": {"histograms": False, "noise_scale": False, "activations": True},
    "outputs + noise": {"histograms": False, "activations": True},
    "outputs + histograms": {"noise_scale": False, "activations": True},
}


class Floor:
    """The floor of the monitor's ways of reading gradients, in its interface (``--floor``): per
    watched module, a forward pre-hook and a forward hook put in at ``arm`` and taken out after,
    that do nothing; with ``views``, they also pass the input through a view and hook the autograd
    nodes of the view and of the output, with a hook that does nothing (``Read.VIEWS``); with
    ``edge``, a forward hook alone that puts a post-hook doing nothing on the output's node
    (``Read.EDGE``: ``grad_output`` and ``grad_input`` from one hook). With ``read``, the edge's
    post-hook keeps both gradients, and ``collect`` reads them with the parameters' gradients,
    each read once: ``"cat"``, one copy of them all into one buffer and one sum of it (the least a
    batched reduction does: the floor of the monitor's design); ``"reducer"``, the library's
    :class:`~lightning_gradhooks.core.stats.Reducer` (the statistics, their one transfer and rows,
    without the monitor's bookkeeping: pending names, entries, the record). ``outputs``: the
    forward hook also keeps each module's output, read with the gradients (the floor of the
    output statistics)."""

    def __init__(self, modules: list[nn.Module], views: bool, edge: bool = False, read: str | None = None,
                 outputs: bool = False) -> None:
        self._modules, self._views, self._edge, self._read, self._outputs = modules, views, edge, read, outputs
        self._parameters = [p for m in modules for p in m.parameters()]
        self._held: list[torch.Tensor] = []
        self._scratch = Scratch()

    @contextlib.contextmanager
    def attach(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def arm(self) -> Iterator[None]:
        if self._edge:
            handles = [m.register_forward_hook(self._post_edge) for m in self._modules]
        else:
            handles = [h for m in self._modules for h in (m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def collect(self) -> None:
        held, self._held = self._held, []
        if self._read is None:
            return
        grads = [g for g in held if g is not None] + [p.grad for p in self._parameters]  # the first has no grad_input
        if self._read == "cat":
            torch.cat([g.view(-1) for g in grads]).sum().item()
        else:
            reducer = Reducer(64, self._scratch)
            reducer.extend(grads, False)
            reducer.finish()

    def _pre(self, module: nn.Module, args: tuple) -> tuple | None:
        if not (self._views and args[0].requires_grad):
            return None
        view = args[0].view_as(args[0])
        view.grad_fn.register_prehook(_nothing)
        return (view,)

    def _post(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._views:
            output.grad_fn.register_prehook(_nothing)


    def _post_edge(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.grad_fn.register_hook(self._keep if self._read else _nothing_after)
        if self._outputs:
            self._held.append(output.detach())

    def _keep(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self._held += (grad_outputs[0], grad_inputs[1])  # Linear's AddmmBackward0: bias, input, weight


def _nothing(grads: tuple) -> None:
    return None


def _nothing_after(grad_inputs: tuple, grad_outputs: tuple) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    parser.add_argument("--profile", default=None, help="profile this variant's steps instead")
    parser.add_argument("--ops", action="store_true", help="count the aten ops of a logged step instead")
    parser.add_argument("--floor", action="store_true", help="also time the floors of the hooks and reads (class Floor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(args.layers) for m in (nn.Linear(64, 64), nn.Tanh())))
    x = torch.randn(32, 64)
    monitors = {name: None if options is None else GradientMonitor(model, **options) for name, options in VARIANTS.items()}
    if args.floor:
        linears = [m for m in model if isinstance(m, nn.Linear)]
        monitors |= {"floor: module hooks": Floor(linears, False), "floor: + views, node hooks": Floor(linears, True),
                     "floor: forward hook + one node post-hook": Floor(linears, False, edge=True),
                     "floor: + one copy and one sum of the gradients": Floor(linears, False, edge=True, read="cat"),
                     "floor: + the outputs too": Floor(linears, False, edge=True, read="cat", outputs=True),
                     "floor: + Reducer, no monitor bookkeeping": Floor(linears, False, edge=True, read="reducer")}

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def step(monitor: GradientMonitor | Floor | None) -> list[float]:
        """One step; the time of each of its :data:`PHASES`."""
        t = [clock()]
        if monitor is None:
            t.append(t[0])
            loss = model(x).square().mean()
            t.append(clock())
            loss.backward()
            t += [clock()] * 2
        else:
            with monitor.attach(), monitor.arm():
                t.append(clock())
                loss = model(x).square().mean()
                t.append(clock())
                loss.backward()
                t.append(clock())
                monitor.collect()
                t.append(clock())
        model.zero_grad(set_to_none=True)
        t.append(clock())
        return [b - a for a, b in zip(t, t[1:])]

    for monitor in monitors.values():  # compile, probe the read plans
        for _ in range(2):
            step(monitor)
    if args.ops:
        counted = {}
        for name, monitor in monitors.items():
            with OpCounter() as counter:
                step(monitor)
            counted[name] = counter.ops
        print(f"aten ops of one logged step beyond a bare step ({args.layers} layers)\n| variant | ops | not views |\n|---|---|---|")
        for name, ops in counted.items():
            extra = ops - counted["bare"]
            print(f"| {name} | {sum(extra.values())} | {sum(n for op, n in extra.items() if op not in VIEWS)} |")
        return
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps * 5):
            step(monitors[args.profile])
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    times: dict[str, list[float]] = {name: [] for name in monitors}
    phases: dict[str, list[list[float]]] = {name: [] for name in monitors}  # per round, the mean of each phase
    names = list(monitors)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            step(monitors[name])
            start = clock()
            window = [step(monitors[name]) for _ in range(args.steps)]
            times[name].append((clock() - start) / args.steps)
            phases[name].append([statistics.fmean(p) for p in zip(*window)])
    print(f"command: python benchmarks/host_per_module.py --layers {args.layers} --rounds {args.rounds} "
          f"--steps {args.steps} --threads {args.threads} --clock {args.clock}; torch {torch.__version__}")
    print(f"| variant | step (ms) | armed / bare | µs per watched module over bare | the same, first deciles |\n"
          f"|---|---|---|---|---|")
    bare = times["bare"]
    decile = lambda ts: statistics.quantiles(ts, n=10)[0] if len(ts) > 1 else ts[0]  # noqa: E731
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, bare))
        extra = statistics.median((t - b) / args.layers * 1e6 for t, b in zip(ts, bare))
        low = (decile(ts) - decile(bare)) / args.layers * 1e6
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {ratio:.2f}x | {extra:.0f} | {low:.1f} |")
    print(f"\nWhere it goes: µs per watched module over bare, by phase (medians of the per-round differences)\n"
          f"| variant | {' | '.join(PHASES)} |\n|---|{'---|' * len(PHASES)}")
    for name in names[1:]:
        cells = [statistics.median((v[i] - b[i]) / args.layers * 1e6 for v, b in zip(phases[name], phases["bare"]))
                 for i in range(len(PHASES))]
        print(f"| {name} | {' | '.join(f'{c:.1f}' for c in cells)} |")


if __name__ == "__main__":
    main()
