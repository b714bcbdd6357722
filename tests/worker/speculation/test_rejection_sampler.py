"""Rejection sampler (PyTorch reference path) with keyed randomness: lossless sampling over many
seeds, greedy semantics, n-gram drafts that emit the plain step's samples, and strict input validation."""

import pytest
import torch

from kernels.rejection_sampler import rejection_sample_ref
from worker_service.speculation.keyed_random import STREAM_TOKEN
from worker_service.speculation.rejection_sampler import RejectionSampler, num_accepted_drafts, rejection_sample
from worker_service.speculation.sampling import sample_from_probs

NUM_TRIALS = 100_000
V = 6
POSITION = 1000  # every trial samples the same positions; the seeds differ
# Target q_i and draft p_i per position, with q(x) = 0 where p(x) > 0 and the reverse.
Q = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.00, 0.40, 0.15, 0.20, 0.20],
        [0.00, 0.50, 0.10, 0.10, 0.00, 0.30],
        [0.25, 0.25, 0.00, 0.25, 0.25, 0.00],
    ]
)  # [K_max+1=4, V]
P = torch.tensor(
    [
        [0.10, 0.00, 0.40, 0.20, 0.10, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.20, 0.00],
        [0.20, 0.20, 0.20, 0.20, 0.00, 0.20],
    ]
)  # [K_max=3, V]


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """TV distance between the empirical distribution of ``tokens`` [N] and ``probs`` [V]."""
    empirical = torch.bincount(tokens, minlength=probs.shape[0]).float() / tokens.numel()  # [V]
    return 0.5 * float((empirical - probs).abs().sum())


def tolerance(num_samples: int) -> float:
    """TV bound: 0.01 at 100k samples, growing as 1/sqrt(n) for fewer."""
    return max(0.01, 0.01 * (NUM_TRIALS / num_samples) ** 0.5)


def check_positions_follow_q(output: torch.Tensor, num_emitted: torch.Tensor, q: torch.Tensor) -> None:
    """Every emitted position i (rows with num_emitted > i) is distributed as q_i."""
    for i in range(q.shape[0]):
        tokens = output[num_emitted > i, i]  # [N_i]
        assert bool((tokens >= 0).all())
        assert total_variation(tokens, q[i]) < tolerance(tokens.numel()), f"position {i}"


