"""Rejection sampling for speculative decoding: Triton kernels + PyTorch reference.

Accept rule, for each sequence b with n = num_draft_tokens[b] drafts x_0..x_{n-1}:

    for i in 0..n-1:
        random rows: accept x_i  iff  u_i < min(1, q_i(x_i) / p_i(x_i))
        greedy rows: accept x_i  iff  x_i == argmax q_i
        on the first rejection j: emit a recovered token sampled from
            normalize(max(q_j - p_j, 0))   (falls back to q_j if that is all 0;
            greedy rows: argmax q_j) and stop
    if all n drafts are accepted: emit a bonus token sampled from q_n
        (position n, the sequence's own next position; greedy: argmax q_n)

q is the target distribution, p the draft's (one-hot on x_i for n-gram
drafts, ``draft_probs is None``). The comparison is evaluated as
``u * p(x) < q(x)``: for p(x) > 0 and u < 1 this is exactly
``u < min(1, q(x)/p(x))``, and it needs no division, so p(x) = 0 accepts iff
q(x) > 0 and q(x) = 0 always rejects, with no NaN.

Sampling is the exponential race ``argmax_v dist[v] / exp_noise[b, v]``, which
needs no normalisation (the argmax is scale-invariant); tokens with
``dist[v] == 0`` score -1 so they are never picked while any mass remains.
Ties go to the lowest token id in both implementations.

Outputs: ``output_token_ids`` [B, K+1] int64, the emitted tokens followed by
-1 padding, and ``num_emitted`` [B] int64 in 1..n+1 (accepted drafts =
num_emitted - 1).
"""

import torch

from kernels._triton import HAS_TRITON, use_triton

PAD_TOKEN_ID = -1


# ---------------------------------------------------------------- reference


