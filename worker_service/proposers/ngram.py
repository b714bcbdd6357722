"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker_service.proposers import Proposal, Proposer


def propose_ngram(token_ids: list[int] | np.ndarray, ngram_min: int, ngram_max: int,
                  num_drafts: int) -> tuple[list[int], int]:
    """Up to `num_drafts` tokens that followed the most recent earlier match of the sequence's suffix, and the
    match's length n (0: no drafts).

    Tries suffix lengths n from ngram_max down to ngram_min and takes the
    longest that matches; among its matches, the most recent one that still
    has a following token. No match: no drafts.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    num_tokens = len(tokens)
    if num_drafts <= 0:
        return [], 0
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens-n, n]: starts 0.. with a follower
        matches = np.flatnonzero((windows == tokens[num_tokens - n:]).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return tokens[start: start + num_drafts].tolist(), n
    return [], 0


class NgramProposer(Proposer):
    """Prompt lookup over prompt + generated tokens; no model."""

    reports_match = True

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, states, num_drafts: list[int]) -> Proposal:
        found = [propose_ngram(s.token_ids, self.ngram_min, self.ngram_max, k) for s, k in zip(states, num_drafts)]
        return Proposal([drafts for drafts, _ in found], match_lengths=[n for _, n in found])
