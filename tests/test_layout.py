"""The house's rules, checked on the package's source: files small enough to read in one sitting,
no import cycle (hidden behind ``TYPE_CHECKING`` or not), no private name imported from another
subpackage, and a host side (the summary layer, the health report) that imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gradhooks"
LIMITS = {"module": 600, "class": 350, "function": 60}


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found[name] = (path, ast.parse(path.read_text()))
    return found


MODULES = _modules()


def test_no_module_class_or_function_is_over_its_limit():
    over = []
    for name, (path, tree) in MODULES.items():
        lines = path.read_text().count("\n")
        if lines > LIMITS["module"]:
            over.append(f"module {name}: {lines} lines")
        for node in ast.walk(tree):
            kind = "class" if isinstance(node, ast.ClassDef) else "function" if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
                over.append(f"{kind} {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not over, f"over the limits {LIMITS}: {over}"


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import of the package's own modules, anywhere in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_gradhooks"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("lightning_gradhooks")]
    return found


def test_no_import_cycle():
    edges: dict[str, set[str]] = {}
    for name, (_, tree) in MODULES.items():
        deps = set()
        for module, names in _imports(name, tree):
            deps |= {f"{module}.{n}" if f"{module}.{n}" in MODULES else module for n in names} or {module}
        edges[name] = {d for d in deps if d in MODULES and d != name and not name.startswith(d + ".")}

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for name in MODULES if (c := cycle_from(name)) is not None]
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_no_private_name_is_imported_from_another_subpackage():
    found = []
    for name, (_, tree) in MODULES.items():
        here = name.split(".")[1] if name.count(".") >= 1 else ""
        for module, names in _imports(name, tree):
            there = module.split(".")[1] if module.count(".") >= 1 else ""
            private = any(part.startswith("_") and part != "__main__" for part in module.split(".")[2:]) or any(
                n.startswith("_") for n in names)
            if there != here and private:
                found.append(f"{name} imports {module} {names}")
    assert not found, found


def test_one_name_one_class():
    """The two GradHooks, one per Lightning namespace, are the one class name allowed twice."""
    seen: dict[str, list[str]] = {}
    for name, (_, tree) in MODULES.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name.lstrip("_"), []).append(name)
    assert {n: where for n, where in seen.items() if len(where) > 1 and n != "GradHooks"} == {}


@pytest.mark.parametrize("module", ["lightning_gradhooks.summary.events", "lightning_gradhooks.summary.noise",
                                    "lightning_gradhooks.health", "lightning_gradhooks"])
def test_the_host_side_imports_no_torch_lightning_or_tensorboard(module):
    probe = (f"import sys, {module}\n"
             "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'tensorboard') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
