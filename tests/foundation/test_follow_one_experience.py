"""docs/architecture.md's "Follow one experience" stays true: every `file.py::Name` it names imports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"^## Follow one experience\n(.*?)^## ", re.S | re.M)
REFERENCE = re.compile(r"`([\w/]+\.py)::([\w.]+)`")


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    if parts[:2] == ("clients", "python"):
        parts = parts[2:]
    return ".".join(parts)


def _references() -> list[tuple[str, str]]:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = SECTION.search(text)
    assert section is not None, "docs/architecture.md has no 'Follow one experience' section"
    found = [(path, name) for path, name in REFERENCE.findall(section.group(1)) if path != "file.py"]
    assert len(found) >= 30, found  # the path names every hop
    return found


@pytest.mark.parametrize(("path", "name"), _references())
def test_every_hop_names_a_real_file_and_function(path: str, name: str) -> None:
    assert (REPO_ROOT / path).is_file(), f"{path} does not exist"
    target: object = importlib.import_module(_module_name(path))
    for part in name.split("."):
        assert hasattr(target, part), f"{path} has no {name}"
        target = getattr(target, part)
