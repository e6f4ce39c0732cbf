#!/usr/bin/env bash
# The headless browser of the dashboard's browser tests: Debian's chromium and chromium-driver.
#
#   bash scripts/browser.sh        install them when missing (root only), then print where
#                                  they are, e.g. CHROMIUM=/usr/bin/chromium
#
# Not root and not installed: prints the packages to install and exits 1. The tests look for
# /usr/bin/chromium and /usr/bin/chromedriver (SP_CHROMIUM / SP_CHROMEDRIVER override them);
# selenium never downloads a driver of its own.
set -euo pipefail

CHROMIUM="${SP_CHROMIUM:-/usr/bin/chromium}"
CHROMEDRIVER="${SP_CHROMEDRIVER:-/usr/bin/chromedriver}"
PACKAGES=(chromium chromium-driver)

log() { echo "browser: $*" >&2; }

if [[ ! -x $CHROMIUM || ! -x $CHROMEDRIVER ]]; then
    if [[ $(id -u) -ne 0 ]]; then
        log "chromium or chromedriver is missing; install them as root:"
        log "  apt-get install -y --no-install-recommends ${PACKAGES[*]}"
        exit 1
    fi
    log "installing ${PACKAGES[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
    fi
fi

echo "CHROMIUM=$CHROMIUM"
echo "CHROMEDRIVER=$CHROMEDRIVER"
"$CHROMIUM" --version 2>/dev/null || true
"$CHROMEDRIVER" --version 2>/dev/null || true
