"""The forward statistics of logged steps: each watched module's outputs (kind ``output``) and the
maximum attention logit of every attention call (kind ``attention_logit``), against hand-made
references, and nothing of them outside logged steps."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gradhooks import GradientMonitor
from lightning_gradhooks.core.attention import CHUNK_ELEMENTS, max_logits
from lightning_gradhooks.summary.records import Kind, forward_values, step_summary


def _logged(model: nn.Module, *inputs: torch.Tensor, steps: int = 2, **options):  # noqa: ANN202
    """The record of the last of ``steps`` logged steps (the first one probes the read plans)."""
    monitor = GradientMonitor(model, **{"activations": True, "attention_logits": True, **options})
    with monitor.attach():
        for _ in range(steps):
            with monitor.arm():
                out = model(*inputs)
                (out if isinstance(out, torch.Tensor) else out[0]).float().square().mean().backward()
                record = monitor.collect()
    return record


def _entries(record, kind: Kind) -> dict:  # noqa: ANN001
    return {e.name: e for e in record.entries if e.kind == kind}


def _by_hand(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The per-head maxima of ``scale·q·kᵀ (+ bias)`` over the allowed positions, one head at a time."""
    heads = []
    for h in range(q.shape[1]):
        logits = torch.einsum("bqe,bke->bqk", q[:, h].double(), k[:, h].double()) * scale
        if bias is not None:
            logits = logits + bias.double().expand(q.shape[0], q.shape[1], *logits.shape[1:])[:, h]
        if allowed is not None:
            logits = logits.masked_fill(~allowed.expand(q.shape[0], q.shape[1], *logits.shape[1:])[:, h], -math.inf)
        heads.append(logits.max())
    return torch.stack(heads)


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``: optional QK-norm,
    boolean or additive masks, causal, GQA; keeps the q and k it passed."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int | None = None, qk_norm: bool = False,
                 keep: bool = True, **call) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.call = heads, kv_heads or heads, call
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width // heads * self.kv_heads)
        self.norm = nn.LayerNorm(width // heads) if qk_norm else None
        self.out = nn.Linear(width, width)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if keep else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        if self.norm is not None:
            q, k = self.norm(q), self.norm(k)
        if self.seen is not None:
            self.seen.append((q.detach(), k.detach()))
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads, **self.call)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attn = attention
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


T = 12
CAUSAL = torch.ones(T, T, dtype=torch.bool).tril()


@pytest.mark.parametrize(("call", "allowed", "bias"), [
    pytest.param({}, None, None, id="plain"),
    pytest.param({"is_causal": True}, CAUSAL, None, id="is_causal"),
    pytest.param({"attn_mask": CAUSAL, "scale": 0.3}, CAUSAL, None, id="bool-mask-and-scale"),
    pytest.param({"attn_mask": torch.linspace(-2, 2, T * T).view(T, T)}, None, torch.linspace(-2, 2, T * T).view(T, T),
                 id="additive-mask"),
])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_logged_maximum_logit_is_the_one_computed_by_hand_from_q_and_k(call, allowed, bias, kv_heads):
    torch.manual_seed(0)
    attention = SelfAttention(kv_heads=kv_heads, qk_norm=True, **call)
    record = _logged(Block(attention), torch.randn(3, T, 32) * 3)
    q, k = attention.seen[-1]
    k = k.repeat_interleave(4 // kv_heads, dim=1)
    expected = _by_hand(q, k, call.get("scale", 8**-0.5), allowed, bias)
    entry = _entries(record, Kind.ATTENTION_LOGIT)["attn"]  # the module that made the call, not a parent
    assert entry.count == 4  # one maximum per head
    assert forward_values(entry.kind, entry.stats)["max"] == pytest.approx(expected.max().item(), rel=1e-5)
    assert entry.stats.mean == pytest.approx(expected.mean().item(), rel=1e-5)


def test_the_maximum_is_taken_in_query_chunks_and_is_the_same(monkeypatch):
    torch.manual_seed(1)
    q, k = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 50, 8)
    mask = torch.rand(40, 50) > 0.3
    whole = max_logits(q, k, mask)
    monkeypatch.setattr("lightning_gradhooks.core.attention.CHUNK_ELEMENTS", 2 * 3 * 50 * 7)  # 7 queries a chunk
    assert torch.equal(max_logits(q, k, mask), whole)
    assert torch.allclose(whole, _by_hand(q, k, 8**-0.5, mask).float())
    assert CHUNK_ELEMENTS == 1 << 22


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 5, 7)], ids=["one-mask-for-all-heads", "a-mask-per-head"])
def test_a_boolean_mask_of_any_size_masks_the_same_logits_and_a_head_masked_out_is_minus_inf(shape):
    torch.manual_seed(2)
    q, k = torch.randn(2, 3, 5, 8) * 4, torch.randn(2, 3, 7, 8) * 4
    allowed = (torch.rand(shape) > 0.5).expand(2, 3, 5, 7).clone()
    allowed[:, 1] = False  # head 1: every position masked out
    mask = allowed if len(shape) == 4 else allowed[0, 0]
    if len(shape) == 2:
        mask[0, 0] = True  # the one mask lets something through for every head
        allowed = mask.expand(2, 3, 5, 7).clone()
    found = max_logits(q, k, mask)
    expected = _by_hand(q, k, 8**-0.5, allowed).float()
    assert torch.equal(torch.isinf(found), torch.isinf(expected))
    assert torch.allclose(found, expected)
    assert (found[1] == -math.inf) == (len(shape) == 4)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_logits_on_both_of_its_paths(need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, T, 16) * 2
    mask = torch.triu(torch.full((T, T), -math.inf), 1)  # float causal mask
    model = nn.Sequential()  # a parent whose forward calls the MHA as a transformer layer does

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, attn_mask=mask, need_weights=need_weights)[0]

    model = Layer()
    record = _logged(model, x)
    q, k, _ = F._in_projection_packed(x, x, x, mha.in_proj_weight, mha.in_proj_bias)
    split = lambda t: t.view(2, T, 4, 4).transpose(1, 2)  # noqa: E731
    expected = _by_hand(split(q).detach(), split(k).detach(), 0.5, bias=mask)
    entry = _entries(record, Kind.ATTENTION_LOGIT)["mha"]
    assert entry.count == 4
    assert entry.stats.high == pytest.approx(expected.max().item(), rel=1e-5)


