"""The scheduler service: request queue, paged KV block allocation and speculation policy (no torch)."""
