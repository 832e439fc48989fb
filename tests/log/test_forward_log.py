"""The forward statistics through a real Trainer: one ``∇8 forward`` section in TensorBoard, the
scalars in a CSV table, and the summary read back from the event files as the ``report`` command
reads it; the health report does not judge them (yet)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import make_trainer, read_events
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradhooks import GradHooks
from lightning_gradhooks.__main__ import read_folder
from lightning_gradhooks.summary.records import Kind


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x = self.embed(batch[0])
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return F.mse_loss(self.head(x).squeeze(-1), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 6, 8, generator=g), torch.randn(32, 6, generator=g)), batch_size=8)


def test_a_trainer_charts_the_forward_statistics_in_one_section_and_the_summary_reads_back(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [GradHooks(activations=True, attention_logits=True)], max_steps=3)
    trainer.fit(TinyLM(), _data())
    folder = trainer.logger.log_dir
    tags = read_events(folder).Tags()["scalars"]
    forward = sorted(t for t in tags if t.startswith("∇8 forward/"))
    assert forward == ["∇8 forward/attention_logit_max/attn", "∇8 forward/output_rms/attn/0",
                       "∇8 forward/output_rms/embed", "∇8 forward/output_rms/head"]
    assert not any(t.startswith("∇") and not t.startswith(("∇1", "∇2", "∇3", "∇4", "∇5", "∇8")) for t in tags)
    run = read_folder(Path(folder))
    assert sorted(run.steps) == [0, 1, 2]
    for summary in run.steps.values():
        logits = {k.name: s for k, s in summary.items() if k.kind == Kind.ATTENTION_LOGIT}
        outputs = {k.name: s for k, s in summary.items() if k.kind == Kind.OUTPUT}
        assert set(logits) == {"attn"} and logits["attn"]["max"] > 0
        assert set(outputs) == {"embed", "attn/0", "head"} and all(s["rms"] > 0 and s["outlier"] >= 1 for s in outputs.values())
    report = trainer.callbacks[0].gradient_log.report
    assert report.steps == 3 and "attention_logit" not in str(report) and " output " not in str(report)  # not judged


def test_a_csv_logger_gets_the_forward_scalars(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [GradHooks(activations=True, attention_logits=True)], max_steps=2,
                           logger=CSVLogger(str(tmp_path), name="csv"))
    trainer.fit(TinyLM(), _data())
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert "forward/attention_logit_max/attn" in columns and "forward/output_rms/embed" in columns
