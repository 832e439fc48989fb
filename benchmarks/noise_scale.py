"""How big should my batch be, and what does asking cost? The gradient noise scale, four ways.

    python benchmarks/noise_scale.py cost [--models resnet18,mlp500,encoder] [--rounds 15] [--threads 1]
    python benchmarks/noise_scale.py advice SEED LABEL_NOISE
    python benchmarks/noise_scale.py heldout [--seeds 0,1]
    python benchmarks/noise_scale.py figure [--out docs/noise_scale.png] [--steps 400] [--every 10]

``cost``: what the noise scale adds to a logged step (``_common.make_case``'s models): ``arm``,
forward and backward (one batch, ``k=1``: per-example norms; or two micro-batches, ``k=2``),
``collect``, ``GradientLog.write`` (histograms on), SGD step. Three monitors on the model:
``off`` (``noise_scale=False``), ``on`` (the default) and ``clocked`` (``on`` with a
``ProbeClock``: this thread's CPU time inside what the monitor calls of the probe, its own cost
taken off). One step of each per round, the order rotated, after two untimed rounds; prints
medians (wall and CPU), the per-round ratios ``on / off`` with quartiles, and the probe's own
CPU time as a share of its logged step: the steadiest figure on a loaded host (it leaves out what
the probe makes the monitor do, which only ``on / off`` shows). ``PYTHONPATH=OTHER``: another
checkout's library.

``advice``: the sentence against the truth: a GroupNorm CNN at learning rate 0 (the truth does
not move), the exact noise scale of the data set from every example's gradient (``torch.func``),
and for one process (per-example norms) and accumulation x4 the summary and the sentence.

``heldout``: the per-example estimate against brute force over every parameter on models no
choice of the probe was tuned on: a 2-layer GPT-2 LM, a 2-layer BERT classifier (``transformers``)
and a 2-layer ``nn.TransformerEncoder`` classifier (random init, synthetic data, 20 % label
noise; 8 batches of 32 at fixed weights): coverage, the ratio of the summed estimates, and
whether it is within the 25 % the tests allow.

``figure``: docs/noise_scale.png: a Lightning fit of an MLP classifier (SGD, batch 32, 20 % flipped
labels) with ``GradHooks``; at each logged step the exact noise scale of the training set; the
raw estimates (dots), ``∇1 overview/noise_scale`` (line), the truth (dashes), the batch.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402

from lightning_gradhooks import GradHooks, GradientLog, GradientMonitor  # noqa: E402
from lightning_gradhooks.__main__ import read_folder  # noqa: E402
from lightning_gradhooks.core.noise import NoiseProbe  # noqa: E402
from lightning_gradhooks.summary.records import Key, Kind  # noqa: E402

# -- cost --------------------------------------------------------------------------------
def cost(argv: list[str]) -> None:
    """What the noise scale adds to a logged step (see the module docstring, ``cost``)."""
    parser = argparse.ArgumentParser(prog="noise_scale.py cost", description=cost.__doc__)
    parser.add_argument("--models", default="resnet18,mlp500,encoder")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    C.header()
    folder = tempfile.TemporaryDirectory()
    for name in args.models.split(","):
        model, batch, loss = C.make_case(name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay, so every window is alike
        monitors = {"off": GradientMonitor(model, noise_scale=False), "on": GradientMonitor(model),
                    "clocked": GradientMonitor(model)}
        probe_clock = ProbeClock(monitors["clocked"].noise)  # apart: its wrappers cost time of their own
        writer = SummaryWriter(f"{folder.name}/{name}")
        logs = {key: GradientLog(writer, [optimizer], echo=None) for key in monitors}
        handles = [m.attach() for m in monitors.values()]
        half = tuple(t[: len(t) // 2] for t in batch), tuple(t[len(t) // 2:] for t in batch)
        step_no = [0]

        def step(key: str, k: int) -> tuple[float, float, float]:
            monitor = monitors[key]
            probe_clock.seconds = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            with monitor.arm(batch_size=len(batch[0]) // k, accumulation=k):
                for part in ((batch,) if k == 1 else half):
                    (loss(model, part) / k).backward()
                logs[key].write(monitor.collect(), step_no[0])
            optimizer.step()
            optimizer.zero_grad()
            step_no[0] += 1
            return time.perf_counter() - start, time.process_time() - cpu, probe_clock.seconds

        variants = [("off", 1), ("on", 1), ("clocked", 1), ("off", 2), ("on", 2), ("clocked", 2)]
        times: dict[tuple[str, int], list[tuple[float, float, float]]] = {v: [] for v in variants}
        for r in range(-2, args.rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for v in order:
                took = step(*v)
                if r >= 0:
                    times[v].append(took)
        print_cost(name, variants, times)
        sample = logs["on"].noise_scale.value
        print(f"{name:9s} noise scale of its batch: {sample if sample is None else round(sample, 1)}")
        for h in handles:
            h.remove()
        for log in logs.values():
            log.close()
        writer.close()
    folder.cleanup()


def print_cost(name: str, variants: list, times: dict) -> None:
    """Medians of each variant, ``on / off`` per round with quartiles, and the probe's own share."""
    for v in variants:
        wall, cpu = (statistics.median(t[i] for t in times[v]) for i in (0, 1))
        print(f"{name:9s} {v[0]:3s} k={v[1]}  wall {1000 * wall:8.1f} ms  cpu {1000 * cpu:8.1f} ms")
    for k in (1, 2):
        for i, clock in enumerate(("wall", "cpu")):
            ratios = sorted(on[i] / off[i] for on, off in zip(times["on", k], times["off", k]))
            print(f"{name:9s} on/off k={k} {clock:4s} median {statistics.median(ratios):.3f}  "
                  f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})")
        own = sorted(t[2] / t[1] for t in times["clocked", k])
        print(f"{name:9s} probe's own CPU time k={k}: {1000 * statistics.median(t[2] for t in times['clocked', k]):.1f} "
              f"ms, {statistics.median(own):.1%} of the logged step (quartiles {own[len(own) // 4]:.1%}-"
              f"{own[3 * len(own) // 4]:.1%})")


