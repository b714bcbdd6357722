"""specdec: a speculative-decoding LLM server built as two gRPC services."""
