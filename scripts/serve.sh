#!/usr/bin/env bash
# Set up (once) and start specdec with the embedded SmolLM2 model on 127.0.0.1:50051.
# Extra arguments go to `specdec serve`, e.g. `scripts/serve.sh --proposer ngram --num-speculative-tokens 4`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/specdec serve "$@"
