"""Disk offload of saved activations: the memory/time frontier of ``save_on_disk``.

    python benchmarks/offload.py [--dir /scratch] [--rounds 3] [--steps 3] [--variants ...] [--bandwidth] [--ref DIR]

Workload (issue 27's): ``--depth`` x (Linear(width, width) + GELU), batch ``--batch``, fp32, CPU,
forward + backward; by default 6 x 1024, batch 4096: 192 MiB saved per step in 12 tensors of
16 MiB. Each variant runs in its own process, interleaved round by round (peak RSS: VmHWM of the
steps after the warm-up, minus the RSS before the first step): ``none``; ``checkpoint``
(``torch.utils.checkpoint`` around each Linear + GELU); ``threshold`` (``save_on_disk(1 MiB)``,
default knobs); ``budget25``, ``budget50``, ``budget75`` (``budget_bytes`` a share of the bytes
saved per step: the newest stay in memory); and on request ``threshold_nofix``
(``fix_mmap_threshold=False``), ``torch_save`` (the PyTorch docs' hooks, a ``torch.save`` file per
tensor), ``none_mallopt`` (no offload, glibc's mmap threshold fixed as the engine fixes it).
``none`` and ``checkpoint`` run with glibc's defaults. ``--ref DIR``: the offload variants with
the checkout in DIR too (``<variant>@ref``). ``--bandwidth``: the folder's raw sequential
bandwidth (64 MiB blocks) and the engine's alone.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.utils.checkpoint  # imported before the RSS baseline, not during the first step
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

C.use_repo()  # a worker of ``--ref DIR`` imports the library from DIR

from lightning_gradhooks.offload import save_on_disk  # noqa: E402

MiB = 1 << 20
THRESHOLD = MiB
VARIANTS = ("none", "checkpoint", "threshold", "budget25", "budget50", "budget75", "threshold_nofix", "torch_save",
            "none_mallopt")
DEFAULT_VARIANTS = VARIANTS[:6]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS, where Linux allows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: peak RSS of this address space. ``ru_maxrss`` would not do: Linux carries it over
    from the parent across fork and exec, so a child never reports less than its parent's RSS."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def make_model(args: argparse.Namespace) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.depth)])
    return model, torch.randn(args.batch, args.width)


class DocsTorchSave(torch.autograd.graph.saved_tensors_hooks):
    """The PyTorch docs' "saving tensors to disk" hooks: one torch.save file per tensor."""

    def __init__(self, folder: str) -> None:
        class SelfDeletingTempFile:
            def __init__(self) -> None:
                self.name = os.path.join(folder, str(uuid.uuid4()))

            def __del__(self) -> None:
                os.remove(self.name)

        def pack(t: torch.Tensor):  # noqa: ANN202
            if t.numel() * t.element_size() < THRESHOLD:
                return t
            f = SelfDeletingTempFile()
            torch.save(t, f.name)
            return f

        def unpack(f):  # noqa: ANN001, ANN202
            return f if isinstance(f, torch.Tensor) else torch.load(f.name)

        super().__init__(pack, unpack)


