"""The speculative accept step with keyed randomness: which drafts to keep, and the token after them.

The accept rule is implemented (and argued) in ``kernels.rejection_sampler``;
in short, for a sequence whose next token is at position n, with drafts
x_0..x_{k-1} and target distributions q_0..q_k for positions n..n+k:

    y_i = the target's keyed sample at position n+i: race(q_i, E(seed, n+i)).
    one-hot (n-gram) drafts: accept x_i iff x_i == y_i; emit y at the stop.
        This is rejection sampling with p_i = onehot(x_i), and every emitted
        token is the one a plain step would have sampled there.
    model drafts: accept x_i iff U(seed, n+i) < min(1, q_i(x_i) / p_i(x_i));
        at the first rejection j emit race(normalize(max(q_j - p_j, 0)), E(seed, n+j)),
        after k acceptances the bonus race(q_k, E(seed, n+k)).
    greedy rows: y_i = argmax q_i, accept while x_i == y_i.

E is keyed Exp(1) noise over the vocabulary (stream STREAM_TOKEN) and U a
keyed uniform (stream STREAM_ACCEPT), both functions of (seed, position) only
(worker_service/speculation/keyed_random.py): a seeded request gets the same tokens
whatever the batch, the padding to K, or the worker it runs on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.rejection_sampler import rejection_sample
from specdec.step import MAX_SEED
from worker_service.speculation.keyed_random import (
    MAX_POSITION,
    STREAM_ACCEPT,
    STREAM_TOKEN,
    keyed_exponential,
    keyed_uniform,
)

__all__ = ["RejectionSampler", "keyed_step_noise", "num_accepted_drafts", "rejection_sample"]


def num_accepted_drafts(num_emitted: torch.Tensor) -> torch.Tensor:  # [B] int64
    """Drafts accepted per sequence: every emitted token but the last one
    (the recovered or bonus token) is an accepted draft."""
    return num_emitted - 1


def keyed_step_noise(
    seeds: Sequence[int],  # B request seeds
    positions: Sequence[int],  # B positions of each sequence's first sampled token
    num_draft_tokens: Sequence[int],  # B draft counts in 0..K
    is_greedy: Sequence[bool],  # B
    num_spec: int,
    num_vocab: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, K+1, V] float32
    """E(seed, position) for the positions a sequence may emit at (0..n_b); 1.0 elsewhere.

    Only the rows that can sample are computed: greedy rows take the argmax and
    positions past a sequence's drafts are never emitted.
    """
    noise = torch.ones((len(seeds), num_spec + 1, num_vocab), dtype=torch.float32, device=device)  # [B, K+1, V]
    rows = [(b, i) for b, n in enumerate(num_draft_tokens) if not is_greedy[b] for i in range(n + 1)]
    if rows:
        keyed = keyed_exponential(
            [seeds[b] for b, _ in rows], [positions[b] + i for b, i in rows], STREAM_TOKEN, num_vocab, device
        )  # [R, V]
        seq_index = torch.tensor([b for b, _ in rows], device=device)  # [R]
        noise[seq_index, torch.tensor([i for _, i in rows], device=device)] = keyed
    return noise


def keyed_accept_uniforms(
    seeds: Sequence[int], positions: Sequence[int], num_spec: int, device: torch.device | str
) -> torch.Tensor:  # [B, K] float32 in (0, 1)
    """U(seed, position) for the accept test of each draft position."""
    rows = [(s, p + i) for s, p in zip(seeds, positions) for i in range(num_spec)]
    uniform = keyed_uniform([s for s, _ in rows], [p for _, p in rows], STREAM_ACCEPT, 1, device)  # [B*K, 1]
    return uniform.view(len(seeds), num_spec)


class RejectionSampler:
    """Keys each row's randomness by (seed, position) and applies the accept rule.

    ``strict=True`` validates the inputs first and raises ``ValueError`` with a
    message that names the problem (use it where inputs come from outside the
    worker, or in tests); the default trusts the caller.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def __call__(
        self,
        target_probs: torch.Tensor,  # [B, K+1, V] float32
        draft_token_ids: torch.Tensor,  # [B, K] int64, padded past num_draft_tokens
        num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
        draft_probs: torch.Tensor | None,  # [B, K, V] float32, None for n-gram drafts
        is_greedy: torch.Tensor,  # [B] bool
        seeds: Sequence[int],  # B request seeds in [0, 2**64)
        positions: Sequence[int],  # B absolute positions of each sequence's first sampled token
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64 (-1 padded), [B] int64
        """Return ``(output_token_ids, num_emitted)``; see :func:`num_accepted_drafts`."""
        if self.strict:
            validate_inputs(target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, seeds, positions)
        num_spec, num_vocab = draft_token_ids.shape[1], target_probs.shape[2]
        device = target_probs.device
        noise = keyed_step_noise(
            seeds, positions, num_draft_tokens.tolist(), is_greedy.tolist(), num_spec, num_vocab, device
        )  # [B, K+1, V]
        uniform = None if draft_probs is None else keyed_accept_uniforms(seeds, positions, num_spec, device)
        return rejection_sample(target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, uniform, noise)


def validate_inputs(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    is_greedy: torch.Tensor,  # [B]
    seeds: Sequence[int],
    positions: Sequence[int],
) -> None:
    """Raise ``ValueError`` unless the inputs fit the rejection sampler's contract."""
    _check_shapes(target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, seeds, positions)
    bad_keys = [(s, p) for s, p in zip(seeds, positions) if not (0 <= s <= MAX_SEED and 0 <= p <= MAX_POSITION)]
    if bad_keys:
        raise ValueError(
            f"need seeds in [0, 2**64) and positions in [0, 2**32), got seed {bad_keys[0][0]}, "
            f"position {bad_keys[0][1]}"
        )
    for name, tensor, dtype in [
        ("target_probs", target_probs, torch.float32),
        ("draft_token_ids", draft_token_ids, torch.int64),
        ("num_draft_tokens", num_draft_tokens, torch.int64),
        ("draft_probs", draft_probs, torch.float32),
        ("is_greedy", is_greedy, torch.bool),
    ]:
        if tensor is not None and tensor.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
        if tensor is not None and tensor.device != target_probs.device:
            raise ValueError(f"{name} is on {tensor.device}, target_probs on {target_probs.device}")
    for name, probs in [("target_probs", target_probs), ("draft_probs", draft_probs)]:
        if probs is not None and not bool((torch.isfinite(probs) & (probs >= 0)).all()):
            raise ValueError(f"{name} must be finite and non-negative")
    num_spec, num_vocab = draft_token_ids.shape[1], target_probs.shape[2]
    if bool(((num_draft_tokens < 0) | (num_draft_tokens > num_spec)).any()):
        raise ValueError(f"num_draft_tokens must be in [0, {num_spec}], got {num_draft_tokens.tolist()}")
    is_draft = torch.arange(num_spec, device=draft_token_ids.device) < num_draft_tokens.unsqueeze(1)  # [B, K]
    bad_ids = draft_token_ids[is_draft & ((draft_token_ids < 0) | (draft_token_ids >= num_vocab))]
    if bad_ids.numel() > 0:
        raise ValueError(f"draft token ids must be in [0, {num_vocab}), got {bad_ids.tolist()}")


def _check_shapes(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int],
) -> None:
    """Raise ``ValueError`` unless all shapes agree on one (B, K, V)."""
    if target_probs.dim() != 3 or target_probs.shape[1] < 1 or target_probs.shape[2] < 1:
        raise ValueError(f"target_probs must be [B, K+1, V] with V >= 1, got {tuple(target_probs.shape)}")
    num_seqs, num_spec, num_vocab = target_probs.shape[0], target_probs.shape[1] - 1, target_probs.shape[2]
    expected = {
        "draft_token_ids": (draft_token_ids, (num_seqs, num_spec)),
        "num_draft_tokens": (num_draft_tokens, (num_seqs,)),
        "draft_probs": (draft_probs, (num_seqs, num_spec, num_vocab)),
        "is_greedy": (is_greedy, (num_seqs,)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match target_probs {tuple(target_probs.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
    if len(seeds) != num_seqs or len(positions) != num_seqs:
        raise ValueError(
            f"need one seed and one position per sequence: {num_seqs}, got {len(seeds)} and {len(positions)}"
        )
