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
