"""The validation panel of the report's forward flags (``attention_logits``, ``activation_growth``):
healthy runs of transformers with and without QK-norm, CNNs, RNNs, LayerScale and attention
sinks, which must stay clean, and unstable runs, which must be flagged where their numbers leave
the healthy range; fitted with ``GradHooks(activations=True, attention_logits=True)``.

Two halves, written before any threshold was tuned: ``TUNE`` (the definitions may be tuned on
it) and ``HELDOUT`` (other architectures, run once after). Run from the repository root::

    PYTHONPATH=$PWD:$PWD/tests python tests/helpers/forward_panel.py --half tune|heldout|all [--seeds 0 1]

One line per run as for tests/helpers/report_panel_runs.py, plus the largest attention logit and
the largest growth of an output RMS over its first logged value seen in the run's log.
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import report_panel as panel
from report_panel_runs import Expect, Run


def markov_tokens(seed: int, n: int = 512, length: int = 32, vocab: int = 64) -> torch.Tensor:
    """Sequences of a fixed Markov chain: each token has 4 likely successors (the issue's task)."""
    g = torch.Generator().manual_seed(1000 + seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, length):
        pick = torch.randint(0, 4, (n,), generator=g)
        x[:, t] = successors[x[:, t - 1], pick]
    return x


class CausalAttention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, optional QK-norm."""

    def __init__(self, width: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.q_norm = nn.LayerNorm(width // heads) if qk_norm else None
        self.k_norm = nn.LayerNorm(width // heads) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class LMBlock(nn.Module):
    def __init__(self, width: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalAttention(width, heads, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """The issue's 2-block causal LM (pre-norm, learned positions), ``net(input_ids=, labels=).loss``.

    With ``sink``: every sequence starts with a BOS token whose embedding holds one massive
    feature (100 times the others), as the attention sinks of trained LLMs do."""

    def __init__(self, vocab: int = 64, width: int = 128, heads: int = 4, blocks: int = 2, length: int = 32,
                 qk_norm: bool = False, sink: bool = False) -> None:
        super().__init__()
        self.sink = sink
        self.emb = nn.Embedding(vocab + 1, width)
        self.pos = nn.Parameter(torch.randn(length + 1, width) * 0.02)
        self.blocks = nn.Sequential(*[LMBlock(width, heads, qk_norm) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        massive = torch.zeros(width)
        massive[3] = 100.0
        self.register_buffer("massive", massive)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.emb(input_ids)
        if self.sink:
            bos = self.emb.weight[-1] + self.massive
            x = torch.cat([bos.expand(len(x), 1, -1), x], 1)
        x = x + self.pos[: x.shape[1]]
        logits = self.head(self.norm(self.blocks(x)))[:, -labels.shape[1]:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def causal_lm(seed: int, lr: float = 1e-2, qk_norm: bool = False, sink: bool = False, warmup: int = 0):  # noqa: ANN201
    """:class:`CausalLM` on :func:`markov_tokens`, AdamW, no warmup unless asked (the issue's runs)."""
    x = markov_tokens(seed)
    lit = panel.Lit(CausalLM(qk_norm=qk_norm, sink=sink), "adamw", lr, task="lm",
                    schedule="cosine" if warmup else None, warmup=warmup)
    return lit, TensorDataset(x, x)


class ResidualMLP(nn.Module):
    """``x + W2·relu(W1·x)`` blocks with no normalisation: each block adds to a stream that
    nothing rescales, so the activations compound block after block when the weights grow."""

    def __init__(self, width: int = 64, blocks: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                                      for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def residual_mlp(seed: int, lr: float = 1e-3, warmup: int = 0):  # noqa: ANN201
    """:class:`ResidualMLP`, Adam; with ``warmup``, a linear warmup to ``lr`` and no decay after it."""
    return panel.Lit(ResidualMLP(), "adam", lr, schedule="linear" if warmup else None, warmup=warmup,
                     total_steps=10**6), panel.points(seed)


class PlainResidualCNN(nn.Module):
    """A residual CNN with no normalisation layer (conv-ReLU-conv plus the input, 6 blocks)."""

    def __init__(self, width: int = 16, blocks: int = 6, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                                    nn.Conv2d(width, width, 3, padding=1)) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


def plain_residual_cnn(seed: int, lr: float = 1e-3):  # noqa: ANN201
    return panel.Lit(PlainResidualCNN(), "adam", lr), panel.images(seed)


def mha_encoder(seed: int, lr: float = 1e-3, warmup: int = 10):  # noqa: ANN201
    """``nn.TransformerEncoder`` classifier (its ``nn.MultiheadAttention``), AdamW."""
    return panel.Lit(panel.TinyTransformer(), "adamw", lr, schedule="linear" if warmup else None,
                     warmup=warmup), panel.sequences(seed)


def gpt2_fast(seed: int, lr: float):  # noqa: ANN201
    """GPT-2 (``transformers``, SDPA) as in :func:`report_panel.gpt2_schedule`, at a constant ``lr``, no warmup."""
    panel.hf_offline()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    x = panel.counting(seed)
    return panel.Lit(GPT2LMHeadModel(config), "adamw", lr, task="lm"), TensorDataset(x, x)


# -- added 2026-11-28 (second held-out set of activation_growth, written before the check's fix was run on them)
class ReZeroMLP(ResidualMLP):
    """:class:`ResidualMLP` with ReZero gates: ``x + a·block(x)``, each ``a`` initialised to 0,
    so every block's output (the gated branch) starts at exactly zero and grows to its scale."""

    def __init__(self, width: int = 64, blocks: int = 8, classes: int = 3) -> None:
        super().__init__(width, blocks, classes)
        self.gates = nn.ModuleList(Gate() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block, gate in zip(self.blocks, self.gates):
            x = x + gate(block(x))
        return self.head(x)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x


def rezero_mlp(seed: int, lr: float = 1e-3):  # noqa: ANN201
    return panel.Lit(ReZeroMLP(), "adam", lr), panel.points(seed)


def resnet_zero_init_residual(seed: int):  # noqa: ANN201
    """:class:`report_panel.ResNet` with each block's last BatchNorm scale initialised to 0
    (``zero_init_residual=True`` in torchvision): the residual branches start at zero."""
    net = panel.ResNet()
    for block in (net.layer1, net.layer2, net.layer3):
        nn.init.zeros_(block.bn2.weight)
    return panel.Lit(net, "sgd", 0.05), panel.images(seed)


def vit_zero_head(seed: int):  # noqa: ANN201
    """:class:`report_panel.ViT` with its classifier head initialised to zero (as timm does with
    ``head_init_scale=0``): its logits start at exactly 0 and grow as it learns."""
    net = panel.ViT()
    nn.init.zeros_(net.head.weight)
    return panel.Lit(net, "adamw", 1e-3), panel.images(seed)


def lora_bert(seed: int):  # noqa: ANN201
    """``peft`` LoRA (r 4, alpha 32, on ``query``, ``value`` and ``dense``) on a frozen random BERT
    classifier (2 layers, 32 wide), its classifier trained in full; AdamW 2e-3, cosine after 10
    warmup steps."""
    panel.hf_offline()
    import peft
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    net = peft.get_peft_model(BertForSequenceClassification(config), peft.LoraConfig(
        r=4, lora_alpha=32, target_modules=["query", "value", "dense"], modules_to_save=["classifier"]))
    return panel.Lit(net, "adamw", 2e-3, schedule="cosine", warmup=10), panel.sequence_labels(seed)


class AdapterMLP(nn.Module):
    """A frozen random MLP with a bottleneck adapter after each layer (Houlsby style: down,
    GELU, up, its up-projection initialised to zero, added to the layer's output), and a
    trained head."""

    def __init__(self, width: int = 64, layers: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.adapters = nn.ModuleList(nn.Sequential(nn.Linear(width, 8), nn.GELU(), nn.Linear(8, width))
                                      for _ in range(layers))
        for adapter in self.adapters:
            nn.init.zeros_(adapter[2].weight)
            nn.init.zeros_(adapter[2].bias)
        for p in [*self.stem.parameters(), *self.layers.parameters()]:
            p.requires_grad_(False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        for layer, adapter in zip(self.layers, self.adapters):
            x = torch.tanh(layer(x))
            x = x + adapter(x)
        return self.head(x)


def adapter_mlp(seed: int):  # noqa: ANN201
    return panel.Lit(AdapterMLP(), "adam", 3e-3), panel.points(seed)



TUNE = {r.name: r for r in [
    # -- healthy
    Run("lm_lr1e-2", lambda s: causal_lm(s, 1e-2), "2-block causal LM, SDPA, no QK-norm", "AdamW 1e-2, no warmup", 200, 10),
    Run("lm_qknorm_lr1e-1", lambda s: causal_lm(s, 1e-1, qk_norm=True), "2-block causal LM, SDPA, QK-norm",
        "AdamW 1e-1, no warmup", 200, 10),
    Run("resnet_bn", panel.resnet, "ResNet with BatchNorm (CNN)", "SGD 0.05 momentum", 100, 5),
    Run("lstm_h_n", panel.lstm_h_n, "LSTM classifier (RNN)", "AdamW 1e-3", 100, 5),
    Run("vit_sdpa", panel.vit, "ViT, SDPA, cls token", "AdamW 1e-3", 100, 5),
    Run("residual_mlp_healthy", residual_mlp, "residual MLP, no normalisation", "Adam 1e-3", 200, 10),
    # -- unstable
    Run("lm_lr1e-1", lambda s: causal_lm(s, 1e-1), "2-block causal LM, SDPA, no QK-norm", "AdamW 1e-1, no warmup",
        200, 10, expect=Expect("attention_logits", "net.blocks", (0, 20), "QK-norm")),
    # (Adam 3e-2 from the start was tried first: its ReLUs die, dead flagged; no growth.)
    Run("residual_mlp_warmup_to_1e-1", lambda s: residual_mlp(s, 1e-1, warmup=100), "residual MLP, no normalisation",
        "Adam, warmup over 100 steps to 1e-1: the stream grows x1e5 from step 80-90, no NaN", 200, 10,
        expect=Expect("activation_growth", "net.blocks", (60, 100))),
]}

HELDOUT = {r.name: r for r in [
    # -- healthy
    Run("gpt2_hf_cosine", panel.gpt2_schedule, "GPT-2 (transformers, SDPA)", "AdamW 1e-3, warmup 20 + cosine",
        200, 10, trainer={"gradient_clip_val": 1.0}, schedule=True),
    Run("vit_layerscale", panel.vit_layerscale, "ViT with LayerScale 1e-4", "AdamW 2e-3, warmup 20 + cosine",
        200, 10, trainer={"gradient_clip_val": 1.0}, schedule=True),
    Run("lm_sink", lambda s: causal_lm(s, 3e-3, sink=True), "causal LM with a massive-activation BOS (attention sink)",
        "AdamW 3e-3", 200, 10),
    Run("mha_encoder", mha_encoder, "nn.TransformerEncoder (nn.MultiheadAttention)", "AdamW 1e-3, warmup 10 + linear",
        200, 10, schedule=True),
    Run("mobilenet", panel.mobilenet, "MobileNet-like CNN, BN", "SGD 0.05 momentum", 100, 5),
    Run("gru_attention_pool", panel.attention_pool, "GRU + attention pooling (RNN)", "Adam", 100, 5),
    Run("plain_cnn_healthy", plain_residual_cnn, "residual CNN, no normalisation", "Adam 1e-3", 100, 5),
    # -- unstable
    Run("gpt2_hf_lr1e-1", lambda s: gpt2_fast(s, 1e-1), "GPT-2 (transformers, SDPA)", "AdamW 1e-1, no warmup",
        200, 10, expect=Expect("attention_logits", "net.transformer.h", (0, 50), "QK-norm")),
    Run("mha_encoder_lr1e-1", lambda s: mha_encoder(s, 1e-1, warmup=0), "nn.TransformerEncoder (nn.MultiheadAttention)",
        "AdamW 1e-1, no warmup", 200, 10, expect=Expect("attention_logits", "net.encoder", (0, 50))),
    Run("plain_cnn_lr3e-2", lambda s: plain_residual_cnn(s, 3e-2), "residual CNN, no normalisation", "Adam 3e-2",
        100, 5, expect=Expect("activation_growth", "net.blocks", (0, 50))),
    # -- added 2026-11-28, before the fix of activation_growth's level was run on them: outputs
    # initialised to zero that grow to their scale; healthy
    Run("rezero_mlp", rezero_mlp, "residual MLP with ReZero gates (init 0)", "Adam 1e-3", 200, 10),
    Run("resnet_zero_init_residual", resnet_zero_init_residual, "ResNet, last BN of each block init 0",
        "SGD 0.05 momentum", 100, 5),
    Run("vit_zero_head", vit_zero_head, "ViT, classifier head init 0", "AdamW 1e-3", 100, 5),
    Run("lora_bert", lora_bert, "peft LoRA r4 alpha 32 on frozen BERT + trained classifier",
        "AdamW 2e-3, warmup 10 + cosine", 200, 10, schedule=True),
    Run("adapter_mlp", adapter_mlp, "frozen MLP + bottleneck adapters (up-projection init 0)", "Adam 3e-3", 200, 10),
]}

HALVES = {"tune": TUNE, "heldout": HELDOUT}


def raw_extremes(log_dir: str) -> str:
    """From the run's log: the largest attention logit, and the largest output RMS over that
    output's first logged RMS (what the flags read, before any definition), with their steps."""
    from pathlib import Path

    from lightning_gradhooks.__main__ import read_folder

    top, growth, first, at = -math.inf, 0.0, {}, [None, None]
    steps = read_folder(Path(log_dir)).steps
    for step in sorted(steps):
        for key, s in steps[step].items():
            if key.kind == "attention_logit" and math.isfinite(s.get("max", math.nan)) and s["max"] > top:
                top, at[0] = s["max"], step
            if key.kind == "output" and math.isfinite(s.get("rms", math.nan)) and s["rms"] > 0:
                if s["rms"] / first.setdefault(key, s["rms"]) > growth:
                    growth, at[1] = s["rms"] / first[key], f"{step} {key.name}"
    return f"max logit {top:.3g} (step {at[0]}), output RMS x{growth:.3g} its first ({at[1]})"


if __name__ == "__main__":
    import report_panel_runs

    sys.exit(report_panel_runs.main(sys.argv[1:], HALVES, raw_extremes))
