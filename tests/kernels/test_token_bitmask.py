"""Structured outputs' token masks on logits: the C kernel and the PyTorch reference keep exactly the allowed
tokens (a row that allows none keeps the EOS ids), and agree bit for bit on a real vocabulary's size."""

import pytest
import torch

from kernels import cpu_build, token_bitmask

EOS = [3, 5]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert token_bitmask.c_library() is not None, "the C kernel must build on a machine with a C compiler"


def pack(allowed: torch.Tensor) -> torch.Tensor:  # [R, V] bool -> [R, ceil(V / 32)] int32, llguidance's layout
    num_words = -(-allowed.shape[1] // 32)
    bits = torch.zeros((allowed.shape[0], num_words * 32), dtype=torch.int64)
    bits[:, : allowed.shape[1]] = allowed.long()
    words = (bits.view(allowed.shape[0], num_words, 32) << torch.arange(32)).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def cases(num_vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks for rows 1, 2, 4, 5 of six: random bits, everything, nothing (EOS: tail bits past the vocabulary
    set do not count), one token."""
    allowed = torch.rand((4, num_vocab), generator=generator) < 0.3
    allowed[1] = True
    allowed[2] = False
    allowed[3] = False
    allowed[3, num_vocab - 1] = True
    bitmask = pack(allowed)
    if num_vocab % 32:
        bitmask[2, -1] = -1 << (num_vocab % 32)  # bits past the vocabulary only
    return torch.tensor([1, 2, 4, 5]), bitmask, allowed


APPLY = {"kernel": token_bitmask.apply_token_bitmask_, "reference": token_bitmask.apply_token_bitmask_reference}


@pytest.mark.parametrize("implementation", list(APPLY))
def test_keeps_exactly_the_allowed_tokens(implementation):
    generator = torch.Generator().manual_seed(0)
    num_vocab = 70  # not a multiple of 32: a partial last word
    rows, bitmask, allowed = cases(num_vocab, generator)
    logits = torch.randn((6, num_vocab), generator=generator)
    expected = logits.clone()
    allowed[1] = True
    allowed[2, EOS] = True  # nothing allowed: EOS instead
    for i, row in enumerate(rows.tolist()):
        expected[row, ~allowed[i]] = float("-inf")
    out = APPLY[implementation](logits, rows, bitmask, EOS)
    assert out is logits and torch.equal(logits, expected)


@pytest.mark.parametrize("num_vocab", [1000, 49152])
def test_the_kernel_equals_the_reference_bit_for_bit(num_vocab):
    generator = torch.Generator().manual_seed(num_vocab)
    rows, bitmask, _ = cases(num_vocab, generator)
    logits = torch.randn((6, num_vocab), generator=generator)
    ours, reference = logits.clone(), logits.clone()
    token_bitmask.apply_token_bitmask_(ours, rows, bitmask, EOS)
    token_bitmask.apply_token_bitmask_reference(reference, rows, bitmask, EOS)
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, logits)  # it masked something


def test_other_dtypes_take_the_reference():
    generator = torch.Generator().manual_seed(1)
    rows, bitmask, _ = cases(100, generator)
    logits = torch.randn((6, 100), generator=generator)
    ours = token_bitmask.apply_token_bitmask_(logits.bfloat16(), rows, bitmask, EOS)
    reference = token_bitmask.apply_token_bitmask_reference(logits.clone(), rows, bitmask, EOS)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours.isinf(), reference.isinf())


def test_a_build_without_avx512_gives_the_same_result():
    """The AVX-512 build masks whole words with masked stores, others bit by bit: the same logits."""
    narrow = token_bitmask.bind(cpu_build.load_library("token_bitmask_cpu", ("-march=x86-64-v3",)))
    generator = torch.Generator().manual_seed(2)
    rows, bitmask, _ = cases(1000, generator)
    logits = torch.randn((6, 1000), generator=generator)
    ours, narrowed = logits.clone(), logits.clone()
    token_bitmask.apply_token_bitmask_(ours, rows, bitmask, EOS)
    token_bitmask.apply_token_bitmask_(narrowed, rows, bitmask, EOS, library=narrow)
    assert torch.equal(ours, narrowed) and not torch.equal(ours, logits)
