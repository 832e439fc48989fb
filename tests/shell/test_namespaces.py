"""GradHooks works with both Lightning namespaces: pytorch_lightning and lightning.pytorch."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import read_events

L = pytest.importorskip("lightning.pytorch")


class LitMLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)), batch_size=8)


def lightning_trainer(tmp_path, callback):  # noqa: ANN001, ANN201
    from lightning.pytorch.loggers import TensorBoardLogger

    return L.Trainer(
        max_steps=4, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="logs"), callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
    )


def test_lightning_pytorch_trainer_logs_and_cleans_up(tmp_path):
    from lightning_gradhooks.lightning import GradHooks

    model = LitMLP()
    (tmp_path / "off").mkdir()
    trainer = lightning_trainer(tmp_path, GradHooks(offload_threshold_bytes=256, offload_dir=str(tmp_path / "off")))
    trainer.fit(model, data())
    events = read_events(trainer.logger.log_dir)
    assert [e.step for e in events.Scalars("∇2 grad_output_norm/net.2")] == [0, 2]
    assert "∇6 histograms/param_grad/net.0.weight" in events.Tags()["histograms"]
    assert all(not m._backward_hooks for m in model.modules())
    assert list((tmp_path / "off").iterdir()) == []


def test_each_namespace_has_its_own_class():
    import pytorch_lightning

    from lightning_gradhooks import GradHooks as PLGradHooks
    from lightning_gradhooks.lightning import GradHooks as LGradHooks

    assert isinstance(PLGradHooks(), pytorch_lightning.Callback) and not isinstance(PLGradHooks(), L.Callback)
    assert isinstance(LGradHooks(), L.Callback) and not isinstance(LGradHooks(), pytorch_lightning.Callback)
    with pytest.raises(ValueError, match="`every_n_steps` expected a positive int or None"):
        LGradHooks(every_n_steps=-1)
