#!/usr/bin/env bash
# npm @grafana/schema (the dashboard model) and typescript, to type-check the dashboard JSON.
# Installed into .tools/grafana-schema (ignored by git); `tsc` is linked into .tools/bin.
# Idempotent: returns at once when the pinned versions are already there.
set -euo pipefail

SCHEMA_VERSION="13.2.3"
TYPESCRIPT_VERSION="5.9.3"

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/.tools/grafana-schema"
BIN="$ROOT/.tools/bin"

installed() {
    node -e "process.exit(require('$DEST/node_modules/@grafana/schema/package.json').version === '$SCHEMA_VERSION' \
        && require('$DEST/node_modules/typescript/package.json').version === '$TYPESCRIPT_VERSION' ? 0 : 1)" \
        2>/dev/null
}

if ! command -v npm >/dev/null 2>&1; then
    echo "install_grafana_schema: npm is not installed; the dashboard type-check will be skipped" >&2
    exit 0
fi

if ! installed; then
    mkdir -p "$DEST"
    [ -f "$DEST/package.json" ] || echo '{"name": "gqa-serve-grafana-schema", "private": true}' > "$DEST/package.json"
    npm install --prefix "$DEST" --no-audit --no-fund --silent --save-exact \
        "@grafana/schema@$SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION"
    installed
fi
mkdir -p "$BIN"
ln -sf "$DEST/node_modules/typescript/bin/tsc" "$BIN/tsc"
