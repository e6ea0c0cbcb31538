#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11 (run as root or with sudo rights):
#   ./dev.sh demo   set up, start a local cluster and train the signaling-game example on CPU
#   ./dev.sh test   set up, then lint (ruff), type-check (mypy) and run the test suite
#   ./dev.sh setup  set up only
# Set-up is idempotent: Debian's etcd-server, the CPU build of torch (pinned: an unpinned
# torch pulls a multi-GB CUDA build), then this repo with its train and dev extras.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

setup() {
  # etcd for the registry; systemd only for `systemd-analyze verify` of deploy/systemd in the tests.
  local missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$PY" -m pip install -q --disable-pip-version-check -e '.[train,dev]'
  # SGLang's own request definitions, for tests/rolloutd/test_sglang_schema.py: the wheel alone
  # (--no-deps: its runtime needs CUDA builds of torch and kernels; the schema modules need only
  # msgspec, in the dev extra). About 6 s and 130 MB the first time; skipped once installed.
  "$PY" -c 'import importlib.metadata as m; raise SystemExit(m.version("sglang") != "0.5.23")' 2>/dev/null \
    || "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile sglang==0.5.23
  # DeepSpeed JIT-compiles its CPU ops once per machine; keep them in one place.
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/flexmarl/torch_extensions}
}

cmd=${1:-help}
case "$cmd" in
  setup) setup ;;
  test)
    setup
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    "$PY" -m ruff check .
    "$PY" -m mypy
    shift
    "$PY" -m pytest -q "$@"
    ;;
  demo)
    setup
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    shift
    exec flexmarl demo "$@"
    ;;
  *)
    sed -n '2,7p' "$0"
    exit 2
    ;;
esac