class ProbeClock:
    """The noise probe's own CPU time on a logged step: this thread's (``time.thread_time``) inside what
    the monitor calls of it (``arm``, ``saw`` and the gradient hook it returns, ``_each_backward``,
    ``collect``), wrapped on this instance; the clock's own cost per call measured and taken off."""

    def __init__(self, probe: NoiseProbe) -> None:
        self.seconds, self.overhead, self._probe = 0.0, 0.0, probe
        for attr in ("arm", "saw", "_each_backward", "collect"):
            setattr(probe, attr, self._timed(getattr(probe, attr), attr))
        empty, start = self._timed(lambda: None, ""), time.thread_time()
        for _ in range(10_000):
            empty()
        self.overhead = (time.thread_time() - start) / 10_000

    def _timed(self, call, what: str):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.thread_time()
            result = call(*args, **kwargs)
            if what == "saw" and result is not None:
                result = self._timed(result, "")
            elif what == "arm":  # (batch_size, accumulation): with accumulation, one hook on the parameters
                assert self._probe.hooks == (args[1] > 1), "a source the monitor does not feed: its hooks go untimed"
            self.seconds += time.thread_time() - start - self.overhead
            return result

        return timed


# -- advice ------------------------------------------------------------------------------
class Fit(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.0)


def cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 5))


