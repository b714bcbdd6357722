"""Rejection sampling for speculative decoding: Triton kernels + PyTorch reference.

Accept rule, for each sequence b with n = num_draft_tokens[b] drafts x_0..x_{n-1},
target distributions q_0..q_n and the step's keyed Exp(1) noise E_0..E_n (one
vector over the vocabulary per position, ``exp_noise[b, i]``)::

    race(d, E) = argmax_v d[v] / E[v]          (an exact sample of normalize(d))
    y_i        = race(q_i, E_i)                (greedy rows: argmax q_i)

    one-hot drafts (n-gram, ``draft_probs is None``):
        accept x_i iff x_i == y_i, i = 0, 1, ...; at the first mismatch j emit
        y_j and stop; if all n are accepted emit y_n (the bonus token).
    draft distributions p_i (a draft model):
        greedy rows: the one-hot rule above with y_i = argmax q_i.
        random rows: accept x_i iff u_i < min(1, q_i(x_i) / p_i(x_i)); at the
        first rejection j emit race(max(q_j - p_j, 0), E_j) (race(q_j, E_j) if
        that is all 0) and stop; if all n are accepted emit race(q_n, E_n).

The one-hot rule IS rejection sampling. y_i ~ q_i, so x_i is accepted with
probability q_i(x_i) = min(1, q_i(x_i) / p_i(x_i)) for p_i = onehot(x_i); on a
rejection y_i is distributed as q_i conditioned on y_i != x_i, i.e.
normalize(max(q_i - onehot(x_i), 0)), the recovered distribution (q_i(x_i) = 1
never rejects). And the emitted token at every position is y_i, the token a
plain step would sample there with the same noise: with the noise keyed by
(request seed, position), n-gram speculation cannot change a seeded request's
tokens. Greedy is the special case y_i = argmax q_i.

For model drafts the comparison is evaluated as ``u * p(x) < q(x)``: for
p(x) > 0 and u < 1 this is exactly ``u < min(1, q(x)/p(x))``, and it needs no
division, so p(x) = 0 accepts iff q(x) > 0 and q(x) = 0 always rejects, with
no NaN. Each position's noise is read only for the one token emitted there, so
the u_i and E_i a step uses are independent of each other and of the drafts.

In a race, tokens with ``d[v] == 0`` score -1 so they are never picked while
any mass remains; ties go to the lowest token id in both implementations.

Outputs: ``output_token_ids`` [B, K+1] int64, the emitted tokens followed by
-1 padding, and ``num_emitted`` [B] int64 in 1..n+1 (accepted drafts =
num_emitted - 1).
"""

import torch

from kernels._triton import HAS_TRITON, use_triton
from kernels.sampling_cpu import argmax_last, race_rows

PAD_TOKEN_ID = -1


# ---------------------------------------------------------------- reference


