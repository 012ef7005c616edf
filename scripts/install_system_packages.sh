#!/usr/bin/env bash
# System packages the tests need beyond the venv: redis-server (tests/redis_fixture.py starts a real
# one for the remote KV tier's tests). Idempotent: does nothing when it is already installed.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing redis-server (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
    command -v redis-server >/dev/null 2>&1 || { echo "redis-server still not on PATH after apt-get install" >&2; exit 1; }
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "redis-server is not installed, and installing it needs root: run 'sudo apt-get install redis-server'" \
         "(Debian/Ubuntu) or put a redis-server on PATH, then run this again" >&2
else
    echo "redis-server is not installed and apt-get is not available: install redis-server with this system's" \
         "package manager and put it on PATH" >&2
fi
exit 1
