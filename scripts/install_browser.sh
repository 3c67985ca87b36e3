#!/usr/bin/env bash
# Headless Chromium for the report's browser check (tests/test_report_offline.py): Debian's
# chromium-headless-shell, installed when no Chromium is on PATH and apt-get can run as root.
set -uo pipefail
if command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_browser: no Chromium and no root apt-get here; the browser check will not run" >&2
    exit 0
fi
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium-headless-shell >/dev/null || echo "install_browser: apt-get could not install chromium-headless-shell" >&2