def sample_drafts(num_spec: int, num_trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts x_i ~ p_i [N, K] and per-row proposal lengths in 0..K [N]."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(P[:num_spec], num_trials, replacement=True, generator=gen).T  # [N, K]
    num_draft = torch.randint(0, num_spec + 1, (num_trials,), generator=gen)  # [N]
    drafts = torch.where(torch.arange(num_spec) < num_draft.unsqueeze(1), drafts, -1)  # [N, K], -1 padded
    return drafts, num_draft


def many_seeds(num: int, offset: int) -> list[int]:
    """Distinct seeds spread over the 64-bit range (both halves of the key vary)."""
    return [(offset + i * 0x9E3779B97F4A7C15) % 2**64 for i in range(num)]


@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_lossless_with_draft_probs(num_spec):
    drafts, num_draft = sample_drafts(num_spec, NUM_TRIALS, seed=num_spec)
    target = Q[: num_spec + 1].expand(NUM_TRIALS, -1, -1)  # [N, K+1, V]
    draft_probs = P[:num_spec].expand(NUM_TRIALS, -1, -1)  # [N, K, V]
    output, num_emitted = RejectionSampler(strict=True)(
        target,
        drafts,
        num_draft,
        draft_probs,
        torch.zeros(NUM_TRIALS, dtype=torch.bool),
        many_seeds(NUM_TRIALS, 100 + num_spec),
        [POSITION] * NUM_TRIALS,
    )
    assert bool(((num_emitted >= 1) & (num_emitted <= num_draft + 1)).all())
    assert int((num_emitted < num_draft + 1).sum()) > NUM_TRIALS // 10  # the recovery path ran
    check_positions_follow_q(output, num_emitted, Q[: num_spec + 1])


@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_lossless_with_ngram_drafts(num_spec):
    # Fixed n-gram guesses per position, one set per half of the rows; the second
    # set has q_i(x_i) = 0 everywhere, so those rows always reject their first draft.
    guesses = torch.tensor([[0, 2, 1], [5, 1, 4]])[:, :num_spec]  # [2, K]
    _, num_draft = sample_drafts(num_spec, NUM_TRIALS, seed=10 + num_spec)
    is_zero_guess = torch.arange(NUM_TRIALS) % 2 == 1  # [N]
    drafts = guesses[is_zero_guess.long()]  # [N, K]
    drafts = torch.where(torch.arange(num_spec) < num_draft.unsqueeze(1), drafts, -1)  # [N, K]
    target = Q[: num_spec + 1].expand(NUM_TRIALS, -1, -1)  # [N, K+1, V]
    output, num_emitted = RejectionSampler(strict=True)(
        target,
        drafts,
        num_draft,
        None,
        torch.zeros(NUM_TRIALS, dtype=torch.bool),
        many_seeds(NUM_TRIALS, 200 + num_spec),
        [POSITION] * NUM_TRIALS,
    )
    assert bool((num_emitted[is_zero_guess] == 1).all())
    assert not bool((output[is_zero_guess & (num_draft > 0), 0] == 5).any())
    is_accepted = ~is_zero_guess & (num_emitted > 1)  # [N]
    assert abs(float(is_accepted[~is_zero_guess & (num_draft > 0)].float().mean()) - float(Q[0, 0])) < 0.01
    check_positions_follow_q(output, num_emitted, Q[: num_spec + 1])


def test_ngram_drafts_emit_the_plain_steps_samples():
    """With one-hot drafts every emitted token is the keyed sample a plain step draws at that position."""
    gen = torch.Generator().manual_seed(3)
    num_seqs, num_spec, num_vocab = 64, 3, 5
    target = torch.softmax(torch.randn(num_seqs, num_spec + 1, num_vocab, generator=gen), dim=-1)  # [B, K+1, V]
    seeds, positions = many_seeds(num_seqs, 9), [17 + b for b in range(num_seqs)]
    plain = torch.stack(
        [  # [B, K+1]: what plain steps would sample at positions n..n+K
            sample_from_probs(target[:, i], seeds, [p + i for p in positions], STREAM_TOKEN)
            for i in range(num_spec + 1)
        ],
        dim=1,
    )
    # Drafts that are right about half the time, so accepted prefixes of every length occur.
    guesses = torch.randint(0, num_vocab, (num_seqs, num_spec), generator=gen)  # [B, K]
    drafts = torch.where(torch.rand(num_seqs, num_spec, generator=gen) < 0.5, plain[:, :num_spec], guesses)
    output, num_emitted = RejectionSampler(strict=True)(
        target,
        drafts,
        torch.full((num_seqs,), num_spec),
        None,
        torch.zeros(num_seqs, dtype=torch.bool),
        seeds,
        positions,
    )
    for b in range(num_seqs):
        n = int(num_emitted[b])
        assert output[b, :n].tolist() == plain[b, :n].tolist()
    assert len(set(num_emitted.tolist())) == num_spec + 1  # every accepted length 0..K occurred


@pytest.mark.parametrize("one_hot_draft_probs", [True, False])
def test_bonus_token_follows_q_at_position_k(one_hot_draft_probs):
    num_spec = 3
    concentrated = torch.full((num_spec + 1, V), 0.02)  # [K+1, V]
    concentrated[torch.arange(num_spec + 1), torch.tensor([1, 4, 0, 2])] = 0.9
    concentrated[num_spec] = Q[0]  # the bonus distribution
    drafts = concentrated[:num_spec].argmax(dim=-1).expand(NUM_TRIALS, -1)  # [N, K]
    draft_probs = torch.eye(V)[drafts] if one_hot_draft_probs else None  # [N, K, V]
    torch.manual_seed(7)
    output, num_emitted = rejection_sample(
        concentrated.expand(NUM_TRIALS, -1, -1),
        drafts,
        torch.full((NUM_TRIALS,), num_spec),
        draft_probs,
        torch.zeros(NUM_TRIALS, dtype=torch.bool),
        torch.rand(NUM_TRIALS, num_spec),
        torch.empty(NUM_TRIALS, num_spec + 1, V).exponential_(),
    )
    is_all_accepted = num_emitted == num_spec + 1  # [N]
    assert abs(float(is_all_accepted.float().mean()) - 0.9**num_spec) < 0.01
    assert torch.equal(output[is_all_accepted, :num_spec], drafts[is_all_accepted])
    assert total_variation(output[is_all_accepted, num_spec], Q[0]) < tolerance(int(is_all_accepted.sum()))


def test_zero_draft_or_target_probability():
    # Row 0: p(x) = 0 < q(x) -> always accepted. Row 1: q(x) = 0 -> always rejected.
    # Row 2: p(x) = q(x) = 0 -> rejected. Row 3: the same with p == q, so the
    # residual max(q - p, 0) is all zero and the recovered token comes from q.
    target = torch.tensor([[0.5, 0.5, 0.0]]).expand(4, 2, 3)  # [B=4, K+1=2, V=3]
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]], [[0.5, 0.5, 0.0]]])
    drafts = torch.tensor([[0], [2], [2], [2]])  # [B, K=1]
    noise = torch.tensor([[1.0, 0.1, 1.0]]).expand(4, 2, 3)  # [B, K+1, V], makes token 1 win a race over q
    for u in [1e-7, 0.5, 0.999]:
        output, num_emitted = rejection_sample_ref(
            target,
            drafts,
            torch.ones(4, dtype=torch.int64),
            draft_probs,
            torch.zeros(4, dtype=torch.bool),
            torch.full((4, 1), u),
            noise,
        )
        assert num_emitted.tolist() == [2, 1, 1, 1]
        assert output[:, 0].tolist() == [0, 1, 1, 1]


