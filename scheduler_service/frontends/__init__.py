"""The client front ends: the GenerationService gRPC server, the OpenAI-compatible HTTP API, admission, API
keys, request building and the chat tokenizer. They drive the cluster; the cluster never imports them."""
