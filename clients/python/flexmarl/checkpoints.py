"""Self-describing checkpoints: the manifest written beside each retained version, and resume sources.

After a step commits, traind writes a small JSON manifest beside the version's training state
(:class:`CheckpointManifest`: job, agent, version, step, where the weights and the state are,
the job's spec and its digest, the model's shape signature). The manifests of a job are all a
resume needs: ``flexmarl resume`` (``SubmitJob.resume_from``) reads them, never etcd, so a job
whose cluster (and etcd) is gone continues on a new cluster from its checkpoints in stored or
on a path. Where they live:

* ``stored://checkpoints/<job>``: blobs ``checkpoints/<job>/<agent>/v<version>.json`` (traind's
  ``state_location: stored``);
* ``file:///<traind work dir>/checkpoints/<job>``: files ``<agent>/v<version>.json`` in that
  directory (``state_location: file``).

A manifest exists only while the policy (``checkpoint:``) retains both the version's weights and
its training state, so every manifest names a version that can be resumed from.

A LoRA agent's version is its adapter directory and its state the adapter's training state; its
``model_signature`` is the base's. A resume keeps the adapter's shape (rank, target modules)
and whether the agent is a LoRA agent at all (:func:`check_resumable`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec

MANIFEST_FORMAT = 1
CHECKPOINTS_DIR = "checkpoints"
#: The config.json fields that fix a model's parameter shapes (a resume across differing ones cannot load).
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim")
_MANIFEST_NAME = re.compile(r"v(\d+)\.json")


@dataclasses.dataclass(frozen=True)
class CheckpointManifest:
    """One committed, retained version of one agent: everything a resume needs to continue from it."""

    job_id: str
    agent: str
    version: int
    weights_uri: str
    state_uri: str
    spec_digest: str
    spec_json: str
    #: :data:`SHAPE_FIELDS` of the model's config (what a compatible model must match).
    model_signature: Mapping[str, Any]
    committed_unix_ms: int = 0

    @property
    def step(self) -> int:
        """The optimizer step that produced this version (the resumed job's next step is ``version``)."""
        return self.version - 1

    def to_json(self) -> str:
        """Stable JSON encoding (with a format number and the step, for people reading it)."""
        data = {"format": MANIFEST_FORMAT, "step": self.step, **dataclasses.asdict(self)}
        data["model_signature"] = dict(self.model_signature)
        return json.dumps(data, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "") -> CheckpointManifest:
        """Decodes :meth:`to_json`; raises InvalidArgument naming ``where`` when it is not a manifest."""
        try:
            data = json.loads(text)
            if data.pop("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            data.pop("step", None)
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in names})
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{where or 'checkpoint manifest'}: not a checkpoint manifest ({exc})") from None

    def spec(self) -> JobSpec:
        """The spec of the job that wrote the checkpoint."""
        from flexmarl.jobspec import parse_job_spec

        return parse_job_spec(json.loads(self.spec_json))


def manifest_blob_name(job_id: str, agent: str, version: int) -> str:
    """The stored blob of an agent version's manifest."""
    return f"{CHECKPOINTS_DIR}/{job_id}/{agent}/v{version}.json"


def manifest_path(work_dir: Path, job_id: str, agent: str, version: int) -> Path:
    """The file of an agent version's manifest under a traind work dir."""
    return work_dir / CHECKPOINTS_DIR / job_id / agent / f"v{version}.json"


def model_signature(config: Mapping[str, Any]) -> dict[str, Any]:
    """The shape-fixing fields of a Hugging Face model config (absent ones left out)."""
    return {name: config[name] for name in SHAPE_FIELDS if config.get(name) is not None}


