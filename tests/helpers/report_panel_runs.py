"""The runs of the health report's validation panel and their runner.

A run is a maker of ``tests/helpers/report_panel.py``, a seed, fit settings and the outcome expected of
the report: none for a healthy run (no ``nonfinite``, ``exploding``, ``vanishing``, ``dead`` or
``stalled`` row; ``note`` rows are allowed), or a flag on a module since a step in a range. The
runs are split into two halves of different architectures and practices: ``TUNE``, on which
the report's definitions may be tuned, and ``HELDOUT``, run once at the end to judge them.

Run from the repository root::

    PYTHONPATH=$PWD:$PWD/tests python tests/helpers/report_panel.py --half tune|heldout|all [--seeds 0 1] [--runs NAME ...] [--compiled]

One line per run: name, half, seed, seconds, loss first -> last (the mean of the last tenth),
the first line of the printed report, whether the CLI's report of the log equals it, PASS or
FAIL (and why); the printed report in full under each FAIL. A run passes when its report meets
the expected outcome (:func:`judge`), the CLI's report of its log is the same text and it has at
most 40 lines. Exit status 1 when a run fails.
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import report_panel as panel
from lightning_gradhooks.health import FLAGS

#: The flags a healthy run must not get (a ``note`` is not a flag).
PROBLEMS = FLAGS


@dataclass(frozen=True)
class Expect:
    """A broken run's expected outcome: ``flag`` on ``module`` (a row for it or for a module
    inside it, or a consequence under any row; ``None``: any module), since a logged step in
    ``since`` (inclusive); ``detail``: a phrase the row's text should hold."""

    flag: str
    module: str | None
    since: tuple[int, int]
    detail: str | None = None


@dataclass(frozen=True)
class Run:
    """One run of the panel: ``make(seed)`` fitted for ``steps`` optimizer steps (Lightning's
    ``global_step``), logged every ``every``; ``expect`` None for a healthy run."""

    name: str
    make: Callable
    arch: str
    practice: str
    steps: int
    every: int
    expect: Expect | tuple[Expect, ...] | None = None
    batch: int = 16
    trainer: dict = field(default_factory=dict)
    resume_at: int | None = None
    schedule: bool = False  # a warmup + decay schedule stepped every optimizer step
    seeds: tuple[int, ...] | None = None  # the seeds its ground truth was checked on, when it depends on the seed
    forbid: tuple[str, ...] = ()  # phrases the report must not say (a false cause, a wrong note)
    hooks: dict = field(default_factory=dict)  # more GradHooks arguments

    @property
    def healthy(self) -> bool:
        return self.expect is None

    @property
    def expects(self) -> tuple[Expect, ...]:
        """The expected outcomes: every one must hold."""
        return () if self.expect is None else self.expect if isinstance(self.expect, tuple) else (self.expect,)


CLIP = {"gradient_clip_val": 1.0}
SPIKES = {"spikes": True}

