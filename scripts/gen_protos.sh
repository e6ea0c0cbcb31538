#!/usr/bin/env bash
# Regenerates the checked-in Python code for proto/flexmarl/v1/*.proto.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: clients/python)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/clients/python}
mkdir -p "$out/flexmarl/v1"
python3 -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" --mypy_grpc_out="$out" \
  "$root"/proto/flexmarl/v1/*.proto
touch "$out/flexmarl/v1/__init__.py"
