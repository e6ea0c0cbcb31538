"""The job-file reference and JSON Schema under docs/ are what the spec model generates."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from flexmarl import cli
from flexmarl.jobspec import JobSpec, load_job_spec
from flexmarl.jobspec_reference import MARKDOWN_PATH, REPO_ROOT, SCHEMA_PATH, json_schema, markdown

pytestmark = pytest.mark.timeout(60)


def test_the_checked_in_reference_is_fresh() -> None:
    hint = "stale: run `python -m flexmarl.jobspec_reference --write`"
    assert (REPO_ROOT / MARKDOWN_PATH).read_text() == markdown(), hint
    assert json.loads((REPO_ROOT / SCHEMA_PATH).read_text()) == json_schema(), hint


def test_every_field_is_documented_with_a_meaning() -> None:
    text = markdown()

    def walk(model: type, path: str) -> None:
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            assert field.description, f"{path}{name} has no docstring"
            assert f"| `{name}` |" in text, f"{path}{name} missing from the reference"
            for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    walk(candidate, f"{path}{name}.")

    walk(JobSpec, "")


@pytest.mark.parametrize("job", sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "examples").rglob("*.yaml")
                                        if "agents" in p.read_text()))
def test_example_jobs_use_only_fields_the_schema_names(job: str) -> None:
    load_job_spec(REPO_ROOT / job)  # valid
    schema = json_schema()
    raw = yaml.safe_load((REPO_ROOT / job).read_text())
    assert set(raw) <= set(schema["properties"]), set(raw) - set(schema["properties"])


def test_flexmarl_schema_prints_the_json_schema() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["schema"]) == 0
    assert json.loads(out.getvalue()) == json_schema()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["schema", "--markdown"]) == 0
    assert out.getvalue().rstrip("\n") == markdown().rstrip("\n")


def test_the_reference_paths_are_under_docs() -> None:
    assert Path(MARKDOWN_PATH).parent == Path(SCHEMA_PATH).parent == Path("docs")
