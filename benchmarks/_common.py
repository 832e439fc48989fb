"""What the benchmarks share: the machine, the models, timing with medians, and two checkouts side by side:
in alternating processes (:func:`run_worker` with ``--repo DIR``, which :func:`use_repo` puts first
on ``sys.path``), or in one process (:func:`import_checkout`: the other package imported beside
this one). It does not import ``lightning_gradhooks``: a script calls :func:`use_repo`, then imports it."""

from __future__ import annotations

import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
REF = "lightning_gradhooks_ref"


def use_repo() -> None:
    """Put the checkout named by ``--repo DIR`` on the command line (a worker's), else this one, first on the path."""
    sys.path.insert(0, sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else str(ROOT))
    sys.path.insert(1, str(HERE))


def machine(device: str = "cpu") -> str:
    """The CPU (or GPU), its cores, torch's version and threads, Python, and the load average now."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")


def header(device: str = "cpu") -> None:
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine(device)}", flush=True)


def clock(name: str) -> Callable[[], float]:
    """``"cpu"``: the process's CPU time (with one torch thread, the work itself: steadier on a shared
    machine); ``"wall"``: wall time."""
    return time.process_time if name == "cpu" else time.perf_counter


def rotated(names: list[str], round_: int) -> list[str]:  # the order of round ``round_``
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def interleave(windows: dict[str, Callable[[], float]], rounds: int, label: str = "") -> dict[str, list[float]]:
    """``rounds`` rounds of every window (each returns its time), the order rotated each round;
    each round is printed as it comes, so that a run stopped by a time limit shows what it measured."""
    times: dict[str, list[float]] = {name: [] for name in windows}
    for r in range(rounds):
        for name in rotated(list(windows), r):
            times[name].append(windows[name]())
        print(f"  {label}round {r + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return low, statistics.median(values), high


def decile(values: list[float]) -> float:
    """The first decile: with single steps and many rounds, the steadiest figure (noise only adds)."""
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else values[0]


def table(times: dict[str, list[float]], base: str, per: int = 0, deciles: bool = False) -> None:
    """Medians of each variant, its median per-round ratio to ``base`` (with quartiles), and with
    ``per`` what it adds per unit (µs per watched module: the median of the per-round differences;
    with ``deciles`` also the difference of the first deciles)."""
    bare = times[base]
    columns = ["variant", "median (ms)", f"vs {base} (quartiles)"]
    columns += ["µs per module"] * bool(per) + ["the same, first deciles"] * (bool(per) and deciles)
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for name, ts in times.items():
        if not ts:
            continue
        low, ratio, high = quartiles([t / b for t, b in zip(ts, bare)])
        cells = [name, f"{statistics.median(ts) * 1e3:.1f}", f"{ratio:.3f}x ({low:.2f}-{high:.2f})"]
        if per:
            cells.append(f"{statistics.median((t - b) * 1e6 / per for t, b in zip(ts, bare)):.1f}")
        if per and deciles:
            cells.append(f"{(decile(ts) - decile(bare)) * 1e6 / per:.1f}")
        print("| " + " | ".join(cells) + " |", flush=True)


def run_worker(script: Path, arguments: list[str], repo: str | Path | None = None, env: dict | None = None) -> dict:
    """Run ``script`` in a fresh process, with the library of ``repo`` (default: this checkout), and
    return what it printed last as ``RESULT <json>``."""
    repo = str(repo or ROOT)
    command = [sys.executable, str(script), *arguments, "--repo", repo]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo, **(env or {})})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"worker failed: {' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def result(value: dict) -> None:  # what a worker hands back to run_worker
    print("RESULT " + json.dumps(value), flush=True)


def import_checkout(checkout: str | Path, folder: str | Path):  # noqa: ANN201
    """The package of ``checkout``, copied into ``folder`` as ``lightning_gradhooks_ref`` and imported
    beside this checkout's (two copies of one checkout differ by about ±0.5 µs per module)."""
    source = Path(checkout).resolve() / "lightning_gradhooks"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--ref expected a checkout holding lightning_gradhooks/, got {checkout}")
    target = Path(folder) / REF
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        path.write_text(path.read_text().replace("lightning_gradhooks", REF))
    sys.path.insert(0, str(folder))
    return importlib.import_module(REF)


# -- the models -------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 as torchvision builds it (41 watched modules), written here."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        for i, (cin, cout, stride) in enumerate([(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)], 1):
            self.add_module(f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


MODELS = ("resnet18", "mlp500", "encoder", "resnet50", "gpt2", "gpt2s")


def make_case(name: str, device: str = "cpu"):  # noqa: ANN201
    """``(model, batch, loss(model, batch))`` on ``device``, the same weights and batch every time:
    ``resnet18`` (8 x 3 x 64², cross-entropy), ``mlp500`` (500 x (Linear(64, 64) + Tanh), batch 32),
    ``encoder`` (4 ``TransformerEncoderLayer``, d 256, 4 heads, 16 x 128 tokens), and from
    transformers' configs (no download) ``resnet50``, ``gpt2`` (GPT-2 small) and ``gpt2s`` (4 x 256)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    squares = lambda m, b: m(b[0]).pow(2).mean()  # noqa: E731
    if name == "resnet18":
        model, loss = ResNet18(), lambda m, b: F.cross_entropy(m(b[0]), b[1])
        batch = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
    elif name == "mlp500":
        model = nn.Sequential(*(m for _ in range(500) for m in (nn.Linear(64, 64), nn.Tanh())))
        batch, loss = (torch.randn(32, 64, generator=g),), squares
    elif name == "encoder":
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        batch, loss = (torch.randn(16, 128, 256, generator=g),), squares
    elif name == "resnet50":
        from transformers import ResNetConfig, ResNetForImageClassification  # ResNetConfig() is ResNet-50

        size, n = (224, 16) if device == "cuda" else (128, 2)
        batch = (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 1000, (n,), generator=g))
        model = ResNetForImageClassification(ResNetConfig(num_labels=1000))
        loss = lambda m, b: F.cross_entropy(m(pixel_values=b[0]).logits, b[1])  # noqa: E731
    elif name in ("gpt2", "gpt2s"):  # gpt2s: GPT-2-style, 4 x 256, vocabulary 8192, SDPA
        from transformers import GPT2Config, GPT2LMHeadModel  # GPT2Config() is GPT-2 small

        small = dict(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4) if name == "gpt2s" else {}
        shape = (4, 128) if small else (4, 512) if device == "cuda" else (2, 128)
        batch = (torch.randint(0, small.get("vocab_size", 50257), shape, generator=g),)
        model = GPT2LMHeadModel(GPT2Config(**small, attn_implementation="sdpa"))
        loss = lambda m, b: m(input_ids=b[0], labels=b[0]).loss  # noqa: E731
    else:
        raise SystemExit(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return model.to(device), tuple(t.to(device) for t in batch), loss