def worker(args: argparse.Namespace) -> None:
    """One variant, one process: print a JSON line with step times and peak RSS."""
    model, x = make_model(args)
    variant, folder = args.worker, args.dir or tempfile.gettempdir()
    engine = None
    if variant == "none_mallopt":
        from lightning_gradhooks.offload._memory import fix_mmap_threshold

        fix_mmap_threshold(THRESHOLD)
    if variant.startswith(("threshold", "budget")):
        budget = int(args.saved * int(variant[6:]) / 100) if variant.startswith("budget") else None
        kwargs = {"fix_mmap_threshold": False} if variant == "threshold_nofix" else {}
        engine = save_on_disk(THRESHOLD, folder, budget_bytes=budget, **kwargs)
    docs_dir = tempfile.mkdtemp(dir=folder) if variant == "torch_save" else None

    def forward() -> torch.Tensor:
        if variant == "checkpoint":
            h = x
            for block in model:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            return h.sum()
        if engine is not None:
            with engine:
                return model(x).sum()
        if docs_dir is not None:
            with DocsTorchSave(docs_dir):
                return model(x).sum()
        return model(x).sum()

    times, written = [], 0
    start = rss_bytes()  # model and batch loaded
    if not reset_peak_rss():
        start = peak_rss_bytes()  # the peak so far stands in for it
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # the peak of the measured steps only, over the memory they start from
            if engine is not None:
                written = engine.stats().bytes_written
            baseline = rss_bytes()
            if not reset_peak_rss():
                baseline = peak_rss_bytes()
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = forward()
        loss.backward()
        del loss
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = peak_rss_bytes()
    extra = {}
    if engine is not None:
        s = engine.stats()
        extra = {"written_per_step": (s.bytes_written - written) / args.steps, "files_left": s.files_on_disk,
                 "held_peak": s.bytes_in_memory_peak}
        engine.close()
    if docs_dir is not None:
        extra = {"files_left": len(os.listdir(docs_dir))}
        os.rmdir(docs_dir)
    C.result({"variant": variant, "times": times, "peak_over_baseline": peak - baseline,
              "peak_over_start": peak - start, **extra})


def activation_bytes(args: argparse.Namespace) -> int:
    """Bytes of distinct non-parameter storages saved for backward that reach the threshold."""
    model, x = make_model(args)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad) and (t._base is None or not t._base.requires_grad):
            n = t.untyped_storage().nbytes()
            if n >= THRESHOLD:
                seen[t.untyped_storage().data_ptr()] = n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(seen.values())  # the input included: the engine counts (and may write) it too


# ----------------------------------------------------------------------------- bandwidth