def test_transformers_models_with_sdpa_are_measured_after_rope_with_gqa():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    seen = {}

    def keep(module, args, kwargs):  # noqa: ANN001, ANN202
        seen[module] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

    attention = model.model.layers[1].self_attn
    handle = attention.register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.randint(0, 64, (2, T))
    record = _logged(model, ids)
    handle.remove()
    hidden, (cos, sin) = seen[attention]
    with torch.no_grad():
        q = attention.q_proj(hidden).view(2, T, 4, 8).transpose(1, 2)
        k = attention.k_proj(hidden).view(2, T, 2, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    expected = _by_hand(q, k.repeat_interleave(2, dim=1), attention.scaling, CAUSAL)
    logits = _entries(record, Kind.ATTENTION_LOGIT)
    assert set(logits) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert logits["model.layers.1.self_attn"].stats.high == pytest.approx(expected.max().item(), rel=1e-4)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 attn_implementation="sdpa"))
    assert set(_entries(_logged(gpt2, ids), Kind.ATTENTION_LOGIT)) == {"transformer.h.0.attn", "transformer.h.1.attn"}


def test_attention_that_cannot_be_seen_is_named_once():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                   attn_implementation="eager"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = _logged(model, torch.randint(0, 64, (2, T)), steps=3)
    said = [str(w.message) for w in caught if "attention_logits" in str(w.message)]
    assert len(said) == 1 and "transformer.h.0.attn, transformer.h.1.attn" in said[0]
    assert not _entries(record, Kind.ATTENTION_LOGIT)


def test_output_statistics_are_those_of_each_output_as_its_module_returned_it():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.lstm = nn.LSTM(8, 4, batch_first=True)
            self.seen: dict[str, torch.Tensor] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            self.seen["fc"] = h.detach().clone()
            out, (hn, cn) = self.lstm(torch.relu_(h))  # fc's output changed in place after its hook
            self.seen.update({"lstm/0": out.detach(), "lstm/1/0": hn.detach(), "lstm/1/1": cn.detach()})
            return out

    torch.manual_seed(0)
    net = Net()
    record = _logged(net, torch.randn(4, 5, 8))
    outputs = _entries(record, Kind.OUTPUT)
    assert set(outputs) == {"fc", "lstm/0", "lstm/1/0", "lstm/1/1"}  # a row per tensor
    for name, t in net.seen.items():
        values = step_summary(record.with_entries([outputs[name]]))
        (stats,) = values.values()
        assert stats["rms"] == pytest.approx(t.square().mean().sqrt().item(), rel=1e-5)
        assert stats["absmax"] == pytest.approx(t.abs().max().item(), rel=1e-6)
        assert stats["mean"] == pytest.approx(t.mean().item(), abs=1e-6)
        assert stats["zero_fraction"] == (t == 0).float().mean().item()
        assert stats["outlier"] == pytest.approx(t.abs().max().item() / t.square().mean().sqrt().item(), rel=1e-5)
    assert outputs["fc"].stats.zero_fraction == 0.0  # read before the relu_ that zeroed half of it


