#!/usr/bin/env bash
# The Go client's toolchain, all from Debian's packages (offline builds, no Go module proxy):
#   golang-go, protoc (protobuf-compiler), protoc-gen-go, protoc-gen-go-grpc, and the Go
#   libraries grpc-go and google.golang.org/protobuf as source under /usr/share/gocode.
# clients/go builds against those sources (GOFLAGS=-mod=vendor is not needed: GOPATH mode
# through GO111MODULE=off is not used either; see clients/go/build.sh). Idempotent: returns at
# once when every piece is present. tests/test_go_client.py skips with a reason without `go`.
set -euo pipefail

PACKAGES=(golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev
          protobuf-compiler protoc-gen-go protoc-gen-go-grpc)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_go_tools: need root (or sudo) to apt-get install ${missing[*]}" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when apt does not know the packages yet.
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_go_tools: $(go version), $(protoc --version)"
