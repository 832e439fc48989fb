"""What a run leaves on disk, what TensorBoard shows of it, and how fast ``python -m lightning_gradhooks report`` reads it.

    python benchmarks/disk.py [--ref DIR] [--layers 200] [--steps 40] [--every 50]
        [--cli-layers 200] [--cli-steps 200] [--model mlp|encoder] [--rounds 5] [--folder F] [--report-only]
    python benchmarks/disk.py --charts

Disk: a plain loop over ``--layers`` x (Linear(64, 64) + Tanh) and a Linear(64, 1) head (batch 32,
SGD) at the defaults of ``GradientMonitor`` and ``GradientLog(SummaryWriter)``, ``--steps`` logged
steps every ``--every``, written in a fresh process by this checkout and the one in ``--ref DIR``:
the event files' bytes per watched module per logged step, by part (a record's bytes, framing
included, shared among its values by size). The report command: a run of ``--cli-layers`` x
``--cli-steps`` (``--model encoder``: an ``nn.TransformerEncoder``, d 64, 4 heads, AdamW), kept in
``--folder`` when given, read by each checkout: the whole process ``python -m lightning_gradhooks
report FOLDER`` (wall, interpreter start included), ``main(["report", folder])`` in process (CPU,
wall) and its reading alone (``read_folder``, CPU); the fastest of ``--repeat`` calls, ``--rounds``
rounds of fresh processes, order rotated; medians in µs per module per logged step; each output
checked against the report the run printed. ``--charts``: the scalar and histogram tags and our
sections TensorBoard shows for two logged steps of ResNet-18, ViT-Tiny and GPT-2 (3 layers), with
the defaults and with every statistic charted (counts: the same on any machine).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common as C  # noqa: E402

C.use_repo()  # a worker imports the library from its --repo
import torch  # noqa: E402
from torch import nn  # noqa: E402

PARTS = ("histograms", "summary", "scalars", "images", "other")


def write_run(layers: int, steps: int, every: int, folder: str, model_name: str = "mlp") -> dict:
    from torch.utils.tensorboard import SummaryWriter

    from lightning_gradhooks import GradientLog, GradientMonitor

    torch.manual_seed(0)
    if model_name == "encoder":
        layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        blocks = [m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
        model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 1))
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    writer = SummaryWriter(folder)
    monitor = GradientMonitor(model)
    log = GradientLog(writer, optimizers=[optimizer], echo=None)
    with monitor.attach():
        for i in range(steps):
            with monitor.arm():
                torch.nn.functional.mse_loss(model(x), y).backward()
                log.write(monitor.collect(), i * every)
            optimizer.step()
            optimizer.zero_grad()
    report = log.close()
    writer.close()
    return {"modules": len(monitor.modules), "steps": steps, "report": report.table()}


def time_cli(folder: str, repeat: int) -> dict:
    """The fastest of ``repeat`` calls after an untimed one: the command in process (CPU and wall
    time), its reading of the event files alone (CPU), and the whole process (wall)."""
    from lightning_gradhooks.__main__ import main, read_folder

    result: dict = {}
    for i in range(repeat + 1):
        buffer, cpu, wall = io.StringIO(), time.process_time(), time.perf_counter()
        with redirect_stdout(buffer):
            main(["report", folder])
        times = {"command_cpu": time.process_time() - cpu, "command_wall": time.perf_counter() - wall}
        cpu = time.process_time()
        for run_folder in sorted({p.parent for p in Path(folder).rglob("events.out.tfevents.*")}):
            read_folder(run_folder)
        times["read_cpu"] = time.process_time() - cpu
        wall = time.perf_counter()  # the whole process, interpreter start included, as a CI guard runs it
        subprocess.run([sys.executable, "-m", "lightning_gradhooks", "report", os.path.abspath(folder)],  # not the cwd's
                       capture_output=True, check=True, cwd=tempfile.gettempdir())  # package: the worker's PYTHONPATH
        times["process_wall"] = time.perf_counter() - wall
        result = {k: min(result.get(k, v), v) for k, v in times.items()} if i else {}  # the first call untimed
        result["out"] = buffer.getvalue()
    return result


def worker(args: argparse.Namespace) -> None:
    if args.worker == "write":
        result = write_run(args.layers, args.steps, args.every, args.folder, args.model)
    else:
        result = time_cli(args.folder, args.repeat)
    C.result(result)


def run_worker(repo: Path, *arguments: str) -> dict:
    return C.run_worker(Path(__file__), list(arguments), repo)


def bytes_by_part(folder: str) -> dict[str, float]:
    """Every event file's bytes under ``folder``, shared among the parts (see the module docstring)."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event

    parts: dict[str, float] = defaultdict(float)
    for path in Path(folder).rglob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            total = length + 16
            offset += total
            sizes: dict[str, int] = defaultdict(int)
            for value in event.summary.value:
                if value.HasField("histo"):
                    part = "histograms"
                elif value.tag == "gradhooks/stats":
                    part = "summary"
                elif value.HasField("simple_value"):
                    part = "scalars"
                elif value.HasField("image"):
                    part = "images"
                else:
                    part = "other"
                sizes[part] += value.ByteSize()
            whole = sum(sizes.values())
            if not whole:
                parts["other"] += total
            for part, size in sizes.items():
                parts[part] += total * size / whole
    return dict(parts)


