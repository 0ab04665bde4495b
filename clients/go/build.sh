#!/usr/bin/env bash
# Builds the Go client offline against Debian's packages (tests/tools/install_go_tools.sh):
# grpc-go and the protobuf runtime are sources under /usr/share/gocode, so this builds in GOPATH
# mode, with clients/go linked into a scratch GOPATH at its module path gqa-serve/clients/go.
# Usage: clients/go/build.sh OUT_DIR   (writes OUT_DIR/decode)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:?usage: build.sh OUT_DIR}" && cd "$1" && pwd)
gopath=$(mktemp -d)
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/gqa-serve/clients"
ln -s "$here" "$gopath/src/gqa-serve/clients/go"
export GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOFLAGS= GOPROXY=off
export GOCACHE=${GOCACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/go-build}
cd "$gopath/src/gqa-serve/clients/go"
go vet gqa-serve/clients/go/example/decode
go build -o "$out/decode" gqa-serve/clients/go/example/decode
