#!/usr/bin/env bash
# The nightly report's test opens the report in a real headless browser: Debian's chromium.
# Installed here (not in setup.sh) because only the tests need it, not `make demo`.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  echo "==> chromium is installed"
  exit 0
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "error: chromium is missing and this user cannot install packages;" \
         "install Debian's chromium (tests/contract/test_nightly_suite.py needs it)" >&2
    exit 1
  fi
fi
echo "==> installing Debian's chromium (headless browser for the report test, about 1 minute)"
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y -q chromium >/tmp/xfw-chromium-install.log 2>&1; then
  "${SUDO[@]}" apt-get update -q >>/tmp/xfw-chromium-install.log 2>&1
  "${SUDO[@]}" apt-get install -y -q chromium >>/tmp/xfw-chromium-install.log 2>&1 \
    || { echo "error: apt-get could not install chromium (log: /tmp/xfw-chromium-install.log)" >&2; exit 1; }
fi
echo "==> $(chromium --version)"