def raw_bandwidth(folder: str, total: int, block: int = 64 * MiB) -> dict[str, tuple[float, str]]:
    """Sequential write and read of ``total`` bytes in ``block``-sized requests, MB/s."""
    path = os.path.join(folder, f"raw-{os.getpid()}.bin")
    sources = [mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE) for _ in range(total // block)]  # page aligned
    for src in sources:  # distinct buffers, as the engine writes distinct tensors
        src.write(os.urandom(1 << 16) * (block >> 16))
    buf = sources[0]

    def timed(flags: int, write: bool, sync: bool = False, fresh: bool = False) -> float:
        fd = os.open(path, flags, 0o600)
        try:
            t0 = time.perf_counter()
            for i in range(total // block):
                if write:
                    os.pwrite(fd, sources[i], i * block)
                else:
                    target = mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE) if fresh else buf
                    if fresh:
                        target.madvise(mmap.MADV_HUGEPAGE)
                    os.preadv(fd, [target], i * block)
            if sync:
                os.fsync(fd)
            return total / (time.perf_counter() - t0) / 1e6
        finally:
            os.close(fd)

    try:  # what the engine does: buffered writes into the page cache, reads into fresh buffers
        create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        return {"write_cached": (timed(create, True), "buffered into the page cache, no fsync"),
                "read_cached_fresh": (timed(os.O_RDONLY, False, fresh=True), "buffered, a new buffer per block")}
    finally:
        os.unlink(path)


def median_of(runs: list[dict]) -> dict:
    return {k: (statistics.median(r[k][0] for r in runs), runs[0][k][1]) for k in runs[0]}


class _Keep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(t)
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        ctx.saved_tensors  # noqa: B018 - unpack
        return grad, None


def engine_bandwidth(folder: str, total: int, block: int = 64 * MiB) -> tuple[float, float]:
    """MB/s of the engine alone: pack ``total`` bytes then wait for the writer; unpack all."""
    tensors = [torch.randn(block // 4) for _ in range(total // block)]
    engine = save_on_disk(THRESHOLD, folder, max_bytes_in_flight=total)
    anchor = torch.zeros(1, requires_grad=True)
    t0 = time.perf_counter()
    with engine:
        h = anchor
        for t in tensors:
            h = _Keep.apply(h, t)
    engine.flush()
    write = engine.stats().bytes_written / (time.perf_counter() - t0) / 1e6
    t0 = time.perf_counter()
    h.sum().backward()
    read = engine.stats().bytes_read / (time.perf_counter() - t0) / 1e6
    engine.close()
    return write, read


# ----------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="folder to offload to (default: the temp folder)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all variants")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--bandwidth", action="store_true", help="also measure raw and engine bandwidth")
    parser.add_argument("--io-mib", type=int, default=1024, help="MiB moved by each bandwidth test")
    parser.add_argument("--io-repeats", type=int, default=3, help="repetitions of each bandwidth test")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--ref", default=None, metavar="DIR",
                        help="also run the offload variants with the library of the checkout in DIR")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--repo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--saved", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    folder = args.dir or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    C.header()
    print(f"folder: {folder}")
    saved = activation_bytes(args)
    print(f"workload: {args.depth} x (Linear({args.width}, {args.width}) + GELU), batch {args.batch}, fp32; "
          f"saved for backward in tensors of 1 MiB or more: {saved / MiB:.0f} MiB per step")

    runs = [(v, v, None) for v in args.variants]  # (label, variant, checkout)
    if args.ref:
        runs += [(f"{v}@ref", v, args.ref) for v in args.variants
                 if v.startswith(("threshold", "budget")) and v != "threshold_nofix"]
    labels = [label for label, _, _ in runs]
    results: dict[str, list[dict]] = {label: [] for label in labels}
    forwarded = ["--batch", str(args.batch), "--width", str(args.width), "--depth", str(args.depth),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--saved", str(saved)]
    forwarded += ["--dir", args.dir] if args.dir else []
    print("allocator: glibc defaults (dynamic mmap threshold)")
    for r in range(args.rounds):
        for v, variant, checkout in runs:
            results[v].append(C.run_worker(Path(__file__), ["--worker", variant, *forwarded], checkout))
            res = results[v][-1]
            print(f"  round {r + 1}/{args.rounds} {v:<18} " + " ".join(f"{t:.2f}s" for t in res["times"])
                  + f"  peak +{res['peak_over_start'] / MiB:.0f} MiB, over the step's start +"
                  f"{res['peak_over_baseline'] / MiB:.0f} MiB", flush=True)

    report(args, labels, results)
    if args.bandwidth:
        bandwidth(folder, args)


def report(args: argparse.Namespace, labels: list[str], results: dict[str, list[dict]]) -> None:
    """The table of the variants (medians over rounds), then the targets."""
    med = {v: statistics.median(t for res in results[v] for t in res["times"]) for v in labels}
    # Time ratios: the median over rounds of the ratio within each round (rounds run back to back,
    # so a burst of load on a shared machine hits the variants of one round alike).
    ratio_of = {v: statistics.median(statistics.median(a["times"]) / statistics.median(b["times"])
                                     for a, b in zip(results[v], results["none"], strict=True))
                for v in labels} if "none" in results else {}
    rss = {v: statistics.median(res["peak_over_start"] for res in results[v]) for v in labels}
    warm = {v: statistics.median(res["peak_over_baseline"] for res in results[v]) for v in labels}
    wrote = {v: statistics.median(res.get("written_per_step", 0) for res in results[v]) for v in labels}
    held = {v: max(res.get("held_peak", 0) for res in results[v]) for v in labels}
    ref_rss = rss.get("none")
    print()
    print("peak: the peak RSS (VmHWM) of the measured steps (after the warm-up) over the RSS before the first")
    print("step (model and batch loaded); over step start: the same peak over the RSS just before the measured")
    print("steps (which keeps what the warm-up left in the heap); medians over rounds. step: median step time;")
    print("vs none: the median over rounds of the within-round ratio of median step times.")
    print("written: per step; engine held: the engine's high-water mark (OffloadStats.bytes_in_memory_peak)")
    print(f"{'variant':<18}{'step':>8}{'vs none':>9}{'peak':>10}{'vs none':>10}{'over step start':>17}{'written':>10}"
          f"{'engine held':>13}")
    for v in labels:
        ratio = f"{ratio_of[v]:.3f}x" if ratio_of else "-"
        delta = f"{(rss[v] - ref_rss) / MiB:+.0f} MiB" if ref_rss is not None else "-"
        print(f"{v:<18}{med[v]:>7.2f}s{ratio:>9}{rss[v] / MiB:>6.0f} MiB{delta:>10}{warm[v] / MiB:>13.0f} MiB"
              f"{wrote[v] / MiB:>6.0f} MiB{held[v] / MiB:>9.0f} MiB")
        if "files_left" in results[v][-1] and results[v][-1]["files_left"]:
            print(f"  warning: {v} left {results[v][-1]['files_left']} files")
    if {"none", "threshold", "budget50"} <= set(args.variants):
        targets(labels, rss, wrote, ratio_of)


def targets(labels: list[str], rss: dict, wrote: dict, ratio_of: dict) -> None:
    """The targets of issue 27, met or missed."""
    ref_rss = rss["none"]

    def verdict(ok: bool) -> str:
        return "met " if ok else "MISS"

    print()
    print("targets (budget50 = half the saved bytes):")
    limit = ref_rss - 0.5 * wrote["budget50"]
    print(f"  [{verdict(rss['budget50'] <= limit)}] peak <= none's peak - 50% of bytes written: "
          f"{rss['budget50'] / MiB:.0f} MiB <= {ref_rss / MiB:.0f} - {0.5 * wrote['budget50'] / MiB:.0f} "
          f"= {limit / MiB:.0f} MiB")
    over_b, over_t = ratio_of["budget50"] - 1, ratio_of["threshold"] - 1
    print(f"  [{verdict(over_b <= 0.6 * over_t)}] overhead <= 0.6x threshold-only's: "
          f"{over_b:+.1%} vs {over_t:+.1%} ({over_b / over_t if over_t > 0 else float('inf'):.2f}x)")
    saving = (ref_rss - rss["threshold"]) / wrote["threshold"] if wrote["threshold"] else 0.0
    print(f"  [{verdict(saving >= 0.85)}] threshold-only (default knobs) takes >= 85% of the bytes written off "
          f"the peak: {(ref_rss - rss['threshold']) / MiB:.0f} of {wrote['threshold'] / MiB:.0f} MiB ({saving:.0%})")
    for label in labels:
        if label.startswith("threshold") and label != "threshold" and wrote.get(label):
            print(f"  [info] {label}: {(ref_rss - rss[label]) / MiB:.0f} of {wrote[label] / MiB:.0f} MiB written "
                  f"off the peak ({(ref_rss - rss[label]) / wrote[label]:.0%}), step {ratio_of[label]:.3f}x of none")


def bandwidth(folder: str, args: argparse.Namespace) -> None:
    total = args.io_mib * MiB
    raw = median_of([raw_bandwidth(folder, total) for _ in range(args.io_repeats)])
    engine_bandwidth(folder, total)  # warm up: the first huge-page faults may compact memory
    eng = tuple(statistics.median(x) for x in zip(*[engine_bandwidth(folder, total) for _ in range(args.io_repeats)],
                                                  strict=True))
    print()
    print(f"bandwidth: {args.io_mib} MiB in 64 MiB blocks, median of {args.io_repeats}, folder {folder} "
          "(the page cache cannot be dropped here: cached reads are memory copies)")
    for key, label in (("write_cached", "raw write"), ("read_cached_fresh", "raw read")):
        print(f"  {label:<34}{raw[key][0]:>8.0f} MB/s  ({raw[key][1]})")
    for label, value, key in (("engine write", eng[0], "write_cached"), ("engine read", eng[1], "read_cached_fresh")):
        print(f"  {label:<34}{value:>8.0f} MB/s  = {value / raw[key][0]:.0%} of raw {raw[key][1]}")


if __name__ == "__main__":
    main()
