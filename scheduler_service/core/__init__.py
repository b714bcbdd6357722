"""The per-worker core: request state, the block manager, the scheduler, the speculation policy and its goodput
model, the detokenizer. Pure Python (no torch, no gRPC): imports only the standard library and specdec.step."""
