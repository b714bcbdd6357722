"""Scorers: target-model logits for every draft position of every sequence, in one forward pass.

Both take the same chunks — a speculating sequence's chunk is its pending token
followed by its drafts, with num_logits = 1 + drafts — and return the same
`[N, V]` logits in the same row order.
"""

from worker_service.runtime.runner import ModelRunner, SequenceChunk


def score_multi_query(runner: ModelRunner, chunks: list[SequenceChunk]):
    """One (k+1)-token query per sequence attending causally over its cached blocks."""
    return runner.forward(chunks)


def expand(chunks: list[SequenceChunk]) -> list[SequenceChunk]:
    """Batch expansion: a speculating chunk becomes k+1 single-token rows (no drafts, first draft, ...).

    Row j computes position start_pos + j. The rows share the sequence's block
    table; the attention writes every row's K/V before any row attends, so row
    j sees the K/V of rows 0..j-1 exactly as the multi-query pass does.
    """
    rows = []
    for chunk in chunks:
        if chunk.num_logits <= 1 or chunk.num_logits != len(chunk.token_ids):
            rows.append(chunk)
            continue
        rows.extend(
            SequenceChunk([tok], chunk.start_pos + j, chunk.block_table, 1) for j, tok in enumerate(chunk.token_ids)
        )
    return rows


def score_batch_expansion(runner: ModelRunner, chunks: list[SequenceChunk]):
    """k+1 single-query rows per speculating sequence; the logits come back in the same order."""
    return runner.forward(expand(chunks))


SCORERS = {"multi_query": score_multi_query, "batch_expansion": score_batch_expansion}
