#!/usr/bin/env bash
# promtool and prometheus (Debian package `prometheus`): exposition and rule checks, and the
# end-to-end scrape test. Idempotent: returns at once when both are on PATH.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_prometheus: need root (or sudo) to apt-get install prometheus" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when apt does not know the package yet.
if ! apt-cache show prometheus >/dev/null 2>&1; then
    $SUDO apt-get update -qq
fi
# The package's post-install tries to start a system service; nothing here needs it, and on a
# machine without systemd policy-rc.d keeps it from trying.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null && command -v prometheus >/dev/null
echo "install_prometheus: $(promtool --version 2>&1 | head -1)"