def advice(argv: list[str]) -> None:
    """The noise-scale sentence against the truth (see the module docstring, ``advice``)."""
    parser = argparse.ArgumentParser(prog="noise_scale.py advice", description=advice.__doc__)
    parser.add_argument("seed", type=int)
    parser.add_argument("label_noise", type=float)
    args = parser.parse_args(argv)
    seed, label_noise = args.seed, args.label_noise
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "core")]
    from test_noise import truth

    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 3, 12, 12, generator=g)
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 100, 5))
    with torch.no_grad():
        y = (teacher(x) + label_noise * torch.randn(1024, 5, generator=g)).argmax(1)
    grad_sq, trace = truth(cnn(seed), nn.functional.cross_entropy, x, y)
    print(f"truth {trace / grad_sq:.1f}")
    for accumulation in (1, 4):
        hooks = GradHooks(every_n_steps=2, histograms=False)
        trainer = pl.Trainer(max_steps=120, accumulate_grad_batches=accumulation, accelerator="cpu",
                             logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp()), callbacks=[hooks],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        loader = DataLoader(TensorDataset(x, y), batch_size=64 // accumulation, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        trainer.fit(Fit(cnn(seed)), loader)
        print(f"accumulation {accumulation}: {hooks.gradient_log.noise_scale.summary()}\n  {hooks.gradient_log.noise_scale.sentence()}")


# -- figure ------------------------------------------------------------------------------
BATCH = 32


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Truth(pl.Callback):
    """The exact noise scale of the training set at each logged step (before the update)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, every: int) -> None:
        self.x, self.y, self.every, self.values = x, y, every, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        if trainer.global_step % self.every:
            return
        net = pl_module.net
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss(p, xi, yi):  # noqa: ANN001, ANN202
            return nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

        rows = []
        for i in range(0, len(self.x), 512):
            g = vmap(grad(loss), in_dims=(None, 0, 0))(params, self.x[i:i + 512], self.y[i:i + 512])
            rows.append(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], 1).double())
        g = torch.cat(rows)
        mean = g.mean(0)
        self.values[trainer.global_step] = float((g - mean).square().sum(1).mean() / mean.square().sum())


def figure(argv: list[str]) -> None:
    """The figure of docs/noise-scale.md (see the module docstring, ``figure``)."""
    parser = argparse.ArgumentParser(prog="noise_scale.py figure", description=figure.__doc__)
    parser.add_argument("--out", default="docs/noise_scale.png")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    teacher = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10))
    with torch.no_grad():
        y = teacher(x).argmax(1)
    flip = torch.rand(2048, generator=g) < 0.2
    y[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    truth = Truth(x, y, args.every)
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=TensorBoardLogger(folder, name="logs"),
                             callbacks=[GradHooks(every_n_steps=args.every, histograms=False), truth],
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
        trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True))
        log_dir = Path(trainer.logger.log_dir)
        events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        events.Reload()
        smoothed = [(e.step, e.value) for e in events.Scalars("∇1 overview/noise_scale")]
        key = Key(Kind.NOISE, "gradient")
        raw = [(step, s[key]["noise_scale"]) for step, s in sorted(read_folder(log_dir).steps.items())
               if key in s and s[key]["noise_scale"] > 0]  # NaN: |G|² <= 0
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    ax.scatter(*zip(*raw), s=8, color="0.6", label="one logged step (raw tr(Σ)/|G|², summary)")
    ax.plot(*zip(*smoothed), color="C0", lw=2, label="∇1 overview/noise_scale (smoothed)")
    ax.plot(*zip(*sorted(truth.values.items())), color="C3", lw=1.5, ls="--",
            label="exact, from every example's gradient (torch.func)")
    ax.axhline(BATCH, color="k", lw=1, ls=":", label=f"batch per optimizer step ({BATCH})")
    ax.set_yscale("log")
    top = max(v for _, v in smoothed + list(truth.values.items())) * 4
    ax.set_ylim(BATCH / 8, top)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("noise scale (examples)")
    ax.set_title("Gradient noise scale of an MLP classifier (20 % label noise), batch 32, SGD")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    ratios = [v / truth.values[s] for s, v in smoothed if s in truth.values]
    print(f"wrote {args.out}; smoothed / exact over the run: median {sorted(ratios)[len(ratios) // 2]:.2f}, "
          f"mean raw estimate / mean exact: "
          f"{sum(v for _, v in smoothed) / len(smoothed) / (sum(truth.values.values()) / len(truth.values)):.2f}")


# -- heldout -----------------------------------------------------------------------------
def _gpt2(seed: int):  # noqa: ANN202
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50, n_positions=32,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, 50, (256, 1), generator=g), torch.randint(1, 4, (256, 1), generator=g)
    x = (start + stride * torch.arange(24)) % 50  # arithmetic sequences, 20 % of the tokens replaced
    flip = torch.rand(x.shape, generator=g) < 0.2
    x[flip] = torch.randint(0, 50, (int(flip.sum()),), generator=g)
    return transformers.GPT2LMHeadModel(config), x, lambda m, xb: m(input_ids=xb, labels=xb).loss


def _bert(seed: int):  # noqa: ANN202
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0,
                                     attention_probs_dropout_prob=0, num_labels=3)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 60, (256, 16), generator=g)
    y = ((x == 5).sum(1) + (x == 7).sum(1) - (x == 9).sum(1)).clamp(-1, 1) + 1  # 20 % of the labels flipped
    flip = torch.rand(256, generator=g) < 0.2
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    loss = lambda m, xb: m(input_ids=xb[:, :-1], labels=xb[:, -1]).loss  # noqa: E731
    return transformers.BertForSequenceClassification(config), torch.cat([x, y[:, None]], 1), loss


def _encoder(seed: int):  # noqa: ANN202
    """torch's own ``nn.TransformerEncoder`` (2 layers, 64 wide, packed attention projections) as a
    classifier: its Linears over the sequence are left to its LayerNorms."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(40, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.emb(x)).mean(1))

    torch.manual_seed(seed)
    model = Encoder()
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 40, (256, 16), generator=g)
    y = ((x == 5).sum(1) - (x == 9).sum(1)).clamp(-1, 1) + 1  # 20 % of the labels flipped
    flip = torch.rand(256, generator=g) < 0.2
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    loss = lambda m, xb: nn.functional.cross_entropy(m(xb[:, :-1]), xb[:, -1])  # noqa: E731
    return model, torch.cat([x, y[:, None]], 1), loss


