#!/usr/bin/env bash
# Generate the Python gRPC code and typing stubs from the .proto files.
#   scripts/gen-proto.sh            write into the source tree (commit the result)
#   scripts/gen-proto.sh --check    regenerate into a temporary dir and fail if it differs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
protos=$(find streamrover -name '*.proto' | sort)
out=.
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
# shellcheck disable=SC2086
"$PY" -m grpc_tools.protoc -I . --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" $protos
if [ "${1:-}" = "--check" ]; then
  status=0
  for proto in $protos; do
    base=${proto%.proto}
    for suffix in _pb2.py _pb2_grpc.py _pb2.pyi _pb2_grpc.pyi; do
      if ! cmp -s "$out/$base$suffix" "$base$suffix"; then
        echo "generated code is stale: $base$suffix differs from $proto; run scripts/gen-proto.sh and commit" >&2
        status=1
      fi
    done
  done
  exit $status
fi
