#!/usr/bin/env bash
# Regenerates the Go stubs in gqa/v1 from proto/gqa/v1/gqa.proto with protoc, protoc-gen-go and
# protoc-gen-go-grpc (Debian's packages; tests/tools/install_go_tools.sh). The stubs are
# committed; tests/test_go_client.py regenerates them into a scratch folder and fails on drift.
# Usage: clients/go/generate.sh [OUT_DIR]   (default: clients/go itself)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
protoc -I "$here/../../proto" \
    --go_out="$out" --go_opt=module=gqa-serve/clients/go \
    --go-grpc_out="$out" --go-grpc_opt=module=gqa-serve/clients/go \
    gqa/v1/gqa.proto