TUNE = {r.name: r for r in [
    # -- healthy
    Run("gpt2_cosine", panel.gpt2_schedule, "GPT-2 (transformers), tied embeddings",
        "AdamW wd 0.01, warmup 20 + cosine, clip 1.0", 200, 10, trainer=CLIP, schedule=True),
    Run("bart_reverse", panel.bart_reverse, "BART encoder-decoder (transformers)",
        "AdamW, warmup 10 + linear decay, dropout", 200, 10, schedule=True),
    Run("lora_gpt2", panel.lora_gpt2, "peft LoRA on frozen GPT-2 (lora_B zero-init)",
        "AdamW, warmup 10 + cosine", 200, 10, schedule=True),
    Run("bias_resnet", panel.bias_resnet, "ResNet, conv bias=True before BatchNorm",
        "SGD momentum, wd 5e-4, warmup 20 + cosine, clip 1.0", 200, 10, trainer=CLIP, schedule=True),
    Run("dcgan_manual", panel.dcgan, "DCGAN, Linear/ConvT bias before BatchNorm",
        "manual optimization, two Adam optimizers", 300, 10, batch=32),
    Run("moe_top1", panel.moe, "mixture-of-experts MLP, top-1 routing, a rare expert",
        "AdamW, warmup 10 + linear decay, load-balancing loss", 200, 10, batch=32, schedule=True),
    Run("scale_before_layernorm", panel.scale_before_norm, "MLP with a learned scalar scale+shift before LayerNorm",
        "Adam, dropout, label smoothing 0.1", 100, 5),
    Run("resnet_resumed", panel.resnet, "ResNet (bias=False, frozen stem)",
        "SGD momentum; resumed from last.ckpt at step 40", 80, 5, resume_at=40),
    Run("lstm_tagger", panel.lstm_tagger, "2-layer LSTM tagger, dropout between layers",
        "Adam, warmup 10 + linear decay, clip 0.5", 200, 10, trainer={"gradient_clip_val": 0.5}, schedule=True),
    # -- broken
    Run("relu_rnn_explodes", panel.relu_rnn_explode, "ReLU RNN, recurrent spectral radius 1.6, 128 steps",
        "SGD 0.01 momentum", 30, 5,
        expect=(Expect("exploding", "net.rnn", (0, 0)), Expect("nonfinite", None, (1, 5)))),
    Run("orphan_head_resnet", lambda seed: panel.bias_resnet(seed, left_out=("net.fc",)),
        "ResNet, conv bias=True before BatchNorm", "head left out of configure_optimizers", 60, 5, trainer=CLIP,
        schedule=True, expect=Expect("stalled", "net.fc", (0, 5), "in no optimizer")),
    Run("dead_conv_layer", panel.dead_cnn, "plain CNN, a conv with bias -50 before ReLU",
        "Adam 1e-3", 60, 5, expect=Expect("dead", "net.2", (0, 10))),
    Run("deep_sigmoid_vanishing", panel.deep_sigmoid, "31-layer sigmoid MLP",
        "SGD 0.05 momentum", 60, 5, expect=Expect("vanishing", "net.0", (0, 10))),
    Run("nan_batch_unlogged_resnet", panel.damaged(panel.bias_resnet, nan_input_at=14, nan_input_once=True),
        "ResNet, conv bias=True before BatchNorm", "one NaN in the batch of step 14 (logged: every 5)",
        30, 5, expect=Expect("nonfinite", None, (14, 15))),
    Run("mlp_lr_too_large", lambda seed: panel.mlp_mse(seed, lr=5.0), "tanh MLP, squared loss",
        "SGD lr 5 momentum 0.9: diverges (loss inf at step 10)", 30, 3, expect=Expect("nonfinite", None, (0, 12))),
    Run("moe_routing_collapse", panel.moe_collapsed, "mixture-of-experts MLP, top-1 routing, no balancing",
        "AdamW, warmup 10 + linear decay; experts 0 and 3 get no token", 200, 10, batch=32, schedule=True,
        expect=Expect("stalled", "net.experts.3", (0, 10))),
    Run("gpt2_block_lr0", lambda seed: panel.gpt2_schedule(seed, frozen_lr=("net.transformer.h.1",)),
        "GPT-2 (transformers), tied embeddings", "block 1 in a param group with lr 0", 60, 5, trainer=CLIP,
        schedule=True, expect=Expect("stalled", "net.transformer.h.1", (0, 10))),
    # -- the causes (issue 37): healthy
    Run("ema_layernorm_mlp", panel.ema_layernorm_mlp, "LayerNorm GELU MLP + EMA copy (AveragedModel)",
        "Adam, warmup 10 + cosine; the EMA copy requires grad, in no optimizer", 200, 10, schedule=True),
    Run("weight_norm_mlp", panel.weight_norm_mlp, "tanh MLP, weight_norm parametrizations",
        "Adam, warmup 10 + cosine", 200, 10, schedule=True),
    Run("discriminative_frozen_stem", panel.discriminative_frozen_stem, "CNN + BN, frozen stem",
        "SGD momentum, wd, body lr 0.01 / head group 0.05, warmup 10 + cosine", 200, 10, schedule=True),
    Run("bf16_sgd_resnet", panel.bf16_resnet, "ResNet (bias=False, frozen stem)",
        "bf16-mixed, SGD momentum, warmup 10 + cosine", 100, 10, trainer={"precision": "bf16-mixed"}, schedule=True),
    Run("distill_frozen_teacher", panel.distill_frozen_teacher, "student MLP + frozen teacher MLP",
        "AdamW, CE + KL at T=2, warmup 10 + cosine", 200, 10, schedule=True),
    # -- the causes: broken
    Run("tiny_init_tanh_mlp", panel.tiny_tanh_mlp, "8-layer tanh MLP, init std 0.01",
        "SGD 0.1 momentum: gradients vanish geometrically", 100, 5,
        expect=Expect("vanishing", None, (0, 10)), forbid=("removable", "by construction")),
    Run("lr_to_zero_resnet", panel.lr_cut_resnet, "ResNet (bias=False, frozen stem)",
        "SGD momentum, warmup + cosine; the scheduler sets lr 0 from step 120", 200, 10, schedule=True,
        expect=Expect("stalled", None, (120, 130), "learning rate"), forbid=("follows from it",)),
    Run("detached_encoder", panel.detached_encoder, "MLP encoder + linear head",
        "Adam; the encoder's output is .detach()ed by mistake", 60, 5,
        expect=Expect("stalled", "net.encoder", (0, 5), "no gradient"), forbid=("follows from it",)),
    # -- fp16 under a gradient scaler (issue 43): healthy
    Run("fp16_mlp_scale_too_high", panel.fp16_mlp, "MLP, fp16 autocast, GradScaler init_scale 2^40",
        "Adam 3e-3: the scaler skips ~25 steps at the start, then trains", 60, 1, trainer={"init_scale": 2.0 ** 40}),
    Run("fp16_mlp_fused_scale_too_high", lambda seed: panel.fp16_mlp(seed, "adam_fused"),
        "MLP, fp16 autocast, GradScaler init_scale 2^40", "fused Adam (unscales in its own step)", 60, 3,
        trainer={"init_scale": 2.0 ** 40}),
    Run("fp16_mlp_spike_goes_away", lambda seed: panel.fp16_mlp(
        seed, events={30: panel.loss_times(1e9), 33: panel.loss_times(1.0)}), "MLP, fp16 autocast, GradScaler",
        "Adam; the loss x1e9 at steps 30-32: the scaler skips them, then trains", 60, 1, trainer={"init_scale": 2.0 ** 16}),
    # -- fp16: broken
    Run("fp16_mlp_blowup_stays", lambda seed: panel.fp16_mlp(seed, events={40: panel.weight_times("net.blowup", 1e6)}),
        "MLP, fp16 autocast, GradScaler", "Adam; net.blowup's output overflows fp16 from step 40 on", 70, 2,
        trainer={"init_scale": 2.0 ** 16},
        expect=(Expect("nonfinite", "net.blowup", (40, 40), "born in the forward of `net.blowup`"),
                Expect("nonfinite", "net.blowup", (40, 40), "skipped every step since 40"))),
    Run("fp16_mlp_fused_blowup_stays", lambda seed: panel.fp16_mlp(
        seed, "adam_fused", events={40: panel.weight_times("net.blowup", 1e6)}),
        "MLP, fp16 autocast, GradScaler", "fused Adam; net.blowup's output overflows fp16 from step 40 on", 80, 5,
        trainer={"init_scale": 2.0 ** 16},
        expect=Expect("nonfinite", "net.blowup", (40, 40), "born in the forward of `net.blowup`")),
    # -- spikes between logged steps (issue 53): healthy, then broken
    Run("weight_norm_mlp_restarts", panel.damaged(panel.weight_norm_mlp, schedule="restarts"),
        "tanh MLP, weight_norm parametrizations", "Adam 3e-3, warmup 10 + cosine with 3 warm restarts", 200, 50,
        schedule=True, hooks=SPIKES),
    Run("bad_batch_lstm_tagger", panel.damaged(panel.lstm_tagger, bad_batch_at=(77,)), "2-layer LSTM tagger, dropout between layers",
        "Adam, warmup 10 + linear, clip 0.5; the labels of step 77's batch flipped (logged: every 50)", 120, 50,
        trainer={"gradient_clip_val": 0.5}, schedule=True, hooks=SPIKES,
        expect=Expect("spike", None, (77, 77), "step 78 logged in full")),
]}

