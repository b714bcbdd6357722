#!/usr/bin/env bash
# Set up (once) and run the whole test suite, the slow end-to-end tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

# promtool, for `promtool check metrics` on live /metrics: Debian's prometheus package, unpacked into .venv
# (nothing installed system-wide, no service started).
if [ ! -x .venv/bin/promtool ]; then
    echo "test: fetching promtool (Debian's prometheus package)" >&2
    tmp="$(mktemp -d)"
    (cd "$tmp" && { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; })
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
    cp "$tmp/root/usr/bin/promtool" .venv/bin/promtool
    rm -rf "$tmp"
fi

# Two pytest workers (pytest-xdist): half of the suite's time is tests waiting on processes, servers and
# sockets, which the other worker fills (on 2 cores: 410 s against 715 s one at a time). SPECDEC_TEST_WORKERS=0
# runs everything in this process; arguments after it (-n N, -p no:xdist) override it.
exec .venv/bin/python -m pytest -n "${SPECDEC_TEST_WORKERS:-2}" "$@"
