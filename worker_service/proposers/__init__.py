"""Proposers: where the k draft tokens of a speculative step come from."""

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Draft tokens for a batch of sequences (any of 0..k per sequence)."""

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None  # [B, K, V] for model drafts; None for n-gram (one-hot) drafts
