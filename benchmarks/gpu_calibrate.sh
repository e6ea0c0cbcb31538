#!/usr/bin/env bash
# Calibrate flexmarl.devicemodel on a lent GPU machine, with the project's own code (< 8 minutes).
#
#   bash benchmarks/gpu_calibrate.sh [OUT_JSON]      # default benchmarks/results/gpu_calibration.json
#
# Measures, on one CUDA device, with a small random-init Qwen2 model built by flexmarl.tiny
# (default ~150 M parameters; no download):
#   1. prefill and decode throughput: the model served by the embedded engine's own load_model
#      (rolloutd.engines.embedded), moved to CUDA in bf16, prefill of a batch and batched KV-cache
#      decode (the embedded engine's HTTP server itself runs on CPU only; see docs/benchmarks-scale.md);
#      plus, for reference, the embedded engine's CPU generation rate through its scheduler;
#   2. training throughput: traind's AgentTrainer (DeepSpeed on the CUDA accelerator, NCCL
#      process group of one rank) accumulating GRPO micro-batches and taking optimizer steps.
# and writes a device profile in the format devicemodel.load_profile reads: "preset" (h100 or
# h200, from the device name) plus measured prefill_mfu, hbm_efficiency and train_mfu, with
# the raw measurements in OUT_JSON's sibling <stem>.measured.json (load_profile rejects unknown
# fields). Efficiencies of a ~150 M model are lower bounds for a 14 B one (small matmuls use the
# GPU less well); CALIBRATE_HIDDEN / CALIBRATE_LAYERS set the size.
#
# Offline (the lent machine reaches no network): carry a wheelhouse and the etcd binary.
#   On the development machine:
#     pip wheel --no-deps -w wheelhouse deepspeed==0.19.8      # pure-Python sdist -> py3-none-any wheel
#     pip download --no-deps -d wheelhouse <any other missing package>
#     cp "$(command -v etcd)" wheelhouse/                      # only the daemons need it, not this script
#   Carry wheelhouse/ with the working tree (the run tool's `carry`), then this script installs
#   from it with --no-index when FLEXMARL_WHEELHOUSE (default ./wheelhouse) exists.
# DeepSpeed compiles no extension here (torch AdamW is the default optimizer_impl).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results/gpu_calibration.json}"
WHEELHOUSE="${FLEXMARL_WHEELHOUSE:-$ROOT/wheelhouse}"
export PYTHONPATH="$ROOT:$ROOT/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/flexmarl/torch_extensions}"
export CALIBRATE_HIDDEN="${CALIBRATE_HIDDEN:-1024}" CALIBRATE_LAYERS="${CALIBRATE_LAYERS:-12}"

if ! python -c "import deepspeed" 2>/dev/null; then
  if [[ -d "$WHEELHOUSE" ]]; then
    python -m pip install --no-index --find-links "$WHEELHOUSE" deepspeed
  else
    echo "deepspeed missing and no wheelhouse at $WHEELHOUSE (see the header of this script)" >&2
    exit 2
  fi
fi
if [[ -d "$WHEELHOUSE" && -x "$WHEELHOUSE/etcd" ]]; then
  export PATH="$WHEELHOUSE:$PATH"
fi

mkdir -p "$(dirname "$OUT")"
timeout 450 python - "$OUT" <<'PY'
import json, math, os, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch

from flexmarl import devicemodel
from flexmarl.experience import ExperienceRecord, experience_id, group_id
from flexmarl.tiny import build_tiny_checkpoint

out = Path(sys.argv[1])
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
name = torch.cuda.get_device_name(0) if cuda else "cpu"
preset = "h200" if "H200" in name else "h100"
profile = devicemodel.PRESETS[preset]
work = Path(tempfile.mkdtemp(prefix="flexmarl-calibrate-"))
hidden, layers = int(os.environ["CALIBRATE_HIDDEN"]), int(os.environ["CALIBRATE_LAYERS"])
model_dir = build_tiny_checkpoint(work / "model", seed=0, num_layers=layers, hidden_size=hidden,
                                  num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                                  intermediate_size=hidden * 3, max_position_embeddings=4096)
measured = {"device": name, "preset": preset}


def sync():
    if cuda:
        torch.cuda.synchronize()


# ---- 1. generation: the embedded engine's model loader, on CUDA --------------------------------------
from rolloutd.engines.embedded.model import load_model  # noqa: E402

loaded = load_model(str(model_dir), "calibration")
model = loaded.model.to(device=device, dtype=torch.bfloat16 if cuda else torch.float32).eval()
params = sum(p.numel() for p in model.parameters())
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
cfg = model.config
kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * (
    2 if cuda else 4)