def read_model_signature(model: str) -> dict[str, Any] | None:
    """:func:`model_signature` of a local checkpoint dir's config.json; None when it is not readable here."""
    path = Path(model) / "config.json"
    try:
        return model_signature(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    """Where a job's manifests are: stored (``kind == "stored"``, a blob prefix) or a local directory."""

    kind: str  # "stored" | "file"
    job_id: str
    #: The blob name prefix (stored) or the directory (file) holding ``<agent>/v<N>.json``.
    location: str

    @classmethod
    def parse(cls, text: str) -> ResumeSource:
        """``stored://checkpoints/<job>``, a bare ``<job>`` (the same), or ``file:///<dir>/checkpoints/<job>``.

        Raises:
            InvalidArgument: any other form.
        """
        from flexmarl.ids import validate_job_id

        if text.startswith("stored://"):
            path = text.removeprefix("stored://").strip("/")
            parts = path.split("/")
            if len(parts) != 2 or parts[0] != CHECKPOINTS_DIR:
                raise InvalidArgument(f"resume source {text!r}: want stored://{CHECKPOINTS_DIR}/<job>")
            validate_job_id(parts[1])
            return cls("stored", parts[1], f"{path}/")
        if text.startswith("file://"):
            directory = Path(urllib.parse.unquote(text.removeprefix("file://")))
            if not directory.is_absolute():
                raise InvalidArgument(f"resume source {text!r}: want file:///absolute/{CHECKPOINTS_DIR}/<job>")
            return cls("file", directory.name, str(directory))
        if "://" in text or "/" in text:
            raise InvalidArgument(f"resume source {text!r}: want a job id, stored://{CHECKPOINTS_DIR}/<job> "
                                  f"or file:///<traind work dir>/{CHECKPOINTS_DIR}/<job>")
        validate_job_id(text)
        return cls("stored", text, f"{CHECKPOINTS_DIR}/{text}/")

    def __str__(self) -> str:
        if self.kind == "stored":
            return f"stored://{self.location.rstrip('/')}"
        return "file://" + urllib.parse.quote(self.location)

    def read_files(self) -> list[tuple[str, str]]:
        """(where, text) of every manifest file of a ``file`` source, in path order."""
        root = Path(self.location)
        if not root.is_dir():
            raise InvalidArgument(f"resume source {self}: no such directory")
        return [(str(p), p.read_text()) for p in sorted(root.glob("*/v*.json")) if _MANIFEST_NAME.fullmatch(p.name)]


def resume_point(source: ResumeSource, manifests: Iterable[CheckpointManifest]) -> dict[str, CheckpointManifest]:
    """The checkpoint each agent resumes from: the newest version every agent retains, else each one's newest.

    One common version makes the resumed job's next step the one the original job would have
    trained (strict mode): its rollout batch ``V`` is generated from version ``V`` of every agent.
    An interrupted job whose agents stand at different versions, and kept no common one, resumes
    each agent from its newest (the batch then uses the newer weights of the agents ahead).

    Raises:
        InvalidArgument: no manifest, or manifests of another job or of differing specs.
    """
    by_agent: dict[str, dict[int, CheckpointManifest]] = {}
    digests = set()
    for m in manifests:
        if m.job_id != source.job_id:
            raise InvalidArgument(f"resume source {source}: holds a checkpoint of job {m.job_id!r}")
        by_agent.setdefault(m.agent, {})[m.version] = m
        digests.add(m.spec_digest)
    if not by_agent:
        raise InvalidArgument(f"resume source {source}: no retained checkpoint (manifest) of job {source.job_id!r}")
    if len(digests) > 1:
        raise InvalidArgument(f"resume source {source}: checkpoints of {len(digests)} different specs")
    common = set.intersection(*(set(versions) for versions in by_agent.values()))
    if common:
        version = max(common)
        return {agent: versions[version] for agent, versions in by_agent.items()}
    return {agent: versions[max(versions)] for agent, versions in by_agent.items()}


def check_resumable(source: ResumeSource, point: Mapping[str, CheckpointManifest], spec: JobSpec) -> None:
    """Rejects (one line) a spec the checkpoints cannot continue: other agents, other model shapes, no steps left.

    A model named differently from the checkpoint's is compared by its config.json, which must
    then be readable here (:func:`read_model_signature`).
    """
    first = next(iter(point.values()))
    source_spec = first.spec()
    if tuple(spec.agent_names) != tuple(source_spec.agent_names):
        raise InvalidArgument(f"resume source {source}: agents differ (checkpoint {list(source_spec.agent_names)}, "
                              f"spec {list(spec.agent_names)})")
    for agent in spec.agents:
        manifest = point[agent.name]
        old_model = source_spec.agent(agent.name).model
        old_adapter, new_adapter = _adapter_shape(source_spec, agent.name), _adapter_shape(spec, agent.name)
        if old_adapter != new_adapter:
            raise InvalidArgument(f"resume source {source}: agent {agent.name}: its LoRA adapter differs from the "
                                  f"checkpoint's (checkpoint {old_adapter or 'a full model'}, spec "
                                  f"{new_adapter or 'a full model'}): the training state cannot load")
        if agent.model == old_model:
            continue
        signature = read_model_signature(agent.model)
        if signature is None:
            raise InvalidArgument(f"resume source {source}: agent {agent.name}: model {agent.model!r} is not the "
                                  f"checkpoint's ({old_model!r}) and its config.json is not readable here to compare")
        if signature != dict(manifest.model_signature):
            diff = sorted(k for k in set(signature) | set(manifest.model_signature)
                          if signature.get(k) != manifest.model_signature.get(k))
            raise InvalidArgument(f"resume source {source}: agent {agent.name}: model shapes differ from the "
                                  f"checkpoint's ({', '.join(diff)})")
    lowest = min(m.version for m in point.values())
    if lowest >= spec.total_steps:
        raise InvalidArgument(f"resume source {source}: every agent is at version >= {lowest}, total_steps is "
                              f"{spec.total_steps}: nothing left to train (raise total_steps)")


def _adapter_shape(spec: JobSpec, agent: str) -> str:
    """What fixes a LoRA agent's adapter tensors (rank and target modules); "" for a full-model agent."""
    adapter = spec.agent(agent).lora
    if adapter is None:
        return ""
    return f"rank {adapter.rank} on {sorted(adapter.target_modules)}"


def parse_manifests(files: Sequence[tuple[str, str]]) -> list[CheckpointManifest]:
    """Decodes (where, text) pairs."""
    return [CheckpointManifest.from_json(text, where) for where, text in files]