def test_the_last_token_reads_the_noise_of_its_own_position():
    target = torch.full((1, 3, 4), 0.25)  # [B=1, K+1=3, V=4]
    noise = torch.ones(1, 3, 4)  # [B, K+1, V]
    noise[0, 0, 1], noise[0, 1, 2], noise[0, 2, 3] = 0.1, 0.1, 0.1  # each position's race has its own winner
    drafts = torch.tensor([[1, 2]])  # [B, K=2], drafts equal to the race winners: all accepted
    for draft_probs in (None, torch.full((1, 2, 4), 0.25)):
        output, _ = rejection_sample_ref(
            target, drafts, torch.tensor([2]), draft_probs, torch.tensor([False]), torch.full((1, 2), 0.5), noise
        )
        assert output.tolist() == [[1, 2, 3]]  # the bonus token from position 2's noise


def test_greedy_exact_match_semantics():
    argmax = torch.tensor([[3, 1, 4, 0], [3, 1, 4, 0], [2, 2, 5, 1], [0, 5, 5, 3], [1, 2, 3, 4]])  # [B, K+1]
    target = torch.eye(V)[argmax] * 0.5 + 0.1  # [B, K+1, V], not one-hot: the argmax decides
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4], [2, 2, 5], [4, 4, 4], [1, -1, -1]])  # [B, K]
    num_draft = torch.tensor([3, 3, 2, 0, 1])  # [B]
    for draft_probs in (None, torch.full((5, 3, V), 1.0 / V)):
        output, num_emitted = RejectionSampler(strict=True)(
            target, drafts, num_draft, draft_probs, torch.ones(5, dtype=torch.bool), [1, 2, 3, 4, 5], [9] * 5
        )
        assert output.tolist() == [
            [3, 1, 4, 0],  # all accepted + bonus argmax q_3
            [3, 1, -1, -1],  # mismatch at 1: recovered = argmax q_1
            [2, 2, 5, -1],  # 2 drafts accepted: bonus from q_2, not q_K
            [0, -1, -1, -1],  # no drafts: argmax q_0
            [1, 2, -1, -1],  # one draft accepted + bonus argmax q_1
        ]
        assert num_emitted.tolist() == [4, 2, 3, 1, 2]
        assert num_accepted_drafts(num_emitted).tolist() == [3, 1, 2, 0, 1]


def test_random_row_without_drafts_emits_one_token_from_q0():
    target = Q[:3].expand(NUM_TRIALS, -1, -1)  # [N, K+1=3, V]
    drafts = torch.full((NUM_TRIALS, 2), -1)  # [N, K]
    output, num_emitted = RejectionSampler(strict=True)(
        target,
        drafts,
        torch.zeros(NUM_TRIALS, dtype=torch.int64),
        P[:2].expand(NUM_TRIALS, -1, -1),
        torch.zeros(NUM_TRIALS, dtype=torch.bool),
        many_seeds(NUM_TRIALS, 3),
        [POSITION] * NUM_TRIALS,
    )
    assert bool((num_emitted == 1).all()) and bool((output[:, 1:] == -1).all())
    assert total_variation(output[:, 0], Q[0]) < tolerance(NUM_TRIALS)


