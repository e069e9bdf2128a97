#!/usr/bin/env bash
# Prepare this machine for the dashboard's browser test (tests/tools/test_dashboard.py): install
# Debian's chromium when /usr/bin/chromium is missing. Idempotent; seconds when it is there.
# Fails loudly: in CI the browser test must run, not be skipped.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
started=$(date +%s)
echo "== browser-setup: apt-get install chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y chromium >/dev/null 2>&1 || {
    apt-get update >/dev/null && apt-get install -y chromium >/dev/null
}
/usr/bin/chromium --version
echo "== browser-setup: done in $(( $(date +%s) - started ))s"