# -- what TensorBoard shows (--charts) ------------------------------------------------------------
class Block(nn.Module):
    """A ViT block, named as timm names it (norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.attn.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.norm2(x))))


class VitTiny(nn.Module):
    """ViT-Tiny/16 at 224 pixels: 12 blocks of width 192, as timm's ``vit_tiny_patch16_224``."""

    def __init__(self, dim: int = 192, depth: int = 12, classes: int = 1000) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 16, 16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 197, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, 3) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable]] = {
    "ResNet-18": (C.ResNet18, lambda: torch.randn(2, 3, 64, 64), lambda m, x: m(x).square().mean()),
    "ViT-Tiny": (VitTiny, lambda: torch.randn(2, 3, 224, 224), lambda m, x: m(x).square().mean()),
    "GPT-2, 3 layers": (gpt2, lambda: torch.randint(0, 1000, (2, 32)), lambda m, x: m(x, labels=x).loss),
}


def count(make: Callable[[], nn.Module], batch: Callable[[], torch.Tensor], loss: Callable, statistics) -> dict:  # noqa: ANN001
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from lightning_gradhooks import GradientLog, GradientMonitor

    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as folder:
        writer = SummaryWriter(folder)
        monitor = GradientMonitor(model)
        log = GradientLog(writer, optimizers=[optimizer], statistics=statistics, echo=None)
        with monitor.attach():
            for step in range(2):
                monitor.arm()
                loss(model, batch()).backward()
                log.write(monitor.collect(), step)
                optimizer.step()
                optimizer.zero_grad()
        log.close()
        writer.close()
        events = EventAccumulator(folder, size_guidance={"scalars": 0, "histograms": 0, "images": 0})
        events.Reload()
        tags = events.Tags()
    charted = tags["scalars"] + tags["histograms"] + tags["images"]
    return {
        "scalars": len(tags["scalars"]),
        "histograms": len(tags["histograms"]),
        "sections": len({t.partition("/")[0] for t in charted if t.startswith("∇")}),
    }