def test_an_output_changed_in_place_later_than_the_probe_is_said_once_and_then_copied():
    """Outputs are batched with the gradients and read later: one that an in-place op changes
    before its batch runs, where the probe's step did not show it, gives no row (never the
    statistics of what it became), said once; from the next step it is read from a copy."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
            self.in_place = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            self.seen = h.detach().clone()
            return self.out(h.relu_() if self.in_place else h.relu())

    torch.manual_seed(0)
    net, x = Net(), torch.randn(16, 8)
    monitor = GradientMonitor(net)
    records = []
    with monitor.attach(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            net.in_place = step >= 2
            with monitor.arm():
                net(x).sum().backward()
                records.append(_entries(monitor.collect(), Kind.OUTPUT))
            assert records[-1].keys() == ({"out"} if step == 2 else {"fc", "out"})
            if step != 2:
                assert records[-1]["fc"].stats.absmax == pytest.approx(net.seen.abs().max().item())
    said = [str(w.message) for w in caught if "before their statistics were read" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(": fc")


def test_output_statistics_and_attention_logits_on_by_default_and_checked():
    torch.manual_seed(0)
    block, x = Block(SelfAttention()), torch.randn(2, T, 32)
    monitor = GradientMonitor(block)
    with monitor.attach(), monitor.arm():
        block(x).sum().backward()
        record = monitor.collect()
    assert record.entries and _entries(record, Kind.OUTPUT) and list(_entries(record, Kind.ATTENTION_LOGIT)) == ["attn"]
    monitor = GradientMonitor(block, activations=False, attention_logits=False)
    with monitor.attach(), monitor.arm():
        block(x).sum().backward()
        record = monitor.collect()
        assert not _entries(record, Kind.ATTENTION_LOGIT) and not _entries(record, Kind.OUTPUT)
    with pytest.raises(ValueError, match="activations"):
        GradientMonitor(nn.Linear(2, 2), activations=1)
    with pytest.raises(ValueError, match="attention_logits"):
        GradientMonitor(nn.Linear(2, 2), attention_logits="yes")


def test_steps_that_are_not_logged_run_nothing_of_ours_and_a_raising_forward_leaves_no_mode():
    stacks = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stacks.append(torch._C._len_torch_function_stack())
            if x.shape[0] == 1:
                raise RuntimeError("boom")
            return x

    model = nn.Sequential(Block(SelfAttention()), Probe())
    monitor = GradientMonitor(model, activations=True, attention_logits=True)
    with monitor.attach():
        with monitor.arm():
            model(torch.randn(2, T, 32)).sum().backward()
            monitor.collect()
        assert stacks == [1]  # the mode, during the logged forward only
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        model(torch.randn(2, T, 32))
        with pytest.raises(RuntimeError, match="boom"), monitor.arm():
            model(torch.randn(1, T, 32))
        assert stacks == [1, 0, 1] and torch._C._len_torch_function_stack() == 0
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_attention_in_compiled_code_is_measured_eagerly_or_named_once_when_kept_compiled():
    """Logged steps of compiled code run eagerly: its attention logits are measured, as uncompiled.
    Kept compiled (eager_logged_steps=False), the module is named once and its code runs compiled,
    with no recompile of ours (the attention mode is not entered around it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    attention = SelfAttention(keep=False)
    block = Block(attention)
    x = torch.randn(2, T, 32)
    plain = _entries(_logged(block, x, steps=2, compile_statistics=False), Kind.ATTENTION_LOGIT)
    block.attn = torch.compile(attention, backend="eager")
    seen = _entries(_logged(block, x, steps=2), Kind.ATTENTION_LOGIT)
    assert list(seen) == list(plain) == ["attn"]
    assert seen["attn"].stats.absmax == pytest.approx(plain["attn"].stats.absmax, rel=1e-6)
    block(x)  # compiled, once, outside any logged step
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = _logged(block, x, steps=3, eager_logged_steps=False)
    said = [str(w.message) for w in caught if "attn" in str(w.message)]
    assert len(said) == 1 and "parameter gradients only" in said[0] and "attention logits" in said[0]
    assert said[0].endswith(": attn.q, attn.kv, attn.out")
    assert not _entries(record, Kind.ATTENTION_LOGIT)
    assert counters["stats"]["unique_graphs"] == graphs  # no mode around compiled code: no recompile
    torch._dynamo.reset()


def test_torch_nn_modules_run_outside_the_mode_and_a_call_belongs_to_the_innermost_module_of_yours():
    """torch.nn's own modules make no attention call: they run outside the mode (each op it sees costs
    the host), a module of yours that they call gets it back, and its call is attributed to it."""
    stacks: dict[str, int] = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stacks["probe"] = torch._C._len_torch_function_stack()
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(32, 32), Probe(), SelfAttention(keep=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stacks["outer"] = torch._C._len_torch_function_stack()
            return self.seq(x)

    torch.manual_seed(0)
    model, mlp = Outer(), nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model.seq[0].register_forward_pre_hook(lambda m, a: stacks.__setitem__("linear", torch._C._len_torch_function_stack()))
    mlp[1].register_forward_pre_hook(lambda m, a: stacks.__setitem__("tanh", torch._C._len_torch_function_stack()))
    record = _logged(model, torch.randn(2, T, 32))
    assert stacks == {"outer": 1, "linear": 0, "probe": 1}
    assert list(_entries(record, Kind.ATTENTION_LOGIT)) == ["seq.2"]
    monitor = GradientMonitor(mlp, activations=True, attention_logits=True)
    with monitor.attach(), monitor.arm():
        mlp(torch.randn(2, 32)).sum().backward()
        assert not mlp._forward_pre_hooks and stacks["tanh"] == 0  # no module that may call: no hook, no mode
        monitor.collect()