measured.update(params=params, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token)
batch, prompt = (64, 512) if cuda else (4, 32)
ids = torch.randint(0, cfg.vocab_size - 8, (batch, prompt), device=device)
with torch.no_grad():
    model(input_ids=ids[:, :8])  # warm-up
    sync(); t = time.perf_counter()
    out_prefill = model(input_ids=ids, use_cache=True)
    sync(); prefill_s = time.perf_counter() - t
    measured["prefill_tokens_per_s"] = batch * prompt / prefill_s
    cache = out_prefill.past_key_values
    token = out_prefill.logits[:, -1:].argmax(-1)
    steps = 128 if cuda else 8
    sync(); t = time.perf_counter()
    for _ in range(steps):
        step = model(input_ids=token, use_cache=True, **{loaded.cache_kwarg: cache})
        cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
    sync(); decode_s = (time.perf_counter() - t) / steps
measured.update(decode_iteration_s=decode_s, decode_batch=batch, decode_context=batch * (prompt + steps / 2))
bytes_per_iteration = weight_bytes + kv_per_token * batch * (prompt + steps / 2)
peak = profile.peak_flops if cuda else 1e12
hbm = profile.hbm_bytes_per_s if cuda else 20e9
prefill_mfu = min(1.0, 2 * params * batch * prompt / prefill_s / peak)
hbm_efficiency = min(1.0, bytes_per_iteration / decode_s / hbm)
del model, cache
if cuda:
    torch.cuda.empty_cache()

# The embedded engine's own scheduler (CPU), for reference: tokens/s through /generate's path.
from rolloutd.engines.embedded.config import EmbeddedEngineConfig  # noqa: E402
from rolloutd.engines.embedded.engine import EmbeddedEngine  # noqa: E402

try:
    import asyncio

    async def embedded_rate():
        engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=str(build_tiny_checkpoint(work / "tiny"))))
        engine.start()
        from rolloutd.engines.embedded.work import GenerationJob
        from rolloutd.engines.protocol import SamplingParams
        loop = asyncio.get_running_loop()
        jobs = [GenerationJob(f"r{i}", [1, 2, 3, 4], SamplingParams(max_new_tokens=64, ignore_eos=True, seed=i), False, loop,
                     loop.create_future()) for i in range(16)]
        t = time.perf_counter()
        for job in jobs:
            engine.submit(job)
        await asyncio.gather(*(job.future for job in jobs))
        rate = 16 * 64 / (time.perf_counter() - t)
        engine.stop()
        return rate

    measured["embedded_engine_cpu_tokens_per_s"] = asyncio.run(embedded_rate())
except Exception as exc:  # the reference figure must not sink the calibration
    measured["embedded_engine_cpu"] = f"failed: {exc!r}"

# ---- 2. training: traind's AgentTrainer (DeepSpeed, NCCL on CUDA) ---------------------------------------
from traind.model import AgentTrainer, AgentTrainerConfig  # noqa: E402

trainer = AgentTrainer(AgentTrainerConfig(agent="calibrate", model_path=str(model_dir),
                                          dtype="bf16" if cuda else "fp32"))
rng = np.random.default_rng(0)
seq_prompt, seq_response, group = (256, 256, 16) if cuda else (16, 16, 4)


def micro_batch(index):
    task = f"t{index}"
    return [ExperienceRecord(
        experience_id=experience_id(task, s, "calibrate", 0), job_id="cal", agent="calibrate", task_id=task,
        group_id=group_id(task, "calibrate"), sample_index=s, episode_id=f"{task}/{s}", turn=0, behavior_version=0,
        reward=float(rng.integers(0, 2)),
        prompt_token_ids=rng.integers(1, 250, size=seq_prompt).astype(np.int32),
        response_token_ids=rng.integers(1, 250, size=seq_response).astype(np.int32),
        response_logprobs=(-rng.uniform(3, 7, size=seq_response)).astype(np.float32), group_size=group)
        for s in range(group)]


trainer.accumulate(micro_batch(0))  # warm-up
trainer.discard_gradients()
sync(); t = time.perf_counter()
rounds = 8 if cuda else 2
for i in range(rounds):
    trainer.accumulate(micro_batch(i + 1))
sync(); train_s = time.perf_counter() - t
tokens = rounds * group * (seq_prompt + seq_response)
sync(); t = time.perf_counter()
trainer.optimizer_step(rounds * group * seq_response, rounds * group)
sync(); optimizer_s = time.perf_counter() - t
trainer.release()
measured.update(train_tokens_per_s=tokens / train_s, optimizer_step_s=optimizer_s)
train_mfu = min(1.0, 6 * params * tokens / train_s / peak)

calibrated = {"preset": preset, "name": f"{name} (calibrated)", "prefill_mfu": round(prefill_mfu, 4),
              "hbm_efficiency": round(hbm_efficiency, 4), "train_mfu": round(train_mfu, 4)}
devicemodel.parse_profile(calibrated)  # the file must load
out.write_text(json.dumps(calibrated, indent=2) + "\n")
out.with_name(out.stem + ".measured.json").write_text(json.dumps(measured, indent=2) + "\n")
print(json.dumps({"profile": calibrated, "measured": measured}, indent=2))
PY
echo "wrote $OUT (load it with FLEXMARL_MODELLED_DEVICE=$OUT or devicemodel.load_profile)"
