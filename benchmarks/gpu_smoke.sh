#!/usr/bin/env bash
# GPU smoke check of a first FlexMARL GPU run, in under 8 minutes (checks: benchmarks/gpu_smoke.py).
#
#   bash benchmarks/gpu_smoke.sh [--cpu] [--out OUT_JSON] [--only CHECK ...]
#
# Runs, each with its own deadline, and writes what ran, passed, failed or was skipped (and why)
# to OUT_JSON (default benchmarks/results/gpu_smoke.json) after every check:
#   environment, embedded_engine (deterministic flag, device set 0, logprobs, n>1 with seeds,
#   update_weights_from_disk), replicas_on_distinct_devices (>= 2 GPUs), traind_deepspeed
#   (AgentTrainer on the slot's device; NCCL on CUDA), strict_job (LocalCluster, async with
#   max_staleness 0, 2 steps), sglang_server (only when `import sglang` works).
# --cpu: dry mode for a machine without a GPU (CPU DeepSpeed, fake device ids, no SGLang).
#
# Missing pieces degrade to "skipped", never to a crash: no deepspeed -> traind_deepspeed and
# strict_job skipped (unless a wheelhouse provides it, as in gpu_calibrate.sh: carry
# ./wheelhouse with `pip wheel --no-deps -w wheelhouse deepspeed==0.19.8`, and the etcd binary
# as wheelhouse/etcd); no etcd -> strict_job skipped; no sglang -> sglang_server skipped.
# Exit status: 0 when nothing failed, 1 when a check failed, 124 when the whole run timed out.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELHOUSE="${FLEXMARL_WHEELHOUSE:-$ROOT/wheelhouse}"
TOTAL_TIMEOUT_S="${GPU_SMOKE_TIMEOUT_S:-470}"
export PYTHONPATH="$ROOT:$ROOT/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/flexmarl/torch_extensions}"
export CUDA_DEVICE_ORDER="${CUDA_DEVICE_ORDER:-PCI_BUS_ID}"

cpu_mode=0
for arg in "$@"; do
  [[ "$arg" == "--cpu" ]] && cpu_mode=1
done
if [[ $cpu_mode == 1 ]]; then
  export DS_ACCELERATOR=cpu
elif python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
else
  echo "[gpu_smoke] no CUDA device visible: the CUDA checks will be skipped (use --cpu for the dry mode)" >&2
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi

if ! python -c "import deepspeed" 2>/dev/null; then
  if [[ -d "$WHEELHOUSE" ]]; then
    python -m pip install -q --no-index --find-links "$WHEELHOUSE" deepspeed \
      || echo "[gpu_smoke] deepspeed not installable from $WHEELHOUSE: its checks will be skipped" >&2
  else
    echo "[gpu_smoke] deepspeed not installed and no wheelhouse at $WHEELHOUSE: its checks will be skipped" >&2
  fi
fi
if [[ -x "$WHEELHOUSE/etcd" ]]; then
  export PATH="$WHEELHOUSE:$PATH"
fi

cd "$ROOT" || exit 2
timeout --signal=TERM --kill-after=20 "$TOTAL_TIMEOUT_S" python benchmarks/gpu_smoke.py "$@"
