#!/usr/bin/env bash
# Set up (once) and run the whole test suite, the slow end-to-end tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
