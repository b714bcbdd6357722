"""specdec: a speculative-decoding LLM server built as two gRPC services."""

import sys

from specdec.cli import main

sys.exit(main())
