#!/usr/bin/env bash
# Regenerates the Python code for proto/xpusense/v1/*.proto (our wire) and
# proto/xpusense/podresources/v1/*.proto (the kubelet's, vendored) next to the .proto files.
# Reproducible: same grpcio-tools version (pinned in pyproject.toml) -> same bytes.
# Usage: scripts/gen-proto.sh [OUTDIR]   (default: proto/, i.e. in place)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/proto}
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
cd "$root/proto"
"$py" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    xpusense/v1/*.proto xpusense/podresources/v1/*.proto
