"""Every ```python block of README.md and docs/*.md runs verbatim.

Each block runs on its own, in a fresh namespace and a temporary working directory, after a
prelude that defines the names the snippets assume and do not make themselves: ``model`` (a
small LightningModule with an ``encoder``), ``train_loader``, ``loader``, ``batches``, ``x``,
``y``, ``optimizer`` and ``loss_fn``. A block that is not meant to run (a signature, pseudo-code)
is written as ```text, or preceded on the line before its fence by ``<!-- not run: reason -->``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->\s*$")

PRELUDE = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import pytorch_lightning as pl

torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 8)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loss_fn(output, target=None):
    return output.pow(2).mean() if target is None else nn.functional.mse_loss(output, target)


model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4, 4), torch.randn(4, 1)
batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(2)]
loader = [torch.randn(4, 4) for _ in range(3)]
train_loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
'''


def snippets() -> list[tuple[str, int, str, str | None]]:
    """``(document, line, code, reason not run)`` for every ```python block."""
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if match.group(1) != "python":
                continue
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rpartition("\n")[2]
            skipped = _NOT_RUN.search(before)
            found.append((path.relative_to(ROOT).as_posix(), line, match.group(2), skipped and skipped.group(1)))
    return found


SNIPPETS = snippets()


def test_the_documents_have_snippets():
    documents = {document for document, *_ in SNIPPETS}
    assert {"README.md", "docs/quickstart.md", "docs/plain-loops.md", "docs/offload.md"} <= documents


@pytest.mark.parametrize(("document", "line", "code", "not_run"), SNIPPETS, ids=[f"{d}:{n}" for d, n, *_ in SNIPPETS])
def test_snippet_runs_verbatim(document, line, code, not_run, tmp_path, monkeypatch):
    if not_run:
        pytest.skip(f"{document}:{line} is marked not run: {not_run}")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__snippet__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)  # noqa: S102
    exec(compile(code, f"{document}:{line}", "exec"), namespace)  # noqa: S102 - the documented code, verbatim


def test_a_marked_block_is_recognised(tmp_path, monkeypatch):
    marked = "text\n\n<!-- not run: a signature -->\n```python\nf(...)\n```\n\n```python\nprint(1)\n```\n"
    (tmp_path / "README.md").write_text(marked)
    monkeypatch.setattr(sys.modules[__name__], "DOCUMENTS", [tmp_path / "README.md"])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [(line, reason) for _, line, _, reason in snippets()] == [(4, "a signature"), (8, None)]


def readme_table(heading: str) -> dict[str, list[str]]:
    """The rows of the first table under ``## heading`` of README.md, by the first cell's name."""
    section = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip(" `"): [c.strip() for c in cells[1:]] for cells in rows}


def test_the_readme_is_short_and_its_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert first_block[1] == ci[-1] == 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'


def test_the_readme_table_gives_every_argument_of_gradhooks_with_its_default():
    import inspect

    from lightning_gradhooks import GradHooks

    table = readme_table("Arguments")
    parameters = {name: p.default for name, p in inspect.signature(GradHooks.__init__).parameters.items() if name != "self"}
    assert list(table) == list(parameters)  # every argument, in the constructor's order
    for name, default in parameters.items():
        cell = table[name][0]
        assert cell.startswith(f"`{default!r}`"), (name, cell)
        assert len(table[name][1]) > 20, name  # says what it does


def test_the_reference_gives_the_signature_of_gradient_monitor_as_it_is():
    import inspect

    from lightning_gradhooks import GradientMonitor

    parts, marked = [], False
    for parameter in inspect.signature(GradientMonitor).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not marked:
            parts.append("*")
            marked = True
        parts.append(parameter.name if parameter.default is parameter.empty else f"{parameter.name}={parameter.default!r}")
    assert f"`GradientMonitor({', '.join(parts)})`" in (ROOT / "docs" / "reference.md").read_text()


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation dropped, spaces to ``-``."""
    headings = re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_and_anchor_of_the_documents_resolves():
    broken = []
    for path in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", path.read_text())):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []
