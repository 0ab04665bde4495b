#!/usr/bin/env bash
# Debian's chromium: the headless browser tests/test_status_page.py drives through Playwright
# (the test extra pins playwright; its own browser downloads are never used, the test points it
# at this binary). Idempotent: returns at once when chromium is on PATH.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_browser: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when apt does not know the package yet.
if ! apt-cache show chromium >/dev/null 2>&1; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
echo "install_browser: $(chromium --version 2>/dev/null | head -1)"
