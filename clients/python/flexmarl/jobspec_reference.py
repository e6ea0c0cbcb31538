"""The job-file reference, generated from the spec model (never written by hand twice).

``docs/jobspec.md`` (every field: type, default, constraints, what it does) and
``docs/jobspec.schema.json`` (JSON Schema for editors) are this module's output;
``tests/cli/test_jobspec_reference.py`` fails when they are stale. Regenerate with::

    python -m flexmarl.jobspec_reference --write

``flexmarl schema`` prints the JSON Schema (``--markdown``: the reference).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from flexmarl.jobspec import CROSS_FIELD_RULES, JobSpec

REPO_ROOT = Path(__file__).resolve().parents[3]
MARKDOWN_PATH = Path("docs") / "jobspec.md"
SCHEMA_PATH = Path("docs") / "jobspec.schema.json"
EXAMPLE_PATH = Path("examples") / "signaling" / "job.yaml"
SCHEMA_ID = "https://github.com/flexmarl/flexmarl/docs/jobspec.schema.json"


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a job file (draft 2020-12, as pydantic writes it)."""
    schema = JobSpec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def _type_of(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return "mapping (its section below)"
    if "enum" in prop:
        return " | ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    for union in ("anyOf", "oneOf"):
        if union in prop:
            return " or ".join(_type_of(p, defs) for p in prop[union])
    kind = str(prop.get("type", "any"))
    if kind == "array":
        return f"list of {_type_of(prop.get('items', {}), defs)}"
    if kind == "object":
        return "mapping"
    return {"integer": "int", "number": "float", "string": "string", "boolean": "bool", "null": "null"}.get(kind, kind)


def _constraints(prop: dict[str, Any]) -> str:
    parts = []
    for key, text in (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
                      ("exclusiveMaximum", "< {}"), ("minLength", "length >= {}"), ("maxLength", "length <= {}"),
                      ("minItems", "items >= {}"), ("maxItems", "items <= {}"), ("pattern", "matches `{}`")):
        if key in prop:
            parts.append(text.format(prop[key]))
    items = prop.get("items", {})
    for key, text in (("minimum", "each >= {}"), ("exclusiveMinimum", "each > {}"), ("maximum", "each <= {}"),
                      ("exclusiveMaximum", "each < {}")):
        if isinstance(items, dict) and key in items:
            parts.append(text.format(items[key]))
    for key, text in (("minLength", "each of length >= {}"), ("pattern", "each matches `{}`")):
        if isinstance(items, dict) and key in items:
            parts.append(text.format(items[key]))
    if not parts:  # a union (`int | None`, a file or a list of files): each branch's own, where it has any
        branches = [_constraints(branch) for branch in (*prop.get("anyOf", ()), *prop.get("oneOf", ()))]
        return "; ".join(part for part in branches if part)
    return ", ".join(parts)


def _default_of(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        return "(all defaults)"
    if isinstance(value, list) and any(isinstance(item, BaseModel) for item in value):
        return "(docs/workflows.md)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _models(model: type[BaseModel], path: str, out: list[tuple[str, type[BaseModel]]]) -> None:
    out.append((path, model))
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        for candidate in (annotation, *args):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                suffix = "[]" if args and candidate in args and getattr(annotation, "__origin__", None) is list else ""
                _models(candidate, f"{path}.{name}{suffix}" if path else f"{name}{suffix}", out)


def _section(title: str, model: type[BaseModel], model_schema: dict[str, Any], defs: dict[str, Any],
             level: str = "##") -> list[str]:
    """One model's heading, docstring and table of fields."""
    doc = inspect.cleandoc(model.__doc__ or "")  # a docstring's later paragraphs are no code blocks
    lines = [f"{level} {title}", ""]
    if doc:
        lines += [doc, ""]
    props = model_schema.get("properties", {})
    lines += ["| field | type | default | constraints | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        prop = props.get(name, {})
        lines.append(f"| `{name}` | {_cell(_type_of(prop, defs))} | {_cell(_default_of(model, name))} | "
                     f"{_cell(_constraints(prop))} | {_cell(field.description or '')} |")
    return [*lines, ""]


def _workflow_sections() -> list[str]:
    """The ready-made workflows' ``environment.config``, from their config models (flexmarl/workflows/)."""
    from flexmarl.workflows import Chain, Debate, Mixture, SolverVerifier
    from flexmarl.workflows.base import RewardSpec, WorkflowConfig
    from flexmarl.workflows.chain import ChainStep

    lines = ["## Ready-made workflows: `environment.config`", "",
             "With `environment.entrypoint: flexmarl.workflows:<Workflow>` the environment is configured by",
             "`environment.config` alone (docs/workflows.md: turn orders, prompts, rewards per role). The keys",
             "every workflow takes are in the first table; each workflow's own keys follow.", ""]
    common = set(WorkflowConfig.model_fields)
    shared = WorkflowConfig.model_json_schema()
    lines += _section("Every workflow", WorkflowConfig, shared, shared.get("$defs", {}), "###")
    for workflow in (SolverVerifier, Debate, Chain, Mixture):
        config = workflow.Config
        schema = config.model_json_schema()
        title = f"`flexmarl.workflows:{workflow.__name__}`"
        lines += [line for line in _section(title, config, schema, schema.get("$defs", {}), "###")
                  if not any(line.startswith(f"| `{name}` |") for name in common)]
    for model in (RewardSpec, ChainStep):
        schema = model.model_json_schema()
        lines += _section(f"`{model.__name__}`", model, schema, schema.get("$defs", {}), "###")
    return lines


def markdown() -> str:
    """docs/jobspec.md."""
    schema = json_schema()
    defs = schema.get("$defs", {})
    sections: list[tuple[str, type[BaseModel]]] = []
    _models(JobSpec, "", sections)
    lines = [
        "# Job file reference",
        "",
        "<!-- Generated by `python -m flexmarl.jobspec_reference --write` from clients/python/flexmarl/jobspec.py;",
        "     tests/cli/test_jobspec_reference.py fails when this file is stale. Do not edit by hand. -->",
        "",
        "A job file is YAML or JSON. Unknown keys are rejected everywhere (a typo never falls back to a",
        "default), and strings are never coerced to numbers. `flexmarl submit` (and `Client.submit`)",
        "validates it before sending and names the field of every problem, e.g.",
        "`batch.micro_batch_size: must be a multiple of batch.group_size (4), got 6`. Editors can",
        "validate against [`jobspec.schema.json`](jobspec.schema.json) (`flexmarl schema` prints it).",
        "",
        "## Rules across fields",
        "",
        *(f"- {rule}" for rule in CROSS_FIELD_RULES),
        "",
    ]
    for path, model in sections:
        model_schema = defs.get(model.__name__, schema) if path else schema
        lines += _section(f"`{path}`" if path else "Top level", model, model_schema, defs)
    lines += _workflow_sections()
    example = REPO_ROOT / EXAMPLE_PATH
    if example.exists():  # a source checkout (the installed package has no examples/)
        lines += [f"## Example (`{EXAMPLE_PATH}`)", "", "```yaml", example.read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate docs/jobspec.md and docs/jobspec.schema.json; else print the schema."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--write", action="store_true", help="regenerate the two files under docs/")
    parser.add_argument("--markdown", action="store_true", help="print the Markdown reference instead")
    args = parser.parse_args(argv)
    if args.write:
        (REPO_ROOT / MARKDOWN_PATH).write_text(markdown())
        (REPO_ROOT / SCHEMA_PATH).write_text(json.dumps(json_schema(), indent=2) + "\n")
        print(f"wrote {MARKDOWN_PATH} and {SCHEMA_PATH}")
        return 0
    print(markdown() if args.markdown else json.dumps(json_schema(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
