"""Proposers: where the draft tokens of a speculative step come from.

Every proposer has the same methods, so the worker treats them alike:
`propose` (up to num_drafts[i] tokens for states[i], possibly fewer, never
more), `after_verify` (what a proposer keeps once the step's drafts were
checked), `after_step` (the step's committed positions, once a step),
`release` (the worker drops these requests: finished, preempted or a new
session) and `num_kv_tokens` (how far a proposer with a KV cache of
its own has written it: the prefix cache may only keep blocks every model wrote).
"""

from dataclasses import dataclass

import torch

from worker_service.speculation.proposers.trees import tree_matching


@dataclass
class Proposal:
    """Draft tokens for a batch of sequences (any of 0..k per sequence)."""

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None  # [B, K, V] for model drafts; None for token-copy (one-hot) drafts
    scores: list[float] | None = None  # per sequence, the proposer's own estimate of its accepted drafts
    sources: list[str] | None = None  # per sequence, the proposer that drafted (several proposers at once)
    match_lengths: list[int] | None = None  # per sequence, the context match behind a copied draft (0: none)
    parents: list[list[int] | None] | None = None  # per sequence, a tree's parent rows (proposers/trees.py)
    ranks: list[list[int] | None] | None = None  # per sequence, a tree's rows' ranks (proposers/trees.py)

    def parents_of(self, i: int) -> list[int] | None:
        """Sequence i's tree (its drafts' parent rows), or None for a chain."""
        return self.parents[i] if self.parents is not None else None

    def ranks_of(self, i: int) -> list[int] | None:
        """The order sequence i's tree chose its rows in (None: a chain, or a tree given without ranks)."""
        return self.ranks[i] if self.ranks is not None and self.parents_of(i) is not None else None


def num_matching(drafts: list[int], emitted: list[int], parents: list[int] | None = None) -> int:
    """How many of `drafts` the emitted tokens confirm: their common prefix, or for a tree (`parents`) how deep
    they follow it (the emitted tokens are the target's own choices at those positions, so this holds for drafts
    that were not scored too)."""
    if parents is not None:
        return tree_matching(drafts, parents, emitted)
    return next((j for j, (a, b) in enumerate(zip(drafts, emitted)) if a != b), min(len(drafts), len(emitted)))


class Proposer:
    """Base class: the no-op hooks; subclasses implement `propose`."""

    runs_model = False  # drafting runs a model (a forward per draft), not a lookup: several proposers at once
    # ask it only where copying is expected to do worse (proposers/combined.py)
    reports_match = False  # copies drafts from a context match and gives its length (Proposal.match_lengths):
    # the worker previews its next draft for the scheduler (proposers/preview.py)

    def propose(self, states: list, num_drafts: list[int]) -> Proposal:  # states: list[RequestState]
        raise NotImplementedError

    def after_verify(self, state, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """Called after each sampling step of `state` (its emitted tokens are already appended)."""

    def after_step(self, states: list, chunks: list, num_committed: list[int]) -> None:
        """Called once a step, after acceptance, with the step's states, their target chunks and how many of each
        chunk's positions were committed (its known tokens and the accepted drafts)."""

    def release(self, states: list) -> None:
        """Called with the requests the worker drops, before their state is forgotten."""

    def num_kv_tokens(self, state) -> int | None:
        """Positions [0, n) of `state` whose KV this proposer has written in its own cache; None: it has none."""
        return None
