#!/usr/bin/env bash
# System packages the tests need beyond the venv, each started by the tests themselves on a loopback
# port: redis-server (the remote KV tier, tests/redis_fixture.py), prometheus and promtool (a real
# scrape of /metrics and the alert rules in deploy/), chromium (the live KV map, driven by Playwright
# with that executable). Idempotent: installs only what is missing.
set -euo pipefail

# command on PATH -> Debian package that provides it
declare -A PACKAGE_OF=([redis-server]=redis-server [prometheus]=prometheus [promtool]=prometheus [chromium]=chromium)
missing=()
for command in "${!PACKAGE_OF[@]}"; do
    command -v "$command" >/dev/null 2>&1 || missing+=("${PACKAGE_OF[$command]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing $packages(apt-get)"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages
    for command in "${!PACKAGE_OF[@]}"; do
        command -v "$command" >/dev/null 2>&1 || { echo "$command still not on PATH after apt-get install" >&2; exit 1; }
    done
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: $packages- installing them needs root: run 'sudo apt-get install $packages'" \
         "(Debian/Ubuntu) or put them on PATH, then run this again" >&2
else
    echo "missing system packages: $packages- apt-get is not available: install them with this system's" \
         "package manager and put them on PATH" >&2
fi
exit 1