def heldout(argv: list[str]) -> None:
    """The estimate on held-out transformers against brute force (see the module docstring, ``heldout``)."""
    parser = argparse.ArgumentParser(prog="noise_scale.py heldout", description=heldout.__doc__)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def unbiased(g: torch.Tensor) -> tuple[float, float]:  # (|G|², tr(Σ)) of one batch's per-example gradients
        mean = g.mean(0)
        trace = float((g - mean).square().sum() / (len(g) - 1))
        return float(mean.square().sum()) - trace / len(g), trace

    def ratio(rows: list[tuple[float, float]]) -> float:
        return sum(t for _, t in rows) / sum(g for g, _ in rows)

    for seed in (int(s) for s in args.seeds.split(",")):
        for name, make in (("gpt2", _gpt2), ("bert", _bert), ("encoder", _encoder)):
            model, data, loss = make(seed)
            probe, ours, exact = NoiseProbe(model), [], []
            for step in range(8):
                batch = data[step * 32:(step + 1) * 32]
                model.zero_grad()
                probe.arm()
                loss(model, batch).backward()
                sample = probe.collect()
                ours.append(sample.estimates())
                rows = []
                for i in range(len(batch)):
                    model.zero_grad()
                    loss(model, batch[i:i + 1]).backward()
                    rows.append(torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                           for p in model.parameters() if p.requires_grad]).double())
                exact.append(unbiased(torch.stack(rows)))
            agree = ratio(ours) / ratio(exact)
            print(f"{name} seed {seed}: coverage {sample.coverage:.4f}; probe {ratio(ours):.2f}, brute force over "
                  f"every parameter {ratio(exact):.2f}: {agree:.3f}x ({'within' if abs(agree - 1) <= 0.25 else 'OUTSIDE'} "
                  "25 %)")


COMMANDS = {"cost": cost, "advice": advice, "figure": figure, "heldout": heldout}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(f"expected a command, one of {', '.join(COMMANDS)}, got {sys.argv[1:2]}\n\n{__doc__}")
    COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