def charts() -> None:
    """How many charts and sections TensorBoard shows, with the defaults and with every statistic."""
    from lightning_gradhooks.log import LOGGED_STATISTICS

    print(f"torch {torch.__version__}")
    print("| model | every statistic: sections, scalars, histograms | defaults: sections, scalars, histograms "
          "| default/every: scalars, all tags |")
    print("| --- | --- | --- | --- |")
    for name, (make, batch, loss) in MODELS.items():
        every = count(make, batch, loss, list(LOGGED_STATISTICS))
        default = count(make, batch, loss, None)
        print(f"| {name} | {every['sections']}, {every['scalars']}, {every['histograms']} "
              f"| {default['sections']}, {default['scalars']}, {default['histograms']} "
              f"| {default['scalars'] / every['scalars']:.0%}, "
              f"{(default['scalars'] + default['histograms']) / (every['scalars'] + every['histograms']):.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", type=Path, help="a checkout to compare with (the 'before')")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--model", choices=("mlp", "encoder"), default="mlp",
                        help="the report command's run: the MLP, or an encoder of --cli-layers layers (d 64, 4 heads, AdamW)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--cli-layers", type=int, default=200)
    parser.add_argument("--cli-steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2, help="timed calls of the command per process (the fastest)")
    parser.add_argument("--report-only", action="store_true", help="time the report command only")
    parser.add_argument("--folder", help="where the report command's runs are written (kept; reused when there)")
    parser.add_argument("--charts", action="store_true", help="count the charts and sections TensorBoard shows")
    parser.add_argument("--worker", choices=("write", "cli"), help=argparse.SUPPRESS)
    parser.add_argument("--repo", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    C.header()
    if args.charts:
        return charts()
    checkouts = {"after": C.ROOT} | ({"before": args.ref.resolve()} if args.ref else {})
    with tempfile.TemporaryDirectory() as tmp:
        if not args.report_only:
            disk_bytes(args, checkouts, tmp)
        report_command(args, checkouts, args.folder or tmp)


def disk_bytes(args: argparse.Namespace, checkouts: dict[str, Path], tmp: str) -> None:
    print(f"# Disk: {args.layers + 1}-module MLP, {args.steps} logged steps every {args.every}, defaults")
    print("| checkout | total | " + " | ".join(PARTS) + " | (bytes per module per logged step) |")
    print("| --- | --- | " + " | ".join("---" for _ in PARTS) + " | |")
    for name, repo in checkouts.items():
        folder = f"{tmp}/disk-{name}"
        facts = run_worker(repo, "--worker", "write", "--layers", str(args.layers), "--steps", str(args.steps),
                           "--every", str(args.every), "--folder", folder)
        per = facts["modules"] * facts["steps"]
        parts = bytes_by_part(folder)
        total = sum(parts.values())
        shares = " | ".join(f"{parts.get(p, 0) / per:.0f} ({100 * parts.get(p, 0) / total:.0f} %)" for p in PARTS)
        print(f"| {name} | **{total / per:.0f}** | {shares} | {total / 1e6:.2f} MB in all |", flush=True)


def report_command(args: argparse.Namespace, checkouts: dict[str, Path], tmp: str) -> None:
    """Each checkout's run read by its own command, rounds of fresh processes, the order rotated."""
    print(f"\n# The report command: a {args.model} of {args.cli_layers} layers, {args.cli_steps} logged steps "
          f"every {args.every}")
    runs = {}
    for name, repo in checkouts.items():
        folder = f"{tmp}/cli-{args.model}{args.cli_layers}x{args.cli_steps}-{name}"
        facts_file = Path(folder) / "facts.json"
        if not facts_file.is_file():  # written once, kept in --folder
            facts = run_worker(repo, "--worker", "write", "--layers", str(args.cli_layers), "--steps",
                               str(args.cli_steps), "--every", str(args.every), "--folder", folder, "--model", args.model)
            facts_file.write_text(json.dumps(facts))
        runs[name] = (folder, json.loads(facts_file.read_text()))
    variants = {name: (repo, runs[name]) for name, repo in checkouts.items()}
    columns = ("process_wall", "command_cpu", "command_wall", "read_cpu")
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in range(args.rounds):
        for name in C.rotated(list(variants), r):
            repo, (folder, facts) = variants[name]
            result = run_worker(repo, "--worker", "cli", "--folder", folder, "--repeat", str(args.repeat))
            if facts["report"] not in result["out"]:
                raise SystemExit(f"{name}: the command's report is not the printed one:\n{result['out']}\n---\n{facts['report']}")
            for column in columns:
                times[name][column].append(result[column] / (facts["modules"] * facts["steps"]) * 1e6)
            print(f"  round {r + 1} {name}: " + ", ".join(f"{c} {times[name][c][-1]:.1f}" for c in columns), flush=True)
    print("µs per module per logged step, median over rounds (the rounds after the slash); the whole process is "
          "`python -m lightning_gradhooks report FOLDER`, interpreter start included\n"
          "| checkout | whole process, wall | command in process, CPU | the same, wall | reading alone, CPU |\n"
          "| --- | --- | --- | --- | --- |")
    for name, by_column in times.items():
        cells = [f"**{statistics.median(v):.1f}** / {', '.join(f'{x:.1f}' for x in v)}" for v in by_column.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.ref:
        for column in columns:
            ratios = [b / a for a, b in zip(times["after"][column], times["before"][column])]
            print(f"before / after, {column}, median of per-round ratios: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