@pytest.mark.parametrize("has_draft_probs", [True, False])
def test_seeded_rows_do_not_depend_on_the_batch(has_draft_probs):
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(3, 5, 50, generator=gen), dim=-1)  # [B=3, K_max+1=5, V]
    draft_probs = torch.softmax(torch.randn(3, 4, 50, generator=gen), dim=-1)  # [B, K_max, V]
    drafts = target[:, :4].argmax(dim=-1)  # [B, K_max], likely drafts: both paths run
    sampler = RejectionSampler(strict=True)
    outputs = []
    for position in range(40, 60):
        alone = sampler(
            target[2:, :3],
            drafts[2:, :2],
            torch.tensor([2]),
            draft_probs[2:, :2] if has_draft_probs else None,
            torch.tensor([False]),
            [11],
            [position],
        )
        # The same row in a bigger batch, padded to K = 4 by its neighbours.
        batch = sampler(
            target,
            drafts,
            torch.tensor([4, 0, 2]),
            draft_probs if has_draft_probs else None,
            torch.tensor([False, True, False]),
            [7, 5, 11],
            [3, 99, position],
        )
        assert int(alone[1][0]) == int(batch[1][2])
        assert torch.equal(alone[0][0, :3], batch[0][2, :3])
        again = sampler(
            target[2:, :3],
            drafts[2:, :2],
            torch.tensor([2]),
            draft_probs[2:, :2] if has_draft_probs else None,
            torch.tensor([False]),
            [11],
            [position],
        )
        assert torch.equal(again[0], alone[0])  # a pure function of (seed, position)
        outputs.append(tuple(alone[0][0].tolist()))
    assert len(set(outputs)) > 1  # the position is part of the key


def test_dispatcher_uses_the_reference_on_cpu():
    drafts, num_draft = sample_drafts(2, 1000, seed=4)
    args = (
        Q[:3].expand(1000, -1, -1),
        drafts,
        num_draft,
        P[:2].expand(1000, -1, -1),
        torch.rand(1000) < 0.5,
        torch.rand(1000, 2),
        torch.empty(1000, 3, V).exponential_(),
    )
    for got, want in zip(rejection_sample(*args), rejection_sample_ref(*args)):
        assert torch.equal(got, want)


def valid_inputs() -> dict:
    """A small valid batch: B=2, K=2, V=6."""
    return {
        "target_probs": Q[:3].expand(2, -1, -1).clone(),
        "draft_token_ids": torch.tensor([[1, 2], [3, -1]]),
        "num_draft_tokens": torch.tensor([2, 1]),
        "draft_probs": P[:2].expand(2, -1, -1).clone(),
        "is_greedy": torch.tensor([False, True]),
        "seeds": [1, 2**64 - 1],
        "positions": [10, 20],
    }


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("target_probs", Q[:3], "target_probs must be"),
        ("draft_token_ids", torch.tensor([[1, 2, 3], [3, 0, 0]]), "draft_token_ids must have shape"),
        ("draft_probs", P[:1].expand(2, -1, -1), "draft_probs must have shape"),
        ("num_draft_tokens", torch.tensor([1]), "num_draft_tokens must have shape"),
        ("is_greedy", torch.tensor([0, 1]), "is_greedy must be torch.bool"),
        ("seeds", [1], "one seed and one position per sequence"),
        ("positions", [1, 2, 3], "one seed and one position per sequence"),
        ("seeds", [1, 2**64], r"seeds in \[0, 2\*\*64\) and positions in \[0, 2\*\*32\)"),
        ("positions", [1, -2], r"seeds in \[0, 2\*\*64\) and positions in \[0, 2\*\*32\)"),
        ("draft_token_ids", torch.tensor([[1, 6], [3, -1]]), r"draft token ids must be in \[0, 6\)"),
        ("draft_token_ids", torch.tensor([[1, 2], [-1, 0]]), r"draft token ids must be in \[0, 6\)"),
        ("num_draft_tokens", torch.tensor([3, 1]), r"num_draft_tokens must be in \[0, 2\]"),
        ("num_draft_tokens", torch.tensor([-1, 1]), r"num_draft_tokens must be in \[0, 2\]"),
        ("target_probs", torch.full((2, 3, 6), float("nan")), "finite"),
        ("draft_probs", P[:2].expand(2, -1, -1).double(), "draft_probs must be torch.float32"),
    ],
)
def test_strict_mode_rejects_bad_inputs(field, value, message):
    inputs = valid_inputs() | {field: value}
    with pytest.raises(ValueError, match=message):
        RejectionSampler(strict=True)(**inputs)


def test_strict_mode_accepts_valid_inputs_and_padding():
    output, num_emitted = RejectionSampler(strict=True)(**valid_inputs())  # -1 padding past num_draft is fine
    assert output.shape == (2, 3) and num_emitted.shape == (2,)
