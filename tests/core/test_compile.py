"""torch.compile: a compiled model is seen whole on logged steps, and runs its compiled code untouched on the others.

Logged steps run eagerly (``torch.compiler.set_stance("force_eager")`` from arm to collect): every
module gives what it gives uncompiled, with the same numbers. Steps that are not logged run the
compiled code (a backend that counts its calls says so), and Dynamo compiles no more graphs than
without the monitor. ``eager_logged_steps=False`` keeps logged steps compiled: parameter gradients only.
"""

import math

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks, GradientMonitor
from lightning_gradhooks.summary.records import Kind

from conftest import MLP, hook_snapshot, loader, make_trainer, read_events


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Dynamo caches compiled code per code object across tests; start and end clean.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def stance() -> str:
    return torch._dynamo.eval_frame._stance.stance


class Counting:
    """A Dynamo backend that runs the captured graph as it is and counts its compiles and calls."""

    def __init__(self) -> None:
        self.graphs, self.calls = 0, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1

        def run(*args: object) -> object:
            self.calls += 1
            return gm.forward(*args)

        return run


class Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(width), Attention(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    """A 2-block causal LM whose attention calls ``F.scaled_dot_product_attention``."""

    def __init__(self, vocab: int = 40, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tokens(steps: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 40, (steps, 4, 8), generator=torch.Generator().manual_seed(seed))


def watched(model: nn.Module, steps: int = 4, every: int = 2, **options: object) -> list:
    """The records of :func:`train` with a monitor attached to ``model``."""
    monitor = GradientMonitor(model, **options)
    with monitor.attach():
        return train(model, monitor, steps, every)


def train(model: nn.Module, monitor: GradientMonitor | None, steps: int = 4, every: int = 2) -> list:
    """``steps`` SGD steps, logged every ``every``; the records of the logged steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step, x in enumerate(tokens(steps)):
        logged = monitor is not None and step % every == 0
        with monitor.arm(when=logged) if monitor is not None else torch.enable_grad():
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            if logged:
                records.append(monitor.collect())
        opt.step()
        opt.zero_grad()
    return records


def close(records: list, reference: list, rel: float = 1e-5) -> None:
    """The same entries as ``reference``, step by step, with the same numbers within float round-off."""
    assert len(records) == len(reference)
    for record, ref in zip(records, reference):
        got = {(e.kind, e.name): e.stats for e in record.entries}
        want = {(e.kind, e.name): e.stats for e in ref.entries}
        assert list(got) == list(want)
        for key, stats in want.items():
            for field in ("norm", "absmax", "mean"):
                a, b = getattr(got[key], field), getattr(stats, field)
                # a mean near zero (a norm layer's output) is round-off of the tensor's scale
                assert math.isclose(a, b, rel_tol=rel, abs_tol=rel * stats.absmax), (key, field, a, b)
        if ref.noise is not None:
            assert record.noise.big_sq == pytest.approx(ref.noise.big_sq, rel=rel)


@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_a_compiled_model_is_seen_whole_with_the_uncompiled_numbers_and_runs_compiled_between(how):
    torch.manual_seed(0)
    reference = watched(CausalLM(), steps=6, every=3, forward_checks=True)  # where NaN/Inf are born: checked too
    kinds = {e.kind for e in reference[-1].entries}
    assert {Kind.GRAD_OUTPUT, Kind.GRAD_INPUT, Kind.OUTPUT, Kind.ATTENTION_LOGIT, Kind.PARAM_GRAD, Kind.FORWARD,
            Kind.FORWARD_INPUT, Kind.WEIGHTS} <= kinds
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = Counting()
    torch.manual_seed(0)
    model = CausalLM()
    if how == "whole":
        compiled = torch.compile(model, backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)
        compiled = model
    before = hook_snapshot(model)
    monitor = GradientMonitor(compiled, forward_checks=True)  # nothing to warn about
    with monitor.attach():
        records = train(compiled, monitor, steps=6, every=3)
    close(records, reference)
    assert hook_snapshot(model) == before and stance() == "default"
    assert not [n for e in records[-1].entries for n in [e.name] if "_orig_mod" in n]
    # Steps 1, 2, 4, 5 ran the compiled code (each block once per step); 0 and 3 ran eagerly: one graph, no break.
    assert backend.calls == 4 * (1 if how == "whole" else 2)
    assert backend.graphs == unique_graphs() == 1 and graph_breaks() == 0


def test_logged_steps_add_no_graph_and_the_stance_is_restored_also_when_the_step_raises():
    backend = Counting()
    model = CausalLM()
    compiled = torch.compile(model, backend=backend)
    train(compiled, None, steps=2)
    alone = unique_graphs(), backend.calls
    monitor = GradientMonitor(compiled)
    with monitor.attach():
        train(compiled, monitor, steps=4, every=2)
        assert (unique_graphs(), backend.calls) == (alone[0], alone[1] + 2)
        with pytest.raises(RuntimeError, match="boom"), monitor.arm():
            assert stance() == "force_eager"
            compiled(tokens(1)[0])
            raise RuntimeError("boom")
        assert stance() == "default" and not monitor.armed
        with torch.compiler.set_stance("eager_on_recompile"):  # the user's own stance comes back after a step
            with monitor.arm():
                compiled(tokens(1)[0]).sum().backward()
                assert stance() == "force_eager"
            assert stance() == "eager_on_recompile"
    assert backend.calls == alone[1] + 2 and unique_graphs() == alone[0]


def test_kept_compiled_logged_steps_report_parameter_gradients_and_keep_the_graph():
    backend = Counting()
    torch.manual_seed(0)
    model = CausalLM()
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(UserWarning, match=r"^18 modules report parameter gradients only .*eager_logged_steps=False"):
        monitor = GradientMonitor(compiled, eager_logged_steps=False)
    assert set(monitor.parameters_only) == set(monitor.plan) and monitor.fallback == []
    with monitor.attach():
        records = train(compiled, monitor, steps=4, every=2)
    assert backend.calls == 4 and backend.graphs == unique_graphs() == 1 and graph_breaks() == 0
    assert {e.kind for e in records[-1].entries} == {Kind.PARAM_GRAD}
    with pytest.raises(ValueError, match=r"`eager_logged_steps` expected"):
        GradientMonitor(compiled, eager_logged_steps="yes")


def test_what_cannot_be_seen_is_said_once_by_name():
    backend = Counting()
    model = CausalLM()
    compiled = torch.compile(model, backend=backend)
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.warns(UserWarning) as caught:
            monitor = GradientMonitor(compiled)
    said = [str(w.message) for w in caught]
    assert said[0] == ("torch.compile: logged steps run compiled: torch._dynamo.config.compiled_autograd is set: "
                       "its backward compiles whatever the stance")
    assert "18 modules report parameter gradients only" in said[1] and len(said) == 2
    assert set(monitor.parameters_only) == set(monitor.plan)

    model = CausalLM()
    make_graphed_callables(model.blocks[1])
    with pytest.warns(UserWarning, match=r"^8 modules .*make_graphed_callables.*: blocks.1.ln1, blocks.1.attn.q"):
        monitor = GradientMonitor(model)
    assert [n for n in monitor.parameters_only if not n.startswith("blocks.1.")] == []


def make_graphed_callables(module: nn.Module) -> nn.Module:
    """What ``torch.cuda.make_graphed_callables`` (CUDA only) does to a module: its forward replaced by a closure."""
    def new_fwd(*args: object) -> object:
        return module.__class__.forward(module, *args)

    module.forward = new_fwd
    return module


class LitLM(pl.LightningModule):
    def __init__(self, how: str = "", backend: object = "aot_eager") -> None:
        super().__init__()
        self.lm = CausalLM()
        if how == "blocks":
            for block in self.lm.blocks:
                block.compile(backend=backend)
        elif how == "step":
            self.training_step = torch.compile(self.training_step, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return F.cross_entropy(self(x).flatten(0, 1), x.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit_lm(tmp_path, how: str, callback: bool, steps: int = 8, backend: object = "aot_eager") -> tuple:  # noqa: ANN001
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    pl.seed_everything(0, verbose=False)
    model = LitLM(how, backend)
    hooks = [GradHooks(every_n_steps=4)] if callback else []
    trainer = make_trainer(tmp_path / f"{how}{callback}", hooks, max_steps=steps, limit_val_batches=0)
    trainer.fit(torch.compile(model, backend=backend) if how == "whole" else model,
                DataLoader(TensorDataset(tokens(steps).flatten(0, 1)), batch_size=4))
    return trainer, hooks


@pytest.mark.parametrize("how", ["whole", "blocks", "step"])
def test_lightning_fits_of_compiled_models_are_seen_whole_and_compile_what_they_compile_alone(tmp_path, how):
    backend = Counting()
    fit_lm(tmp_path, how, False, backend=backend)
    alone = backend.graphs, backend.calls, unique_graphs()
    backend = Counting()
    trainer, (hooks,) = fit_lm(tmp_path, how, True, backend=backend)
    # Steps 0 and 4 ran eagerly, the 6 others the compiled code; no graph more, none broken.
    per_step = alone[1] // 8
    assert (backend.graphs, backend.calls, unique_graphs()) == (alone[0], alone[1] - 2 * per_step, alone[2])
    assert graph_breaks() == 0 and stance() == "default"
    tags = read_events(trainer.logger.log_dir).Tags()["scalars"]
    for tag in ("grad_output_norm/lm.blocks.0.attn.k", "grad_input_norm/lm.blocks.1.mlp.0",
                "attention_logit_max/lm.blocks.0.attn", "output_rms/lm.blocks.1.ln2"):
        assert any(t.endswith(tag) for t in tags), tag
    assert hooks.gradient_log.report.flags() == []  # the key bias's zero gradient is no alarm


def test_lightning_fit_of_an_inductor_compiled_model_gives_the_uncompiled_numbers(tmp_path):
    """Inductor on the CPU: step 1 runs the compiled code, steps 0 and 2 are logged eagerly, and step 2's
    statistics are those of the uncompiled fit within round-off; the user's settings are as they were."""
    runs = {}
    for compiled in (False, True):
        torch._dynamo.utils.counters.clear()  # the uncompiled fit compiles the statistics' kernels
        pl.seed_everything(0, verbose=False)
        model = MLP()
        before = hook_snapshot(model)
        trainer = make_trainer(tmp_path / str(compiled), [GradHooks(every_n_steps=2)], max_steps=3)
        settings = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()
        trainer.fit(torch.compile(model) if compiled else model, loader())
        after = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()
        assert [{k: (v, now[k]) for k, v in was.items() if now[k] != v} for was, now in zip(settings, after)] == [{}, {}]
        assert hook_snapshot(model) == before and stance() == "default"
        events = read_events(trainer.logger.log_dir)
        runs[compiled] = {t: [e.value for e in events.Scalars(t)] for t in events.Tags()["scalars"]
                          if "histogram" not in t}
    assert unique_graphs() == 1 and graph_breaks() == 0
    assert list(runs[True]) == list(runs[False]) and any("grad_output_norm/net.2" in t for t in runs[True])
    for tag, values in runs[False].items():
        assert runs[True][tag] == pytest.approx(values, rel=1e-4, abs=1e-7), tag


def test_a_transformers_gpt2_compiled_whole_gives_the_uncompiled_numbers():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="sdpa",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class Loss(nn.Module):  # train() calls model(x) for logits
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT2LMHeadModel(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gpt(x).logits

    reference = watched(Loss())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = Counting()
    model = Loss()
    compiled = torch.compile(model, backend=backend)
    train(torch.compile(Loss(), backend=backend), None, steps=2)  # the graphs of the model alone
    alone = unique_graphs()
    monitor = GradientMonitor(compiled)
    with monitor.attach():
        records = train(compiled, monitor, steps=4, every=2)
    close(records, reference)
    assert {"gpt.transformer.h.0.attn", "gpt.transformer.h.1.attn"} <= {
        e.name for e in records[-1].entries if e.kind == Kind.ATTENTION_LOGIT}
    assert backend.calls >= 2 + 2 and unique_graphs() == alone and graph_breaks() == 0


def test_a_key_bias_zero_by_construction_is_a_note_without_module_statistics():
    """Softmax ignores a shift shared by every key: the key projection's bias gets round-off. Kept
    compiled (no grad_output), it is told from its weight's gradient: a note, no vanishing or stalled flag
    (with module statistics, from its module's grad_output: tests/health/test_report_unseen.py)."""
    pl.seed_everything(0, verbose=False)
    model = LitLM()
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.5)
    hooks = GradHooks(every_n_steps=5, eager_logged_steps=False, histograms=False)
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[hooks])
    trainer.fit(torch.compile(model, backend="eager"), DataLoader(TensorDataset(tokens(20, seed=1).flatten(0, 1)),
                                                                  batch_size=4))
    report = hooks.gradient_log.report
    assert report.flags() == []
    assert {n.entry for n in report.notes()} == {"lm.blocks.0.attn.k.bias", "lm.blocks.1.attn.k.bias"}


def test_a_fit_that_raises_in_a_logged_step_restores_the_stance(tmp_path):
    trainer = make_trainer(tmp_path, [hooks := GradHooks(every_n_steps=1)], max_steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(torch.compile(MLP(fail_at=1), backend="eager"), loader())
    assert stance() == "default" and hooks.monitor is None
