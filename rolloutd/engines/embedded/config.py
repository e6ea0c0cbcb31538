"""Settings of one embedded engine replica (``python -m rolloutd.engines.embedded``'s flags).

Flag names follow SGLang's server arguments (sglang/srt/server_args.py) where SGLang has the
setting: ``--enable-deterministic-inference``, ``--random-seed`` (here ``--seed``), the LoRA
flags; see :func:`rolloutd.engines.embedded.cli.parse_args`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolloutd.engines.lora import LoraSettings


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of one embedded engine replica."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    num_threads: int = 1
    max_batch_size: int = 32
    batch_window_s: float = 0.002
    return_original_logprob: bool = False
    # SGLang's --enable-deterministic-inference: seeded, position-hashed sampling (sampling_seed
    # honoured, 42 without one) and each finished sequence's logprobs recomputed in a forward pass
    # of its own (prompt + output, no padding), so samples and logprobs depend on the weights,
    # tokens and seed only, not on which requests shared the batch. What makes sync and async
    # runs of a strict job produce the same experiences. Off: seeds are ignored, as in SGLang.
    enable_deterministic_inference: bool = False
    weight_version: str = "default"
    seed: int | None = None  # seeds the engine's sampling generator at start (SGLang --random-seed)
    ready_file: str = ""
    # Device profile file (flexmarl.devicemodel): generation takes the modelled time of that
    # accelerator; "" = real time only. The command line falls back to FLEXMARL_MODELLED_DEVICE
    # (read once, in _parse_args), so the engine itself never reads the environment.
    modelled_device: str = ""
    # SGLang's LoRA flags (--enable-lora, --max-lora-rank, --lora-target-modules, --lora-paths,
    # --max-loras-per-batch, --max-loaded-loras): adapters over the served model, see lora.py.
    lora: LoraSettings = field(default_factory=LoraSettings)
