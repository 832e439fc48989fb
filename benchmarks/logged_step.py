"""The cost of a logged step (every statistic reduced, written to TensorBoard) and of disk offload,
on the CPU or a GPU.

    python benchmarks/logged_step.py [--device cpu|cuda] [--models resnet18,mlp500,encoder]
        [--variants "bare,logged,logged_tb"] [--rounds 5] [--steps 5] [--ref DIR] [--offload]
    python benchmarks/logged_step.py --models resnet18 --variants bare,armed,armed_eager --threads 1 --clock cpu \
        [--ref DIR --ref-variant armed]    # the statistics compiled, eager, and another checkout's

Models: ``resnet18``, ``mlp500`` and ``encoder`` of many_modules.py; ``resnet50`` and ``gpt2``
(GPT-2 small, 12 x 768, built by transformers from its config: no download). A plain loop, SGD,
the same batch every step. Variants, each window in a fresh process, interleaved round by round:

- ``bare``: forward, backward, optimizer step;
- ``logged``: the same with every step logged: ``GradientMonitor.arm``, ``collect`` and
  ``GradientLog.write`` into a ``SummaryWriter`` (the steps go to our own event file,
  checksummed in C);
- a suffix of ``-no<part>`` (one or more) leaves a part of the monitor's defaults out of an
  ``armed`` or ``logged`` variant: ``-nohist`` (``histograms=False``), ``-nonoise``
  (``noise_scale=False``), ``-nooutputs`` (``activations=False``: no output statistics) and
  ``-nologits`` (``attention_logits=False``); e.g. the split of a logged step, part by part:
  ``--variants bare,armed-nohist-nonoise-nooutputs-nologits,armed-nonoise-nooutputs-nologits,``
  ``armed-nonoise-nologits,armed-nonoise,armed,logged``;
- ``armed``, ``armed_eager``: ``GradientMonitor.arm`` and ``collect`` with nothing written, the
  statistics compiled (``compile_statistics=True``, the default) or not (``False``: the eager
  sequence that runs where no compiler is);
- ``logged_tb``: the same, each step's event written through the SummaryWriter's own
  file writer instead (TensorBoard's pure-Python CRC-32C, in its writer thread): the cost of
  leaving the writing to TensorBoard;
- ``logged@ref`` (with ``--ref DIR``): ``logged`` (or ``--ref-variant``) with the library of the
  checkout in DIR;
- with ``--offload``: ``offload``, the bare step under ``save_on_disk(threshold_bytes=1 MiB)``;
- ``spikes``: the bare step with what ``GradHooks(spikes=True)`` adds to a step that is not
  logged: the gradient norms kept (one fused norm and a copy, before the optimizer step), the
  last step's judged on the host and its total norm written to the event file; on a GPU under
  ``torch.cuda.set_sync_debug_mode("error")``: a step that waited for the device would raise.

A window is 2 untimed steps, then ``--steps`` steps timed together up to ``writer.flush()``
(which waits for the writer thread's checksums and writes) and, on a GPU,
``torch.cuda.synchronize()``. Reported: the median over rounds of the window's mean step, its
ratio to ``bare`` (median of per-round ratios), for logged variants what a logged step adds per
watched module in µs (median of per-round figures), the event-file bytes per step (all files), and
on a GPU the peak ``torch.cuda.max_memory_allocated`` of the window. ``--clock cpu`` times the
process's CPU time instead of wall time (with ``--threads 1``, the work itself, steadier on a
shared machine). Each window's time is printed
as it comes, so a run stopped by a time limit still shows what it measured.

``--write-only``: the time of writing one logged step's event alone (the same scalars,
histograms and compact summary, written ``--steps`` times up to ``writer.flush()``), where a
loaded machine's noise on the step would hide it; ``bare`` then times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A worker of ``--ref DIR`` imports the library from DIR.
sys.path.insert(0, sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else str(HERE.parent))
sys.path.insert(1, str(HERE))

MiB = 1 << 20


def make_case(name: str, device: str):  # noqa: ANN201
    """(model, batch, loss function) on ``device``."""
    import torch
    from torch.nn import functional as F

    if name in ("resnet18", "mlp500", "encoder"):
        from many_modules import cases

        case = cases(device)[name]
        torch.manual_seed(0)
        return case.make(), case.batch, case.loss
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetForImageClassification  # ResNetConfig() is ResNet-50

        batch = (torch.randn(16, 3, 224, 224, generator=g), torch.randint(0, 1000, (16,), generator=g))
        if device == "cpu":
            batch = (torch.randn(2, 3, 128, 128, generator=g), batch[1][:2])
        model = ResNetForImageClassification(ResNetConfig(num_labels=1000))
        loss = lambda m, b: F.cross_entropy(m(pixel_values=b[0]).logits, b[1])  # noqa: E731
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel  # GPT2Config() is GPT-2 small

        shape = (4, 512) if device == "cuda" else (2, 128)
        batch = (torch.randint(0, 50257, shape, generator=g),)
        model = GPT2LMHeadModel(GPT2Config())
        loss = lambda m, b: m(input_ids=b[0], labels=b[0]).loss  # noqa: E731
    else:
        raise SystemExit(f"unknown model {name!r}")
    return model.to(device), tuple(t.to(device) for t in batch), loss


#: What a variant's ``-no<part>`` suffix turns off of the monitor's defaults.
PARTS = {"hist": "histograms", "noise": "noise_scale", "outputs": "activations", "logits": "attention_logits"}
BASES = ("bare", "armed", "armed_eager", "logged", "logged_tb", "offload", "spikes")


def variant_options(variant: str) -> tuple[str, dict[str, bool]]:
    """A variant's base and the monitor's options it turns off: ``armed-nohist-nologits`` is
    ``("armed", {"histograms": False, "attention_logits": False})``."""
    base, *parts = variant.split("-no")
    unknown = [p for p in parts if p not in PARTS]
    if base not in BASES or unknown or (parts and not base.startswith(("armed", "logged"))):
        raise SystemExit(f"variant expected one of {', '.join(BASES)}, armed and logged variants followed by "
                         f"-no<part> with part in {', '.join(PARTS)}; got {variant!r}")
    return base, {PARTS[p]: False for p in parts}


def worker(args: argparse.Namespace) -> None:
    import torch
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    from lightning_gradhooks import GradientLog, GradientMonitor, log as log_module
    from lightning_gradhooks.offload import save_on_disk

    (variant, options), device = variant_options(args.worker), args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, batch, loss_fn = make_case(args.model, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    folder = tempfile.mkdtemp()
    writer = SummaryWriter(folder)
    logged = variant.startswith("logged")
    monitor = GradientMonitor(model, **options, compile_statistics=variant != "armed_eager") \
        if logged or variant.startswith("armed") else None
    if variant == "logged_tb":
        from lightning_gradhooks.log import _tensorboard

        def through_summary_writer(writer, metrics, record, step, stats=None):  # noqa: ANN001, ANN202
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
            values += _tensorboard.histogram_values(record) if record is not None else []
            values += [_tensorboard.stats_value(stats)] if stats else []
            writer._get_file_writer().add_summary(Summary(value=values), step)  # TensorBoard's pure-Python checksum

        log_module.write_step = through_summary_writer  # this benchmark process only
    log = GradientLog(writer, optimizers=[optimizer], echo=None) if logged else None
    spikes = spike_log = None
    if variant == "spikes":
        from lightning_gradhooks.health import Thresholds
        from lightning_gradhooks.shell._spikes import SpikeWatch

        spikes, spike_log = SpikeWatch(model.named_parameters(), Thresholds()), GradientLog(writer, echo=None)
        params = [p for p in model.parameters() if p.requires_grad]
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")  # this benchmark process only
    offload = save_on_disk(MiB, folder) if variant == "offload" else None
    if offload is not None:
        offload.keep_in_memory(model)
    attach = monitor.attach() if monitor is not None else None
    if attach is not None:
        attach.__enter__()

    def step(i: int) -> None:
        if monitor is not None:
            monitor.arm()
        if offload is not None:
            with offload:
                loss = loss_fn(model, batch)
        else:
            loss = loss_fn(model, batch)
        loss.backward()
        if spikes is not None:
            for done, _, norm, spike in spikes.read():  # the steps whose norms have arrived
                spike_log.write_step_norm(done, norm, spike)
            spikes.keep(i, optimizer, [optimizer], params)
        if log is not None:
            log.write(monitor.collect(), i)
        elif monitor is not None:
            monitor.collect()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        writer.flush()
        if device == "cuda":
            torch.cuda.synchronize()

    for i in range(2):
        step(i)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = clock()
    if args.write_only and log is None:
        pass  # bare: nothing to write
    elif args.write_only:  # one step's event, written again and again
        monitor.arm()
        loss_fn(model, batch).backward()
        record = monitor.collect()
        from lightning_gradhooks.log._tensorboard import scalar_metrics
        from lightning_gradhooks.core.records import step_summary

        metrics = scalar_metrics(record, log.statistics, set())
        stats = step_summary(record)
        sync()
        t0 = clock()
        for i in range(2, 2 + args.steps):
            log_module.write_step(writer, metrics, record, i, stats)
    else:
        for i in range(2, 2 + args.steps):
            step(i)
    sync()
    mean = (clock() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if log is not None:
        log.close()
    if spikes is not None:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        spike_log.close()
    if attach is not None:
        attach.__exit__(None, None, None)
    writer.close()
    if offload is not None:
        offload.close()
    event_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if "tfevents" in f)
    shutil.rmtree(folder)
    modules = len(monitor.modules) if monitor is not None else 0
    print(json.dumps({"mean": mean, "peak": peak, "event_bytes": event_bytes / (2 + args.steps), "modules": modules}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="resnet18,mlp500,encoder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default="bare,logged,logged_tb",
                        help="comma-separated, starting with bare (default: %(default)s)")
    parser.add_argument("--ref", default=None, metavar="DIR", help="also run `logged` with the checkout in DIR")
    parser.add_argument("--ref-variant", default="logged",
                        help="what the checkout of --ref runs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each window (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="wall time, or the process's CPU time")
    parser.add_argument("--offload", action="store_true", help="also run the bare step under save_on_disk")
    parser.add_argument("--write-only", action="store_true",
                        help="time only the writing of one logged step's event (scalars, histograms, summary), "
                             "up to writer.flush(); bare: 0")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--repo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
    runs = [(v, None) for v in args.variants.split(",")]
    for variant, _ in runs:
        variant_options(variant)  # an unknown variant: said before the first window
    runs += [(args.ref_variant, args.ref)] if args.ref else []
    runs += [("offload", None)] if args.offload else []
    if runs[0] != ("bare", None):
        raise SystemExit(f"--variants expected to start with bare, got {args.variants!r}")
    label = lambda variant, repo: f"{variant}@ref" if repo else variant  # noqa: E731
    print(f"command: python {' '.join(sys.argv)}")
    print(f"device: {args.device}; {os.cpu_count()} logical CPUs; {args.threads or 'default'} torch threads; "
          f"{args.clock} clock; load average {os.getloadavg()[0]:.1f}" + (f"; ref {args.ref}" if args.ref else ""))
    for model in args.models.split(","):
        results: dict[str, list[dict]] = {label(v, r): [] for v, r in runs}
        for _ in range(args.rounds):
            for variant, repo in runs:
                cmd = [sys.executable, __file__, "--worker", variant, "--model", model, "--device", args.device,
                       "--steps", str(args.steps), "--threads", str(args.threads), "--clock", args.clock,
                       *(["--repo", repo] if repo else []),
                       *(["--write-only"] if args.write_only else [])]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{model} / {label(variant, repo)} failed:\n{done.stderr[-4000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results[label(variant, repo)].append(result)
                print(f"  {model} round {len(results[label(variant, repo)])} {label(variant, repo)}: "
                      f"{result['mean'] * 1e3:.1f} ms", flush=True)  # a run stopped by a time limit shows this much
        print(f"\n{model}: {args.rounds} rounds x {args.steps} steps, medians")
        print(f"  {'variant':<20}{'step':>10}{'vs bare':>9}{'us/module':>11}{'event':>10}"
              + (f"{'peak mem':>11}" if args.device == "cuda" else ""))
        for name, res in results.items():
            step = statistics.median(r["mean"] for r in res)
            ratio = statistics.median(r["mean"] / max(b["mean"], 1e-9)
                                      for r, b in zip(res, results["bare"], strict=True))
            event = statistics.median(r["event_bytes"] for r in res)
            shown = "-" if args.write_only else f"{ratio:.3f}x"  # nothing to compare with
            # Host and device time a logged step adds, per watched module (median of per-round figures).
            modules = res[0]["modules"]  # 0 for bare: no monitor
            shown_module = "-"
            if modules and not args.write_only:
                shown_module = f"{statistics.median((r['mean'] - b['mean']) / modules * 1e6 for r, b in zip(res, results['bare'])):.0f}"
            line = f"  {name:<20}{step * 1e3:>8.1f}ms{shown:>9}{shown_module:>11}{event / 1024:>7.0f} KiB"
            if args.device == "cuda":
                line += f"{statistics.median(r['peak'] for r in res) / MiB:>7.0f} MiB"
            print(line, flush=True)


if __name__ == "__main__":
    main()