def _race(dist: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: ``argmax(dist / noise)``, zero-mass tokens scoring -1."""
    score = torch.where(dist > 0, dist / noise, torch.full_like(dist, -1.0))  # [B, V]
    return score.argmax(dim=-1)  # [B]


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64, padded past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None for n-gram drafts
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor,  # [B, K] float32 in [0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32 Exp(1)
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """Vectorised PyTorch reference of the accept rule in the module docstring."""
    num_seqs, num_spec = draft_token_ids.shape
    rows = torch.arange(num_seqs, device=target_probs.device)  # [B]
    positions = torch.arange(num_spec, device=target_probs.device)  # [K]
    is_draft = positions < num_draft_tokens.unsqueeze(1)  # [B, K]
    draft_ids = torch.where(is_draft, draft_token_ids, 0)  # [B, K], padding made a safe index
    target_argmax = target_probs.argmax(dim=-1)  # [B, K+1]

    q_x = target_probs[:, :num_spec].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        p_x = torch.ones_like(q_x)  # [B, K]
    else:
        p_x = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    is_accepted = torch.where(
        is_greedy.unsqueeze(1), draft_ids == target_argmax[:, :num_spec], uniform_samples * p_x < q_x
    ) & is_draft  # [B, K]
    num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)  # [B], the accepted prefix

    # The one sampled token sits at position num_accepted: recovered if a draft
    # was rejected there, bonus if all drafts were accepted.
    is_recovery = num_accepted < num_draft_tokens  # [B]
    q_last = target_probs[rows, num_accepted]  # [B, V]
    last_pos = num_accepted.clamp(max=max(num_spec - 1, 0))  # [B], safe index into [K]
    if draft_probs is None:
        p_last = torch.zeros_like(q_last)  # [B, V]
        if num_spec > 0:
            x_last = draft_ids[rows, last_pos].unsqueeze(1)  # [B, 1]
            p_last.scatter_(1, x_last, q_last.gather(1, x_last))  # one-hot p: zero q at x
    else:
        p_last = draft_probs[rows, last_pos] if num_spec > 0 else torch.zeros_like(q_last)  # [B, V]
    p_last = p_last * is_recovery.unsqueeze(1)  # [B, V], bonus samples q itself
    residual = (q_last - p_last).clamp_min(0.0)  # [B, V]
    has_residual = (residual > 0).any(dim=1, keepdim=True)  # [B, 1]
    sampled = _race(torch.where(has_residual, residual, q_last), exp_noise)  # [B]
    last_token = torch.where(is_greedy, target_argmax[rows, num_accepted], sampled)  # [B]

    output = torch.where(positions < num_accepted.unsqueeze(1), draft_ids, PAD_TOKEN_ID)  # [B, K]
    output = torch.cat([output, output.new_full((num_seqs, 1), PAD_TOKEN_ID)], dim=1)  # [B, K+1]
    output[rows, num_accepted] = last_token
    return output, num_accepted + 1


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    from kernels._triton import tl, triton

    @triton.jit
    def _greedy_accept_kernel(
        out_ptr, num_accepted_ptr, draft_ptr, target_argmax_ptr, num_draft_ptr, is_greedy_ptr,
        num_seqs, stride_out, stride_draft, stride_argmax,
        NUM_SPEC: tl.constexpr, BLOCK_B: tl.constexpr,
    ):
        """Greedy rows: emit argmax q_i while it equals the draft, the argmax at the
        first mismatch (recovered), or the argmax at position n (bonus)."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = (rows < num_seqs) & (tl.load(is_greedy_ptr + rows, mask=rows < num_seqs, other=0) != 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_accepting = is_active  # [BLOCK_B], still inside the accepted prefix
        num_accepted = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for i in range(NUM_SPEC):
            is_live = is_accepting & (i < num_draft)  # [BLOCK_B], x_i is a real, undecided draft
            draft = tl.load(draft_ptr + rows * stride_draft + i, mask=is_live, other=0)  # [BLOCK_B]
            argmax = tl.load(target_argmax_ptr + rows * stride_argmax + i, mask=is_live, other=0)  # [BLOCK_B]
            tl.store(out_ptr + rows * stride_out + i, argmax, mask=is_live)
            is_accepting = is_live & (draft == argmax)
            num_accepted += is_accepting.to(tl.int64)
        is_bonus = is_active & (num_accepted == num_draft)
        bonus = tl.load(target_argmax_ptr + rows * stride_argmax + num_draft, mask=is_bonus, other=0)
        tl.store(out_ptr + rows * stride_out + num_draft, bonus, mask=is_bonus)
        tl.store(num_accepted_ptr + rows, num_accepted, mask=is_active)

    @triton.jit
    def _random_accept_kernel(
        out_ptr, num_accepted_ptr, draft_ptr, num_draft_ptr, is_greedy_ptr,
        target_probs_ptr, draft_probs_ptr, uniform_ptr,
        num_seqs, stride_out, stride_draft, stride_qb, stride_qk, stride_pb, stride_pk, stride_u,
        NUM_SPEC: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_B: tl.constexpr,
    ):
        """Random rows: accept x_i while ``u_i * p_i(x_i) < q_i(x_i)``; write the
        accepted prefix and its length (the last token is sampled separately)."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = (rows < num_seqs) & (tl.load(is_greedy_ptr + rows, mask=rows < num_seqs, other=1) == 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_accepting = is_active  # [BLOCK_B], still inside the accepted prefix
        num_accepted = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for i in range(NUM_SPEC):
            is_live = is_accepting & (i < num_draft)  # [BLOCK_B], x_i is a real, undecided draft
            draft = tl.load(draft_ptr + rows * stride_draft + i, mask=is_live, other=0)  # [BLOCK_B]
            q_ptrs = target_probs_ptr + rows * stride_qb + i * stride_qk + draft  # [BLOCK_B]
            q_x = tl.load(q_ptrs, mask=is_live, other=0.0)  # [BLOCK_B]
            if HAS_DRAFT_PROBS:
                p_ptrs = draft_probs_ptr + rows * stride_pb + i * stride_pk + draft  # [BLOCK_B]
                p_x = tl.load(p_ptrs, mask=is_live, other=1.0)  # [BLOCK_B]
            else:
                p_x = tl.full([BLOCK_B], 1.0, tl.float32)
            u = tl.load(uniform_ptr + rows * stride_u + i, mask=is_live, other=1.0)  # [BLOCK_B]
            # u < min(1, q(x) / p(x)), written without a division (module docstring).
            is_accepting = is_live & (u.to(tl.float32) * p_x.to(tl.float32) < q_x.to(tl.float32))
            tl.store(out_ptr + rows * stride_out + i, draft, mask=is_accepting)
            num_accepted += is_accepting.to(tl.int64)
        tl.store(num_accepted_ptr + rows, num_accepted, mask=is_active)

    @triton.jit
    def _sample_last_token_kernel(
        out_ptr, num_accepted_ptr, draft_ptr, num_draft_ptr, is_greedy_ptr,
        target_probs_ptr, draft_probs_ptr, noise_ptr,
        num_seqs, num_vocab, stride_out, stride_draft, stride_qb, stride_qk, stride_pb, stride_pk,
        stride_noise,
        HAS_DRAFT_PROBS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """Random rows: race over max(q_j - p_j, 0) at j = num_accepted (q_j itself
        for the bonus, or when the residual is all zero) and write the winner."""
        rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [BLOCK_B]
        is_active = (rows < num_seqs) & (tl.load(is_greedy_ptr + rows, mask=rows < num_seqs, other=1) == 0)
        num_draft = tl.load(num_draft_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        pos = tl.load(num_accepted_ptr + rows, mask=is_active, other=0)  # [BLOCK_B]
        is_recovery = is_active & (pos < num_draft)  # [BLOCK_B], else bonus
        draft = tl.load(draft_ptr + rows * stride_draft + pos, mask=is_recovery, other=-1)  # [BLOCK_B]
        q_row = target_probs_ptr + rows * stride_qb + pos * stride_qk  # [BLOCK_B] pointers
        p_row = draft_probs_ptr + rows * stride_pb + pos * stride_pk  # [BLOCK_B] pointers
        # Running race winners over the residual and, for the fallback, over q.
        best_res = tl.full([BLOCK_B], -2.0, tl.float32)  # [BLOCK_B], below any score
        best_q = tl.full([BLOCK_B], -2.0, tl.float32)  # [BLOCK_B]
        id_res = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        id_q = tl.zeros([BLOCK_B], dtype=tl.int64)  # [BLOCK_B]
        for v0 in range(0, num_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            mask = is_active[:, None] & (cols < num_vocab)[None, :]  # [BLOCK_B, BLOCK_V]
            q = tl.load(q_row[:, None] + cols[None, :], mask=mask, other=0.0)  # [BLOCK_B, BLOCK_V]
            q = q.to(tl.float32)
            if HAS_DRAFT_PROBS:
                p = tl.load(p_row[:, None] + cols[None, :], mask=mask & is_recovery[:, None], other=0.0)
                p = p.to(tl.float32)
            else:  # one-hot p: subtracting q(x) at x zeroes it
                p = tl.where(is_recovery[:, None] & (cols[None, :] == draft[:, None]), q, 0.0)
            residual = tl.maximum(q - p, 0.0)  # [BLOCK_B, BLOCK_V]
            noise = tl.load(noise_ptr + rows[:, None] * stride_noise + cols[None, :], mask=mask, other=1.0)
            noise = noise.to(tl.float32)
            # IEEE division (plain `/` may be approximate on GPUs) keeps ties and
            # near-ties identical to the reference.
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
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (n-gram)
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor,  # [B, K] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """Triton launcher with the signature and results of :func:`rejection_sample_ref`."""
    assert HAS_TRITON, "rejection_sample_triton needs Triton"
    num_seqs, num_spec_plus_one, num_vocab = target_probs.shape
    num_spec = num_spec_plus_one - 1
    assert draft_token_ids.shape == (num_seqs, num_spec) and exp_noise.shape == (num_seqs, num_vocab)
    target_probs, exp_noise = target_probs.contiguous(), exp_noise.contiguous()
    draft_token_ids, uniform_samples = draft_token_ids.contiguous(), uniform_samples.contiguous()
    num_draft_tokens, is_greedy = num_draft_tokens.contiguous(), is_greedy.contiguous()
    has_draft_probs = draft_probs is not None
    draft_probs = draft_probs.contiguous() if has_draft_probs else target_probs  # dummy pointer
    assert target_probs.stride(2) == 1 and draft_probs.stride(2) == 1 and exp_noise.stride(1) == 1

    device = target_probs.device
    output = torch.full((num_seqs, num_spec + 1), PAD_TOKEN_ID, dtype=torch.int64, device=device)  # [B, K+1]
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)  # [B]
    target_argmax = target_probs.argmax(dim=-1)  # [B, K+1]
    block_b, block_v = _block_sizes(num_vocab)
    grid = (triton.cdiv(num_seqs, block_b),)
    draft_stride = max(draft_token_ids.stride(0), 1)  # K == 0: never read
    _greedy_accept_kernel[grid](
        output, num_accepted, draft_token_ids, target_argmax, num_draft_tokens, is_greedy,
        num_seqs, output.stride(0), draft_stride, target_argmax.stride(0),
        NUM_SPEC=num_spec, BLOCK_B=block_b,
    )
    _random_accept_kernel[grid](
        output, num_accepted, draft_token_ids, num_draft_tokens, is_greedy,
        target_probs, draft_probs, uniform_samples,
        num_seqs, output.stride(0), draft_stride, target_probs.stride(0), target_probs.stride(1),
        draft_probs.stride(0), draft_probs.stride(1), max(uniform_samples.stride(0), 1),
        NUM_SPEC=num_spec, HAS_DRAFT_PROBS=has_draft_probs, BLOCK_B=block_b,
    )
    _sample_last_token_kernel[grid](
        output, num_accepted, draft_token_ids, num_draft_tokens, is_greedy,
        target_probs, draft_probs, exp_noise,
        num_seqs, num_vocab, output.stride(0), draft_stride, target_probs.stride(0), target_probs.stride(1),
        draft_probs.stride(0), draft_probs.stride(1), exp_noise.stride(0),
        HAS_DRAFT_PROBS=has_draft_probs, BLOCK_B=block_b, BLOCK_V=block_v,
    )
    return output, num_accepted + 1


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (n-gram)
    is_greedy: torch.Tensor,  # [B] bool
    uniform_samples: torch.Tensor,  # [B, K] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K+1] int64, [B] int64
    """The accept rule of the module docstring: Triton on an accelerator, else the reference."""
    sample = rejection_sample_triton if use_triton(target_probs) else rejection_sample_ref
    return sample(
        target_probs, draft_token_ids, num_draft_tokens, draft_probs, is_greedy, uniform_samples, exp_noise
    )
