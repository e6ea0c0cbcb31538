"""No hand-written Python file is longer than one reads in a sitting (the house style: split it by responsibility).

Generated code (the protos' modules under ``clients/python/flexmarl/v1``) is exempt; so is what
is not the project's (virtual environments, caches, build output, benchmark results).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 1000
GENERATED = (REPO_ROOT / "clients" / "python" / "flexmarl" / "v1",)
NOT_THE_PROJECTS = frozenset({"build", "dist", "runs", "results", "__pycache__", "node_modules"})


def hand_written_python_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` but generated code and what is not the project's."""
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory)
        subdirectories[:] = sorted(
            name for name in subdirectories
            if not name.startswith(".") and name not in NOT_THE_PROJECTS and not name.endswith(".egg-info")
            and here / name not in GENERATED
        )
        found += [here / name for name in sorted(files) if name.endswith(".py")]
    return found


def test_no_hand_written_python_file_exceeds_a_thousand_lines() -> None:
    files = hand_written_python_files(REPO_ROOT)
    assert len(files) > 100 and REPO_ROOT / "rolloutd" / "engines" / "embedded" / "engine.py" in files
    too_long = {
        str(path.relative_to(REPO_ROOT)): lines
        for path in files
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"over {MAX_LINES} lines (split by responsibility): {too_long}"


def test_the_walk_leaves_out_generated_code() -> None:
    files = hand_written_python_files(REPO_ROOT)
    assert not [path for path in files if GENERATED[0] in path.parents]
    assert any(GENERATED[0].glob("*_pb2.py"))  # it exists, so leaving it out means something
