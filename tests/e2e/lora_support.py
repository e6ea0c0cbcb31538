"""The mixed LoRA job and its PEFT reference, shared by tests/e2e/test_lora_e2e.py and test_vllm_e2e.py.

Two agents train LoRA adapters of one base and a third trains the full model of the same
checkpoint (examples/signaling_lora's ``PairedSignaling`` with an observer, dense reward);
:func:`peft_logprobs` is what PEFT computes for a stored experience under base + adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flexmarl.cli import materialize_models
from flexmarl.experience import ExperienceRecord

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
MIXED_STEPS = 2
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1, "stop_token_ids": []}
OPTIMIZER = {"name": "adamw", "lr": 5.0e-2, "betas": [0.9, 0.999], "eps": 1.0e-8, "weight_decay": 0.0, "grad_clip": 1.0}


def mixed_spec(models_dir: Path, base: str, name: str) -> dict[str, Any]:
    """sender0/receiver0 as adapters of ``base``, observer a full model of the same checkpoint; dense reward."""
    agents = [{"name": agent, "model": base, "lora": LORA, "sampling": SAMPLING, "optimizer": OPTIMIZER}
              for agent in ("sender0", "receiver0")]
    agents.append({"name": "observer", "model": base, "sampling": SAMPLING, "optimizer": OPTIMIZER})
    raw: dict[str, Any] = {
        "name": name, "seed": 0,
        "environment": {"entrypoint": "examples.signaling_lora.env:PairedSignaling",
                        "config": {"num_objects": 4, "pairs": 1, "observer": True, "dense": True}},
        "agents": agents,
        "algorithm": {"name": "grpo"},
        "batch": {"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8},
        "total_steps": MIXED_STEPS,
        "pipeline": {"mode": "async", "max_staleness": 0},
        "leases": {"rollout_timeout_s": 60, "train_timeout_s": 120},
    }
    return materialize_models(raw, models_dir)


def peft_logprobs(base: Path, adapter: Path | None, record: ExperienceRecord) -> list[float]:
    """Logprobs of the record's response tokens under base + adapter (the base alone: None), by PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return [float(logprobs[i, token]) for i, token in enumerate(response)]