HELDOUT = {r.name: r for r in [
    # -- healthy
    Run("bert_accumulate", panel.bert_classifier, "BERT classifier (transformers), pooler, dropout",
        "AdamW wd, label smoothing, warmup 20 + linear, clip 1.0, accumulate 2", 200, 10,
        trainer={**CLIP, "accumulate_grad_batches": 2}, schedule=True),
    Run("t5_shift", panel.t5_shift, "T5 encoder-decoder (transformers), no biases",
        "AdamW, warmup 10 + cosine, dropout", 200, 10, schedule=True),
    Run("lora_distilbert", panel.lora_distilbert, "peft LoRA on frozen DistilBERT + trained head",
        "AdamW, warmup 10 + linear", 200, 10, schedule=True),
    Run("mobilenet_accumulate", panel.mobilenet, "MobileNet-like depthwise-separable CNN, BN",
        "SGD momentum, wd, warmup 10 + cosine, accumulate 4", 200, 10, batch=8,
        trainer={"accumulate_grad_batches": 4}, schedule=True),
    Run("unet_bias_bn", panel.unet, "UNet, conv bias before BN, skip connections",
        "Adam, warmup 10 + cosine", 200, 10, schedule=True),
    Run("vit_layerscale", panel.vit_layerscale, "ViT with layer scale (init 1e-4)",
        "AdamW wd 0.05, warmup 20 + cosine, clip 1.0", 200, 10, trainer=CLIP, schedule=True),
    Run("tied_tanh_rnn_lm", panel.tied_rnn_lm, "tanh RNN LM, tied embedding/output",
        "SGD 0.5 momentum, clip 0.5, warmup 10 + linear", 200, 10, trainer={"gradient_clip_val": 0.5}, schedule=True),
    Run("gru_attention_pool", panel.attention_pool, "GRU + attention pooling (score bias removed by softmax)",
        "Adam, label smoothing 0.05", 150, 10),
    Run("roberta_mlm", panel.roberta_mlm, "RoBERTa masked LM (transformers), tied decoder",
        "AdamW wd 0.01, warmup 20 + linear decay", 200, 10, schedule=True),
    # -- broken
    Run("dead_mlp_resumed", panel.damaged(lambda seed: panel.relu_mlp(seed, bias=-50.0), total_steps=80),
        "ReLU MLP, a layer with bias -50",
        "Adam, warmup + cosine; resumed from last.ckpt at step 40", 80, 5, resume_at=40,
        expect=Expect("dead", "net.2", (0, 10))),
    Run("orphan_head_bert", lambda seed: panel.bert_classifier(seed, left_out=("net.classifier",)),
        "BERT classifier (transformers)", "classifier left out of configure_optimizers", 60, 5, trainer=CLIP,
        schedule=True, expect=Expect("stalled", "net.classifier", (0, 5), "in no optimizer")),
    Run("deep_sigmoid_cnn_vanishing", panel.deep_sigmoid_cnn, "12-conv sigmoid CNN",
        "SGD 0.05 momentum", 60, 5, expect=Expect("vanishing", "net.0", (0, 10))),
    Run("mobilenet_block_lr0", lambda seed: panel.mobilenet(seed, frozen_lr=("net.blocks.2",)),
        "MobileNet-like depthwise-separable CNN, BN", "block 2 in a param group with lr 0", 60, 5,
        schedule=True, expect=Expect("stalled", "net.blocks.2", (0, 10))),
    Run("nan_batch_unlogged_unet", panel.damaged(panel.unet, nan_input_at=23, nan_input_once=True),
        "UNet, conv bias before BN", "one NaN in the batch of step 23 (logged: every 10)", 40, 10,
        expect=Expect("nonfinite", None, (23, 30))),
    Run("mobilenet_lr_too_large", lambda seed: panel.mobilenet(seed, lr=50.0, task="mse"),
        "MobileNet-like depthwise-separable CNN, BN", "SGD lr 50, squared loss: diverges (loss inf at step 7)", 40, 5,
        expect=Expect("nonfinite", None, (0, 10))),
    Run("irnn_explodes_under_clipping", panel.irnn, "IRNN (ReLU RNN, identity init), 64 steps",
        "SGD momentum, warmup 50 to lr 0.5 + cosine, clip 1.0: gradients explode from ~step 50-90",
        # The window was (60, 110) until 2026-11-28; the run's raw gradients (torch 2.13, seed 0) put
        # the explosion at step 50: net.rnn's weight_hh gradient norm 1.56 at step 40, 1.9e6 at 50
        # (loss 0.64 -> 10.8), 1.3e16 at 60, inf at 80. Read from the log, not from the report.
        200, 10, trainer=CLIP, schedule=True, expect=Expect("exploding", "net.rnn", (50, 110)), seeds=(0,)),
    Run("mlp_dies_mid_run", lambda seed: panel.relu_mlp(seed, kill_at=100), "ReLU MLP",
        "Adam, warmup + cosine; net.2's bias set to -50 before step 100", 200, 10, schedule=True,
        expect=Expect("dead", "net.2", (100, 110))),
    # -- the causes (issue 37): healthy
    Run("adafactor_transformer", panel.adafactor_transformer, "pre-norm Transformer encoder classifier",
        "torch.optim.Adafactor, warmup 10 + linear, dropout", 200, 10, schedule=True),
    Run("ema_gru", panel.ema_gru, "GRU classifier + EMA copy (AveragedModel)",
        "Adam, warmup 10 + linear", 200, 10, schedule=True),
    Run("clip_towers", panel.clip_towers, "CLIP-style image and text towers, learned temperature",
        "AdamW wd 0.1, contrastive loss, warmup 10 + cosine", 200, 10, batch=32, schedule=True),
    Run("sparse_adam_manual", panel.sparse_adam_manual, "sparse embedding bag + MLP",
        "manual optimization: SparseAdam (embedding) + Adam (MLP)", 200, 10),
    # -- the causes: broken
    Run("tiny_init_tanh_cnn", panel.tiny_tanh_cnn, "8-conv tanh CNN, init std 0.01",
        "SGD 0.1 momentum: gradients vanish geometrically", 60, 5,
        expect=Expect("vanishing", None, (0, 10)), forbid=("removable", "by construction")),
    Run("no_grad_side_branch", panel.no_grad_side_cnn, "CNN + a side branch run under torch.no_grad()",
        "SGD momentum, warmup + cosine", 60, 5, schedule=True,
        expect=Expect("stalled", "net.side", (0, 10), "no gradient"), forbid=("follows from it",)),
    Run("lr_to_zero_gru", panel.lr_cut_gru, "GRU classifier (mean over time)",
        "AdamW, warmup + linear; the scheduler sets lr 0 from step 100", 200, 10, schedule=True,
        expect=Expect("stalled", None, (100, 110), "learning rate"), forbid=("follows from it",)),
    Run("head_group_lr_to_zero", panel.group_cut_transformer, "Transformer encoder classifier, 2 groups",
        "AdamW, head group 3e-3 set to 0 from step 60 by the scheduler, the rest 1e-3", 100, 5,
        expect=Expect("stalled", None, (60, 65), "learning rate"), forbid=("follows from it",)),
    # -- fp16 under a gradient scaler (issue 43): healthy
    Run("fp16_cnn_scale_too_high", panel.fp16_cnn, "plain CNN, fp16 autocast, GradScaler init_scale 2^40",
        "SGD momentum 0.05", 60, 2, trainer={"init_scale": 2.0 ** 40}),
    Run("fp16_transformer_fused_scale_too_high", lambda seed: panel.fp16_transformer(seed, "adamw_fused"),
        "Transformer encoder classifier, fp16 autocast, GradScaler init_scale 2^36", "fused AdamW, dropout", 60, 5,
        trainer={"init_scale": 2.0 ** 36}),
    Run("fp16_cnn_spike_goes_away", lambda seed: panel.fp16_cnn(
        seed, "adam", 1e-3, events={30: panel.loss_times(1e9), 33: panel.loss_times(1.0)}),
        "plain CNN, fp16 autocast, GradScaler", "Adam; the loss x1e9 at steps 30-32", 60, 1,
        trainer={"init_scale": 2.0 ** 16}),
    # -- fp16: broken
    Run("fp16_transformer_overflow_stays", lambda seed: panel.fp16_transformer(
        seed, events={30: panel.weight_times("net.encoder.layers.1.linear1", 1e6)}),
        "Transformer encoder classifier, fp16 autocast, GradScaler", "AdamW; layer 1's FFN overflows from step 30 on",
        60, 2, trainer={"init_scale": 2.0 ** 16},
        expect=Expect("nonfinite", "net.encoder.layers.1", (30, 30), "born in the forward")),
    Run("fp16_cnn_fused_loss_overflows", lambda seed: panel.fp16_cnn(seed, "adam_fused", 1e-3,
                                                                    events={25: panel.loss_times(1e30)}),
        "plain CNN, fp16 autocast, GradScaler", "fused Adam; the loss x1e30 from step 25 on: the scale collapses",
        60, 5, trainer={"init_scale": 2.0 ** 16}, expect=Expect("nonfinite", None, (25, 25), "training has stopped")),
    # -- spikes between logged steps (issue 53): healthy, then broken
    Run("gru_attention_pool_restarts", panel.damaged(panel.attention_pool, schedule="restarts", warmup=10),
        "GRU + attention pooling (score bias removed by softmax)", "Adam, warmup 10 + cosine with 3 warm restarts",
        200, 50, schedule=True, hooks=SPIKES),
    Run("bad_batch_ema_gru", panel.damaged(panel.ema_gru, bad_batch_at=(113,)), "GRU classifier + EMA copy (AveragedModel)",
        "Adam, warmup 10 + linear; the labels of step 113's batch shifted (logged: every 50)", 160, 50,
        schedule=True, hooks=SPIKES, expect=Expect("spike", None, (113, 113), "step 114 logged in full")),
    Run("lr_jump_relu_mlp", lambda seed: panel.damaged(panel.relu_mlp, events={60: panel.lr_times(30.0)})(seed),
        "ReLU MLP", "Adam 3e-3, warmup + cosine; the learning rate x30 from step 60 on (logged: every 50)", 120, 50,
        schedule=True, hooks=SPIKES, expect=Expect("spike", None, (60, 65), "learning-rate change")),
]}