def race(dist: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race over the last dim: ``argmax(dist / noise)``, zero-mass tokens scoring -1.

    ``dist`` [..., V] non-negative (any scale), ``noise`` [..., V] Exp(1) > 0;
    returns [...] int64. With noise keyed per position this is the one
    sampling rule every path uses.
    """
    return race_rows(dist, noise)  # [...]: on the CPU one C pass (kernels/sampling_cpu.py)


def _accepted_prefix(is_accepted: torch.Tensor) -> torch.Tensor:  # [B] int64
    """Length of the leading run of accepted drafts (``is_accepted`` [B, K])."""
    return is_accepted.long().cumprod(dim=1).sum(dim=1)


def _match_ref(
    target_tokens: torch.Tensor,  # [B, K+1] int64, y_i per position
    draft_ids: torch.Tensor,  # [B, K] int64, 0 past num_draft_tokens
    is_draft: torch.Tensor,  # [B, K] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """One-hot rule: accept while x_i == y_i; emit y up to and including the stop position."""
    num_spec = draft_ids.shape[1]
    num_accepted = _accepted_prefix((draft_ids == target_tokens[:, :num_spec]) & is_draft)  # [B]
    positions = torch.arange(num_spec + 1, device=draft_ids.device)  # [K+1]
    output = torch.where(positions <= num_accepted.unsqueeze(1), target_tokens, PAD_TOKEN_ID)  # [B, K+1]
    return output, num_accepted + 1


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64, padded past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None for one-hot (n-gram) drafts
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor | None,  # [B, K] float32 in (0, 1); read only with draft_probs
    exp_noise: torch.Tensor,  # [B, K+1, V] float32 Exp(1), the noise of each position
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """Vectorised PyTorch reference of the accept rule in the module docstring."""
    num_seqs, num_spec = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(num_seqs, device=device)  # [B]
    positions = torch.arange(num_spec, device=device)  # [K]
    is_draft = positions < num_draft_tokens.unsqueeze(1)  # [B, K]
    draft_ids = torch.where(is_draft, draft_token_ids, 0)  # [B, K], padding made a safe index
    target_argmax = argmax_last(target_probs)  # [B, K+1]
    if draft_probs is None:
        target_tokens = torch.where(is_greedy.unsqueeze(1), target_argmax, race(target_probs, exp_noise))
        return _match_ref(target_tokens, draft_ids, is_draft)  # [B, K+1], [B]

    greedy_output, greedy_emitted = _match_ref(target_argmax, draft_ids, is_draft)
    q_x = target_probs[:, :num_spec].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    p_x = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    num_accepted = _accepted_prefix((uniform_samples * p_x < q_x) & is_draft)  # [B]
    # The one sampled token sits at position num_accepted: recovered if a draft
    # was rejected there, bonus if all drafts were accepted.
    is_recovery = num_accepted < num_draft_tokens  # [B]
    q_last = target_probs[rows, num_accepted]  # [B, V]
    last_pos = num_accepted.clamp(max=max(num_spec - 1, 0))  # [B], safe index into [K]
    p_last = draft_probs[rows, last_pos] if num_spec > 0 else torch.zeros_like(q_last)  # [B, V]
    p_last = p_last * is_recovery.unsqueeze(1)  # [B, V], the bonus samples q itself
    residual = (q_last - p_last).clamp_min(0.0)  # [B, V]
    has_residual = (residual > 0).any(dim=1, keepdim=True)  # [B, 1]
    last_token = race(torch.where(has_residual, residual, q_last), exp_noise[rows, num_accepted])  # [B]

    output = torch.where(positions < num_accepted.unsqueeze(1), draft_ids, PAD_TOKEN_ID)  # [B, K]
    output = torch.cat([output, output.new_full((num_seqs, 1), PAD_TOKEN_ID)], dim=1)  # [B, K+1]
    output[rows, num_accepted] = last_token
    output = torch.where(is_greedy.unsqueeze(1), greedy_output, output)  # [B, K+1]
    return output, torch.where(is_greedy, greedy_emitted, num_accepted + 1)


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    from kernels._triton import tl, triton

    @triton.jit
    def _race_rows_kernel(
        winner_ptr,
        target_probs_ptr,
        noise_ptr,
        num_draft_ptr,
        is_greedy_ptr,
        num_rows,
        num_vocab,
        stride_qr,
        stride_noise_r,
        NUM_POS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """y = race(q_i, E_i) for every (sequence, position) row a random sequence can
        emit (positions 0..n), the rows of [B * (K+1), V]; other rows are not written."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
        seqs = rows // NUM_POS  # [BLOCK_R]
        is_row = rows < num_rows
        num_draft = tl.load(num_draft_ptr + seqs, mask=is_row, other=-1)  # [BLOCK_R]
        is_greedy = tl.load(is_greedy_ptr + seqs, mask=is_row, other=1) != 0  # [BLOCK_R]
        is_active = is_row & ~is_greedy & (rows % NUM_POS <= num_draft)  # [BLOCK_R]
        best = tl.full([BLOCK_R], -2.0, tl.float32)  # [BLOCK_R], below any score
        best_id = tl.zeros([BLOCK_R], dtype=tl.int64)  # [BLOCK_R]
        for v0 in range(0, num_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            mask = is_active[:, None] & (cols < num_vocab)[None, :]  # [BLOCK_R, BLOCK_V]
            q = tl.load(target_probs_ptr + rows[:, None] * stride_qr + cols[None, :], mask=mask, other=0.0)
            noise = tl.load(noise_ptr + rows[:, None] * stride_noise_r + cols[None, :], mask=mask, other=1.0)
            # IEEE division (plain `/` may be approximate on GPUs) keeps ties and
            # near-ties identical to the reference.
            score = tl.where(q > 0, tl.math.div_rn(q.to(tl.float32), noise.to(tl.float32)), -1.0)
            block_best, block_id = tl.max(score, axis=1, return_indices=True)  # [BLOCK_R] x2
            is_better = block_best > best  # strict: ties keep the lower id
            best = tl.where(is_better, block_best, best)
            best_id = tl.where(is_better, block_id.to(tl.int64) + v0, best_id)
        tl.store(winner_ptr + rows, best_id, mask=is_active)

    @triton.jit
    def _match_accept_kernel(
        out_ptr,
        num_accepted_ptr,
        draft_ptr,
        target_tokens_ptr,
        num_draft_ptr,
        is_greedy_ptr,
        num_seqs,
        stride_out,
        stride_draft,
        stride_tokens,
        NUM_SPEC: tl.constexpr,
        GREEDY_ONLY: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        """One-hot rule: emit y_i while it equals the draft, y at the first mismatch
        (recovered), or y_n (bonus). Every row, or only greedy rows (GREEDY_ONLY)."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = rows < num_seqs
        if GREEDY_ONLY:
            is_active = is_active & (tl.load(is_greedy_ptr + rows, mask=is_active, other=0) != 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_accepting = is_active  # [BLOCK_B], still inside the accepted prefix
        num_accepted = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for i in range(NUM_SPEC):
            is_live = is_accepting & (i < num_draft)  # [BLOCK_B], x_i is a real, undecided draft
            draft = tl.load(draft_ptr + rows * stride_draft + i, mask=is_live, other=0)  # [BLOCK_B]
            token = tl.load(target_tokens_ptr + rows * stride_tokens + i, mask=is_live, other=0)  # [BLOCK_B]
            tl.store(out_ptr + rows * stride_out + i, token, mask=is_live)
            is_accepting = is_live & (draft == token)
            num_accepted += is_accepting.to(tl.int64)
        is_bonus = is_active & (num_accepted == num_draft)
        bonus = tl.load(target_tokens_ptr + rows * stride_tokens + num_draft, mask=is_bonus, other=0)
        tl.store(out_ptr + rows * stride_out + num_draft, bonus, mask=is_bonus)
        tl.store(num_accepted_ptr + rows, num_accepted, mask=is_active)

    @triton.jit
    def _random_accept_kernel(
        out_ptr,
        num_accepted_ptr,
        draft_ptr,
        num_draft_ptr,
        is_greedy_ptr,
        target_probs_ptr,
        draft_probs_ptr,
        uniform_ptr,
        num_seqs,
        stride_out,
        stride_draft,
        stride_qb,
        stride_qk,
        stride_pb,
        stride_pk,
        stride_u,
        NUM_SPEC: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        """Random rows with model drafts: accept x_i while ``u_i * p_i(x_i) < q_i(x_i)``;
        write the accepted prefix and its length (the last token is sampled separately)."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = (rows < num_seqs) & (tl.load(is_greedy_ptr + rows, mask=rows < num_seqs, other=1) == 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_accepting = is_active  # [BLOCK_B], still inside the accepted prefix
        num_accepted = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for i in range(NUM_SPEC):
            is_live = is_accepting & (i < num_draft)  # [BLOCK_B], x_i is a real, undecided draft
            draft = tl.load(draft_ptr + rows * stride_draft + i, mask=is_live, other=0)  # [BLOCK_B]
            q_x = tl.load(target_probs_ptr + rows * stride_qb + i * stride_qk + draft, mask=is_live, other=0.0)
            p_x = tl.load(draft_probs_ptr + rows * stride_pb + i * stride_pk + draft, mask=is_live, other=1.0)
            u = tl.load(uniform_ptr + rows * stride_u + i, mask=is_live, other=1.0)  # [BLOCK_B]
            # u < min(1, q(x) / p(x)), written without a division (module docstring).
            is_accepting = is_live & (u.to(tl.float32) * p_x.to(tl.float32) < q_x.to(tl.float32))
            tl.store(out_ptr + rows * stride_out + i, draft, mask=is_accepting)
            num_accepted += is_accepting.to(tl.int64)
        tl.store(num_accepted_ptr + rows, num_accepted, mask=is_active)

    @triton.jit
    def _sample_last_token_kernel(
        out_ptr,
        num_accepted_ptr,
        num_draft_ptr,
        is_greedy_ptr,
        target_probs_ptr,
        draft_probs_ptr,
        noise_ptr,
        num_seqs,
        num_vocab,
        stride_out,
        stride_qb,
        stride_qk,
        stride_pb,
        stride_pk,
        stride_nb,
        stride_nk,
        BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Random rows with model drafts: race over max(q_j - p_j, 0) at j = num_accepted
        with that position's noise (q_j itself for the bonus, or when the residual is
        all zero) and write the winner."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = (rows < num_seqs) & (tl.load(is_greedy_ptr + rows, mask=rows < num_seqs, other=1) == 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        pos = tl.load(num_accepted_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_recovery = is_active & (pos < num_draft)  # [BLOCK_B], else bonus
        q_row = target_probs_ptr + rows * stride_qb + pos * stride_qk  # [BLOCK_B] pointers
        p_row = draft_probs_ptr + rows * stride_pb + pos * stride_pk  # [BLOCK_B] pointers
        noise_row = noise_ptr + rows * stride_nb + pos * stride_nk  # [BLOCK_B] pointers
        # Running race winners over the residual and, for the fallback, over q.
        best_res = tl.full([BLOCK_B], -2.0, tl.float32)  # [BLOCK_B], below any score
        best_q = tl.full([BLOCK_B], -2.0, tl.float32)  # [BLOCK_B]
        id_res = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        id_q = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for v0 in range(0, num_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            mask = is_active[:, None] & (cols < num_vocab)[None, :]  # [BLOCK_B, BLOCK_V]
            q = tl.load(q_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_row[:, None] + cols[None, :], mask=mask & is_recovery[:, None], other=0.0)
            residual = tl.maximum(q - p.to(tl.float32), 0.0)  # [BLOCK_B, BLOCK_V]
            noise = tl.load(noise_row[:, None] + cols[None, :], mask=mask, other=1.0).to(tl.float32)
            # IEEE division, as in _race_rows_kernel.
            score_res = tl.where(residual > 0, tl.math.div_rn(residual, noise), -1.0)  # [BLOCK_B, BLOCK_V]
            score_q = tl.where(q > 0, tl.math.div_rn(q, noise), -1.0)
            block_best, block_id = tl.max(score_res, axis=1, return_indices=True)  # [BLOCK_B] x2
            is_better = block_best > best_res  # strict: ties keep the lower id
            best_res = tl.where(is_better, block_best, best_res)
            id_res = tl.where(is_better, block_id.to(tl.int64) + v0, id_res)
            block_best, block_id = tl.max(score_q, axis=1, return_indices=True)
            is_better = block_best > best_q
            best_q = tl.where(is_better, block_best, best_q)
            id_q = tl.where(is_better, block_id.to(tl.int64) + v0, id_q)
        token = tl.where(best_res >= 0, id_res, id_q)  # score >= 0 iff some residual > 0
        tl.store(out_ptr + rows * stride_out + pos, token, mask=is_active)


def _block_sizes(num_vocab: int) -> tuple[int, int]:
    """(rows, vocabulary columns) per program: one row per program for real
    vocabularies, many rows per program for tiny ones."""
    block_v = min(triton.next_power_of_2(max(num_vocab, 1)), 1024)
    return max(1, 1024 // block_v), block_v


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (one-hot drafts)
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor | None,  # [B, K] float32; read only with draft_probs
    exp_noise: torch.Tensor,  # [B, K+1, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """Triton launcher with the signature and results of :func:`rejection_sample_ref`."""
    assert HAS_TRITON, "rejection_sample_triton needs Triton"
    num_seqs, num_pos, num_vocab = target_probs.shape
    num_spec = num_pos - 1
    assert draft_token_ids.shape == (num_seqs, num_spec) and exp_noise.shape == target_probs.shape
    target_probs, exp_noise = target_probs.contiguous(), exp_noise.contiguous()
    draft_token_ids = draft_token_ids.contiguous()
    num_draft_tokens, is_greedy = num_draft_tokens.contiguous(), is_greedy.contiguous()
    assert target_probs.stride(2) == 1 and exp_noise.stride(2) == 1

    device = target_probs.device
    output = torch.full((num_seqs, num_pos), PAD_TOKEN_ID, dtype=torch.int64, device=device)  # [B, K+1]
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)  # [B]
    target_tokens = argmax_last(target_probs)  # [B, K+1], y_i of greedy rows
    block_b, block_v = _block_sizes(num_vocab)
    grid = (triton.cdiv(num_seqs, block_b),)
    draft_stride = max(draft_token_ids.stride(0), 1)  # K == 0: never read
    if draft_probs is None:  # y_i of random rows, then the one-hot rule for every row
        _race_rows_kernel[(triton.cdiv(num_seqs * num_pos, block_b),)](
            target_tokens,
            target_probs,
            exp_noise,
            num_draft_tokens,
            is_greedy,
            num_seqs * num_pos,
            num_vocab,
            target_probs.stride(1),
            exp_noise.stride(1),
            NUM_POS=num_pos,
            BLOCK_R=block_b,
            BLOCK_V=block_v,
        )
    _match_accept_kernel[grid](
        output,
        num_accepted,
        draft_token_ids,
        target_tokens,
        num_draft_tokens,
        is_greedy,
        num_seqs,
        output.stride(0),
        draft_stride,
        target_tokens.stride(0),
        NUM_SPEC=num_spec,
        GREEDY_ONLY=draft_probs is not None,
        BLOCK_B=block_b,
    )
    if draft_probs is not None:
        _launch_random(
            output,
            num_accepted,
            draft_token_ids,
            num_draft_tokens,
            is_greedy,
            target_probs,
            draft_probs.contiguous(),
            uniform_samples.contiguous(),
            exp_noise,
            grid,
            block_b,
            block_v,
        )
    return output, num_accepted + 1


def _launch_random(
    output,
    num_accepted,
    draft_token_ids,
    num_draft_tokens,
    is_greedy,
    target_probs,
    draft_probs,
    uniform_samples,
    exp_noise,
    grid,
    block_b,
    block_v,
) -> None:
    """The random rows of model drafts: accept kernel, then the last-token race."""
    num_spec, num_vocab = draft_token_ids.shape[1], target_probs.shape[2]
    assert draft_probs.stride(2) == 1 and uniform_samples.shape == draft_token_ids.shape
    draft_stride = max(draft_token_ids.stride(0), 1)
    _random_accept_kernel[grid](
        output,
        num_accepted,
        draft_token_ids,
        num_draft_tokens,
        is_greedy,
        target_probs,
        draft_probs,
        uniform_samples,
        output.shape[0],
        output.stride(0),
        draft_stride,
        target_probs.stride(0),
        target_probs.stride(1),
        draft_probs.stride(0),
        draft_probs.stride(1),
        max(uniform_samples.stride(0), 1),
        NUM_SPEC=num_spec,
        BLOCK_B=block_b,
    )
    _sample_last_token_kernel[grid](
        output,
        num_accepted,
        num_draft_tokens,
        is_greedy,
        target_probs,
        draft_probs,
        exp_noise,
        output.shape[0],
        num_vocab,
        output.stride(0),
        target_probs.stride(0),
        target_probs.stride(1),
        draft_probs.stride(0),
        draft_probs.stride(1),
        exp_noise.stride(0),
        exp_noise.stride(1),
        BLOCK_B=block_b,
        BLOCK_V=block_v,
    )


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (one-hot drafts)
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor | None,  # [B, K] float32; read only with draft_probs
    exp_noise: torch.Tensor,  # [B, K+1, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """The accept rule of the module docstring: Triton on an accelerator, else the reference."""
    sample = rejection_sample_triton if use_triton(target_probs) else rejection_sample_ref
    return sample(target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, uniform_samples, exp_noise)
