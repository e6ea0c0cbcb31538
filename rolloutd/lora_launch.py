"""What rolloutd's engines need for a job's LoRA agents: launch flags and the router's adapter map.

A replica that serves a base's LoRA agents starts with SGLang's LoRA flags
(sglang/srt/arg_groups/fields/lora.py; :class:`~rolloutd.engines.lora.LoraSettings`):
``--enable-lora``, ``--max-lora-rank`` the largest rank of the base's agents,
``--lora-target-modules`` the union of their targets (SGLang's names, ``all`` when one of them
is not in SGLang's list, as for a module name of a custom architecture), ``--max-loras-per-batch``
and ``--max-loaded-loras`` from rolloutd's config. Flags are fixed when a replica starts, so the
first job's LoRA agents decide them (as its ``rollout.balancing`` decides the router's policy).
"""

from __future__ import annotations

from collections.abc import Iterable

from flexmarl.jobspec import AgentSpec, JobSpec, LoraSpec
from rolloutd.engines.lora import LORA_TARGET_ALL_MODULES, SUPPORTED_LORA_TARGET_MODULES, LoraSettings


def _lora(agent: AgentSpec) -> LoraSpec | None:
    # getattr: tests/rolloutd/test_launcher.py hands _ensure_engines a stand-in spec with only `model`.
    lora: LoraSpec | None = getattr(agent, "lora", None)
    return lora


def lora_bases(spec: JobSpec) -> dict[str, str]:
    """The job's LoRA agents, each with its base model."""
    return {agent.name: agent.model for agent in spec.agents if _lora(agent) is not None}


def launch_model(spec: JobSpec) -> str:
    """The model the replicas start with: the first LoRA agent's base (its pool needs no load), else agent 0's."""
    return next((a.model for a in spec.agents if _lora(a) is not None), spec.agents[0].model)


def target_modules(names: Iterable[str]) -> tuple[str, ...]:
    """PEFT target names as ``--lora-target-modules`` choices (the last name component, as SGLang normalises)."""
    short = sorted({name.split(".")[-1] for name in names})
    if any(name not in SUPPORTED_LORA_TARGET_MODULES for name in short):
        return (LORA_TARGET_ALL_MODULES,)
    return tuple(short)


def engine_lora_settings(spec: JobSpec, max_loras_per_batch: int, max_loaded_loras: int | None) -> LoraSettings:
    """The LoRA flags of replicas serving the job's first LoRA base (disabled: the job has none)."""
    base = launch_model(spec)
    adapters = [lora for a in spec.agents if (lora := _lora(a)) is not None and a.model == base]
    if not adapters:
        return LoraSettings()
    return LoraSettings(
        enable_lora=True,
        max_lora_rank=max(lora.rank for lora in adapters),
        lora_target_modules=target_modules(m for lora in adapters for m in lora.target_modules),
        max_loras_per_batch=max_loras_per_batch,
        max_loaded_loras=max_loaded_loras,
    )