HALVES = {"tune": TUNE, "heldout": HELDOUT}


# -- judging a report -----------------------------------------------------------------------

def _bare(module: str) -> str:
    return re.sub(r"^optimizer_\d+/", "", module or "")


def _inside(module: str, expected: str) -> bool:
    module = _bare(module)
    return module == expected or module.startswith(expected + ".")


def judge(run: Run, report, losses: list[float]) -> tuple[bool, str]:  # noqa: ANN001
    """PASS/FAIL of one run against its expected outcome, and why."""
    rows = list(report.rows())
    if run.expect is None:
        bad = [r for r in rows if getattr(r, "flag", None) in PROBLEMS]
        finite = all(math.isfinite(v) for v in losses)
        trains = bool(losses) and _mean(losses[-max(1, len(losses) // 10):]) < losses[0]
        if not finite or not trains:
            return False, "NOT A HEALTHY RUN: " + ("non-finite loss" if not finite else "the loss did not fall")
        if bad:
            return False, "flagged: " + ", ".join(f"{r.flag} {r.module}" for r in bad[:4])
        return True, "no flag"
    candidates = []
    for r in rows:
        detail = getattr(r, "detail", "") or ""
        candidates.append((r.flag, r.module, r.since, detail))
        candidates += [(c.flag, c.module, c.since, detail) for c in getattr(r, "consequences", None) or []]
    text = report.table() if hasattr(report, "table") else ""
    said = [phrase for phrase in run.forbid if phrase in text]
    if said:
        return False, f"says {said[0]!r}, which is not so here"
    found = []
    for e in run.expects:
        ok, why = _expected(e, candidates)
        if not ok:
            return False, why
        found.append(why)
    return True, "; ".join(found)


def _expected(e: Expect, candidates: list[tuple]) -> tuple[bool, str]:
    hits = [c for c in candidates if c[0] == e.flag and (e.module is None or _inside(c[1], e.module))]
    where = f"{e.flag} on {e.module or 'any module'} since {e.since[0]}..{e.since[1]}"
    if not hits:
        return False, f"expected {where}: not found"
    timely = [h for h in hits if e.since[0] <= h[2] <= e.since[1]]
    if not timely:
        return False, f"expected {where}: found since {sorted({h[2] for h in hits})}"
    if e.detail and not any(e.detail in h[3] for h in timely):
        return False, f"expected {where} saying {e.detail!r}: found without it"
    return True, where


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str], halves: dict | None = None, extra: Callable | None = None) -> int:
    """The runner; ``halves`` (default :data:`HALVES`) by name; ``extra(log_dir)``: more to print per run."""
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(prog="python tests/helpers/report_panel.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=["tune", "heldout", "all"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=None, help="only these runs (names)")
    parser.add_argument("--compiled", action="store_true",
                        help="compile every model, logged steps kept compiled (no module statistics)")
    parser.add_argument("--spikes", action="store_true", help="every run with GradHooks(spikes=True)")
    args = parser.parse_args(argv)
    panel.COMPILED["on"] = args.compiled
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    every = halves or HALVES
    halves = ["tune", "heldout"] if args.half == "all" else [args.half]
    failed, totals = 0, {}
    for half in halves:
        started = time.perf_counter()
        for run in every[half].values():
            if args.runs and run.name not in args.runs:
                continue
            for seed in args.seeds:
                if run.seeds is not None and seed not in run.seeds:
                    print(f"{run.name:27s} {half:7s} s{seed} skipped: its ground truth depends on the seed; checked on "
                          f"seeds {', '.join(map(str, run.seeds))}", flush=True)
                    continue
                if args.spikes:
                    run = replace(run, hooks={**run.hooks, **SPIKES})
                failed += not _one(run, half, seed, extra)
        totals[half] = time.perf_counter() - started
    for half, seconds in totals.items():
        print(f"== {half}: {seconds:.0f} s")
    return 1 if failed else 0


def _one(run: Run, half: str, seed: int, extra: Callable | None = None) -> bool:
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        import contextlib
        import io

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            report, text, log_dir, model = panel.fit(Path(root), run.make, seed, steps=run.steps, every=run.every,
                                                     batch=run.batch, trainer=run.trainer, resume_at=run.resume_at,
                                                     **run.hooks)
        seconds = time.perf_counter() - start
        try:
            cli_text = panel.cli_table(log_dir)
            same = "yes" if cli_text == text else "NO"
        except Exception as error:  # noqa: BLE001 - the runner reports, it does not crash
            cli_text, same = "", f"CLI failed: {type(error).__name__}"
        losses = list(getattr(model, "losses", []))
        ok, why = judge(run, report, losses)
        # The CLI prints the same report, in at most 40 lines.
        if ok and same != "yes":
            ok, why = False, f"{why}, but the CLI's report differs"
        if ok and len(text.splitlines()) > 40:
            ok, why = False, f"{why}, but the report has {len(text.splitlines())} lines (at most 40)"
        last = _mean(losses[-max(1, len(losses) // 10):]) if losses else math.nan
        first = losses[0] if losses else math.nan
        print(f"{run.name:27s} {half:7s} s{seed} {seconds:5.1f}s loss {first:9.3g} -> {last:9.3g} | "
              f"{text.splitlines()[0][:110]} | cli same: {same} | {'PASS' if ok else 'FAIL'}: {why}", flush=True)
        if extra is not None:
            print(f"    {extra(log_dir)}", flush=True)
        notes = [line for line in text.splitlines() if line.startswith("note:")]
        if ok and notes:  # not a flag: shown, so that a wrong one would be seen
            print("\n".join("    " + line for line in notes), flush=True)
        if not ok:
            print("\n".join("    " + line for line in text.splitlines()), flush=True)
            if same == "NO":
                print("  the CLI's report:\n" + "\n".join("    " + line for line in cli_text.splitlines()), flush=True)
        return ok


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
