"""traind's modules import each other as a DAG; locations is a leaf and batch preparation needs no DeepSpeed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "traind"


def _traind_imports(path: Path) -> set[str]:
    """Every ``traind.*`` module ``path`` imports anywhere (function-local and TYPE_CHECKING imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("traind."))
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if node.module == "traind":
                found.update(f"traind.{alias.name}" for alias in node.names)
            elif node.module.startswith("traind."):
                found.add(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    return {f"traind.{p.stem}": _traind_imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def test_traind_imports_form_a_dag() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for imported in sorted(graph.get(module, set())):
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_locations_is_a_leaf_and_swap_sits_above_model() -> None:
    graph = _graph()
    assert graph["traind.locations"] == set()
    assert "traind.swap" not in graph["traind.model"]
    assert "traind.model" not in graph["traind.batches"]


def test_batch_preparation_and_locations_import_without_deepspeed() -> None:
    code = (
        "import sys, traind.batches, traind.locations, traind.pacing\n"
        "heavy = sorted(m for m in ('deepspeed', 'transformers', 'traind.model', 'traind.swap') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
