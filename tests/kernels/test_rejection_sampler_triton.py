"""Rejection-sampling Triton kernels vs the PyTorch reference (on `triton_device`: interpreted on a CPU, or CUDA)."""

import pytest
import torch

from kernels._triton import HAS_TRITON
from kernels.rejection_sampler import rejection_sample_ref, rejection_sample_triton

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


def random_case(num_seqs: int, num_spec: int, num_vocab: int, has_draft_probs: bool, seed: int, device: str) -> tuple:
    """Mixed greedy / random rows, proposal lengths 0..K, -1 padding, zeros in q,
    rows with p == q, and drafts that are often the target's argmax so every
    path runs."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(num_seqs, num_spec + 1, num_vocab, generator=gen)  # [B, K+1, V]
    target = torch.softmax(logits, dim=-1)  # [B, K+1, V]
    target = torch.where(target < 0.5 / num_vocab, 0.0, target)
    target = target / target.sum(dim=-1, keepdim=True)
    draft_logits = torch.randn(num_seqs, num_spec, num_vocab, generator=gen)  # [B, K, V]
    draft_probs = torch.softmax(draft_logits, dim=-1)  # [B, K, V]
    is_exact_draft = (torch.arange(num_seqs) % 4 == 0).view(-1, 1, 1)  # p == q: all-zero residuals
    draft_probs = torch.where(is_exact_draft, target[:, :num_spec], draft_probs)
    random_drafts = torch.randint(0, num_vocab, (num_seqs, num_spec), generator=gen)  # [B, K]
    is_likely = torch.rand(num_seqs, num_spec, generator=gen) < 0.7  # [B, K]
    drafts = torch.where(is_likely, target[:, :num_spec].argmax(dim=-1), random_drafts)  # [B, K]
    num_draft = torch.randint(0, num_spec + 1, (num_seqs,), generator=gen)  # [B]
    drafts = torch.where(torch.arange(num_spec) < num_draft.unsqueeze(1), drafts, -1)  # [B, K]
    is_greedy = torch.rand(num_seqs, generator=gen) < 0.3  # [B]
    uniform = torch.rand(num_seqs, num_spec, generator=gen)  # [B, K]
    noise = torch.empty(num_seqs, num_spec + 1, num_vocab).exponential_(generator=gen)  # [B, K+1, V]
    args = (target, drafts, num_draft, draft_probs if has_draft_probs else None, is_greedy, uniform, noise)
    return tuple(a.to(device) if a is not None else None for a in args)


@pytest.mark.parametrize("has_draft_probs", [True, False])
@pytest.mark.parametrize(
    "num_seqs, num_spec, num_vocab",
    [(300, 3, 6), (40, 0, 6), (50, 1, 7), (12, 4, 1500)],  # many rows per program; K = 0; 2 vocab blocks
)
def test_triton_matches_reference(num_seqs, num_spec, num_vocab, has_draft_probs, triton_device):
    args = random_case(num_seqs, num_spec, num_vocab, has_draft_probs, seed=num_seqs + num_spec, device=triton_device)
    want_tokens, want_emitted = rejection_sample_ref(*args)
    got_tokens, got_emitted = rejection_sample_triton(*args)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_emitted, want_emitted)
    num_draft = args[2]
    if num_spec > 0:  # both the recovered and the bonus paths ran
        assert bool((want_emitted <= num_draft).any()) and bool((want_emitted == num_draft + 1).any())


def test_triton_one_hot_drafts_emit_each_positions_race_winner(triton_device):
    target, drafts, num_draft, _, is_greedy, _, noise = random_case(64, 3, 40, False, seed=8, device=triton_device)
    want = rejection_sample_ref(target, drafts, num_draft, None, is_greedy, None, noise)[0]
    raced = torch.where(target > 0, target / noise, -1.0).argmax(dim=-1)  # [B, K+1]
    y = torch.where(is_greedy.unsqueeze(1), target.argmax(dim=-1), raced)  # [B, K+1]
    output, num_emitted = rejection_sample_triton(target, drafts, num_draft, None, is_greedy, None, noise)
    assert torch.equal(output, want)
    for b in range(64):  # every emitted token is y at its position; the drafts before it matched
        n = int(num_emitted[b])
        assert output[b, :n].tolist() == y[b, :n].tolist()
        assert drafts[b, : n - 1].tolist() == y[b, : n - 1].tolist()
        assert n == int(num_draft[b]) + 1 or int(drafts[b, n - 1]) != int(y[b, n - 1])


def test_triton_greedy_exact_match_semantics(triton_device):
    argmax = torch.tensor([[3, 1, 4, 0], [3, 1, 4, 0], [2, 2, 5, 1], [0, 5, 5, 3]])  # [B, K+1]
    target = (torch.eye(6)[argmax] * 0.5 + 0.1).to(triton_device)  # [B, K+1, V=6]
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4], [2, 2, 5], [4, -1, -1]], device=triton_device)  # [B, K]
    num_draft = torch.tensor([3, 3, 2, 0], device=triton_device)  # [B]
    is_greedy = torch.ones(4, dtype=torch.bool, device=triton_device)
    output, num_emitted = rejection_sample_triton(
        target,
        drafts,
        num_draft,
        None,
        is_greedy,
        torch.rand(4, 3, device=triton_device),
        torch.ones(4, 4, 6, device=triton_device),
    )
    assert output.tolist() == [[3, 1, 4, 0], [3, 1, -1, -1], [2, 2, 5, -1], [0, -1, -1, -1]]
    assert num_emitted.tolist() == [4, 2, 3, 1]


def test_triton_ties_go_to_the_lowest_token_id(triton_device):
    # Equal scores in different vocabulary blocks (V = 1500, blocks of 1024).
    target = torch.zeros(2, 1, 1500)  # [B=2, K+1=1, V]
    target[:, 0, [1300, 7, 1100]] = 1 / 3
    args = (
        target,
        torch.zeros(2, 0, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        None,
        torch.tensor([False, True]),
        torch.zeros(2, 0),
        torch.ones(2, 1, 1500),
    )
    args = tuple(a.to(triton_device) if a is not None else None for a in args)
    assert rejection_sample_triton(*args)[0][:, 0].tolist() == [7, 7]
    assert rejection_sample_ref(*args)[0][:, 0].tolist() == [7, 7]


# Target q_i / draft p_i with q(x) = 0 where p(x) > 0 and the reverse.
Q = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.00, 0.40, 0.15, 0.20, 0.20],
        [0.00, 0.50, 0.10, 0.10, 0.00, 0.30],
    ]
)  # [K+1=3, V=6]
P = torch.tensor([[0.10, 0.00, 0.40, 0.20, 0.10, 0.20], [0.30, 0.30, 0.10, 0.10, 0.20, 0.00]])  # [K=2, V]


@pytest.mark.parametrize("has_draft_probs", [True, False])
def test_triton_is_lossless(has_draft_probs, triton_device):
    num_trials, num_spec = 4096, 2
    gen = torch.Generator().manual_seed(5)
    if has_draft_probs:
        drafts = torch.multinomial(P, num_trials, replacement=True, generator=gen).T  # [N, K], x_i ~ p_i
    else:
        drafts = torch.tensor([0, 5]).expand(num_trials, -1)  # [N, K], n-gram guesses (q_1(5) > 0)
    num_draft = torch.randint(0, num_spec + 1, (num_trials,), generator=gen)  # [N]
    output, num_emitted = rejection_sample_triton(
        Q.expand(num_trials, -1, -1).to(triton_device),
        drafts.to(triton_device),
        num_draft.to(triton_device),
        P.expand(num_trials, -1, -1).to(triton_device) if has_draft_probs else None,
        torch.zeros(num_trials, dtype=torch.bool, device=triton_device),
        torch.rand(num_trials, num_spec, generator=gen).to(triton_device),
        torch.empty(num_trials, num_spec + 1, 6).exponential_(generator=gen).to(triton_device),
    )
    output, num_emitted = output.cpu(), num_emitted.cpu()
    for i in range(num_spec + 1):
        tokens = output[num_emitted > i, i]  # [N_i]
        empirical = torch.bincount(tokens, minlength=6).float() / tokens.numel()  # [V]
        bound = 0.05 * max(1.0, (num_trials / tokens.numel()) ** 0.5)
        assert 0.5 * float((empirical - Q[i]).abs().sum()) < bound, f"position {i}"
