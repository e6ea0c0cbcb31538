"""The SDK and users' code depend on no daemon: read from every module's imports, function-local ones too.

A Flower app imports ``flwr``, never the SuperLink; an environment imports ``flexmarl``, never
``rolloutd``. The check parses each module with ``ast`` rather than importing it, so an import
inside a function (one that only runs at submit time, say) counts as much as one at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SDK = REPO_ROOT / "clients" / "python" / "flexmarl"
EXAMPLES = REPO_ROOT / "examples"
DAEMON_PACKAGES = frozenset({"orchestratord", "rolloutd", "traind", "stored", "benchmarks"})
IMPORT_FUNCTIONS = frozenset({"import_module", "__import__"})


def imported_modules(source: str) -> set[str]:
    """Every absolute module name ``source`` imports anywhere, ``importlib.import_module("...")`` literals too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in IMPORT_FUNCTIONS and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def daemon_imports(package: Path) -> dict[str, list[str]]:
    """Module path -> the daemon modules it imports, for every module under ``package`` (generated protos aside)."""
    offenders: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        daemons = sorted(m for m in imported_modules(path.read_text(encoding="utf-8"))
                         if m.partition(".")[0] in DAEMON_PACKAGES)
        if daemons:
            offenders[str(path.relative_to(REPO_ROOT))] = daemons
    return offenders


def test_the_check_sees_imports_at_the_top_inside_functions_and_by_name() -> None:
    source = (
        "import importlib\n"
        "from flexmarl.errors import InvalidArgument\n"
        "import traind.sft as sft\n"
        "def check():\n"
        "    from rolloutd.runner import RolloutRunner\n"
        "    return importlib.import_module('stored.app')\n"
        "from . import sibling\n"
    )
    assert {m for m in imported_modules(source) if m.partition(".")[0] in DAEMON_PACKAGES} == {
        "traind.sft", "rolloutd.runner", "stored.app"}


def test_no_sdk_module_imports_a_daemon_package() -> None:
    assert daemon_imports(SDK) == {}


def test_no_example_imports_a_daemon_package() -> None:
    assert daemon_imports(EXAMPLES) == {}


def test_the_episode_api_comes_from_flexmarl_and_import_flexmarl_stays_light() -> None:
    code = (
        "import sys, flexmarl\n"
        "assert 'flexmarl.episode' not in sys.modules and 'grpc' not in sys.modules, 'import flexmarl pulled in more'\n"
        "from flexmarl import Environment, EpisodeContext, Task, TurnRecord, task_rng\n"
        "import flexmarl.episode as episode\n"
        "assert Environment is episode.Environment and Task is episode.Task\n"
        "assert sorted(flexmarl.__all__) == flexmarl.__all__\n"
        "assert all(getattr(flexmarl, name) is getattr(episode, name) for name in flexmarl.__all__)\n"
        "try:\n"
        "    flexmarl.Nonexistent\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('flexmarl.Nonexistent resolved')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
