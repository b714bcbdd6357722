"""The speculative accept step: which drafts to keep, and the token after them.

The accept rule (implemented in ``kernels.rejection_sampler``), for a sequence
with drafts x_0..x_{n-1}, target distributions q_0..q_n and draft
distributions p_0..p_{n-1} (one-hot on x_i for n-gram drafts):

    accept x_i with probability min(1, q_i(x_i) / p_i(x_i)), i = 0, 1, ...;
    at the first rejection j emit a token sampled from normalize(max(q_j - p_j, 0))
    and stop; if all n are accepted emit a bonus token sampled from q_n.
    Greedy rows: accept while x_i == argmax q_i; emit argmax q at the stop.

Every emitted token is then distributed exactly as the target would sample it
(lossless), and each step emits 1..n+1 tokens per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.rejection_sampler import rejection_sample
from worker_service.sampling import exponential_noise

__all__ = ["RejectionSampler", "num_accepted_drafts", "rejection_sample"]


def num_accepted_drafts(num_emitted: torch.Tensor) -> torch.Tensor:  # [B] int64
    """Drafts accepted per sequence: every emitted token but the last one
    (the recovered or bonus token) is an accepted draft."""
    return num_emitted - 1


def uniform_noise(
    generators: Sequence[torch.Generator | None],
    num_draft_tokens: Sequence[int],
    num_cols: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, num_cols] float32
    """U[0, 1) samples for the accept tests. A seeded row draws only as many
    as it has drafts, so its stream does not depend on the batch's padding."""
    uniform = torch.rand(len(generators), num_cols, device=device)  # [B, K], unseeded rows
    for i, generator in enumerate(generators):
        if generator is not None and num_draft_tokens[i] > 0:
            uniform[i, : num_draft_tokens[i]] = torch.rand(
                num_draft_tokens[i], generator=generator, device=device
            )
    return uniform


class RejectionSampler:
    """Draws each row's randomness from its request's generator and applies the
    accept rule.

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
        generators: Sequence[torch.Generator | None],  # B entries, None = global RNG
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64 (-1 padded), [B] int64
        """Return ``(output_token_ids, num_emitted)``; see :func:`num_accepted_drafts`.

        Per row the uniforms (one per real draft) are drawn before the Exp(1)
        noise (one per vocabulary entry) from the same generator.
        """
        if self.strict:
            validate_inputs(
                target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, generators
            )
        num_spec, num_vocab = draft_token_ids.shape[1], target_probs.shape[2]
        device = target_probs.device
        uniform = uniform_noise(generators, num_draft_tokens.tolist(), num_spec, device)  # [B, K]
        noise = exponential_noise(generators, num_vocab, device)  # [B, V]
        return rejection_sample(
            target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, uniform, noise
        )


def validate_inputs(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    is_greedy: torch.Tensor,  # [B]
    generators: Sequence[torch.Generator | None],
) -> None:
    """Raise ``ValueError`` unless the inputs fit the rejection sampler's contract."""
    _check_shapes(target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, generators)
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
    generators: Sequence[torch.Generator | None],
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
    if len(generators) != num_seqs:
        raise ValueError(f"need one generator (or None) per sequence: {num_seqs}, got {len(generators)}")
