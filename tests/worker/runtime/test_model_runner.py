"""Paged-KV logits equal the same model run by `transformers` without our cache."""

import random

import pytest
import torch

from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

BLOCK_SIZE = 4
ATOL = 1e-4
# Our CPU linear (kernels/linear_cpu.py) sums in another order than the library `transformers` uses;
# over SmolLM2's 30 layers that moves logits of magnitude ~20 by up to ~2e-4 (1e-5 relative).
SMOLLM2_ATOL = 5e-4


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits from an unmodified copy of the model (sdpa, no cache). [L, V]"""
    with torch.inference_mode():
        return model(torch.tensor([token_ids], device=model.device), use_cache=False).logits[0].float()


class Harness:
    """A ModelRunner with a shuffled block pool, plus a reference model loaded separately."""

    def __init__(self, path, num_blocks=256, block_size=BLOCK_SIZE, seed=0, device="cpu"):
        self.runner = ModelRunner(load_model(path, "float32", device))
        self.reference = load_model(path, "float32", device)
        self.runner.init_cache(num_blocks, block_size)
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, shuffled block ids

    def blocks_for(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // self.block_size)
        return [self.free.pop() for _ in range(num_blocks)]


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def check_scenarios(h: Harness, vocab: int, lengths=(7, 13, 1, 22), atol: float = ATOL):
    # 1. A batch of sequences of different lengths, prefilled in one pass (crossing block boundaries).
    seqs = [random_tokens(n, i, vocab) for i, n in enumerate(lengths)]
    tables = [h.blocks_for(len(s) + 40) for s in seqs]
    chunks = [SequenceChunk(s, 0, t, num_logits=len(s)) for s, t in zip(seqs, tables)]
    got = h.runner.forward(chunks)
    want = torch.cat([reference_logits(h.reference, s) for s in seqs])
    assert (got - want).abs().max().item() <= atol

    # 2. 20 decode steps on every sequence at once (greedy continuation of the reference argmax).
    for _ in range(20):
        nxt = [int(reference_logits(h.reference, s)[-1].argmax()) for s in seqs]
        chunks = [SequenceChunk([t], len(s), tb) for s, t, tb in zip(seqs, nxt, tables)]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        got = h.runner.forward(chunks)
        want = torch.stack([reference_logits(h.reference, s)[-1] for s in seqs])
        assert (got - want).abs().max().item() <= atol

    # 3. A 5-token query over each cached prefix (speculative scoring), all logits.
    queries = [random_tokens(5, 100 + i, vocab) for i in range(len(seqs))]
    chunks = [SequenceChunk(q, len(s), tb, num_logits=5) for s, q, tb in zip(seqs, queries, tables)]
    got = h.runner.forward(chunks)
    want = torch.cat([reference_logits(h.reference, s + q)[-5:] for s, q in zip(seqs, queries)])
    assert (got - want).abs().max().item() <= atol


def check_chunked_prefill(h: Harness, vocab: int, atol: float = ATOL):
    prompt = random_tokens(30, 7, vocab)
    table = h.blocks_for(len(prompt))
    assert h.runner.forward([SequenceChunk(prompt[:11], 0, table, num_logits=0)]).shape[0] == 0
    # The second chunk shares the pass with a fresh prefill of another sequence.
    other = random_tokens(9, 8, vocab)
    got = h.runner.forward(
        [
            SequenceChunk(prompt[11:], 11, table, num_logits=19),
            SequenceChunk(other, 0, h.blocks_for(len(other)), num_logits=1),
        ]
    )
    want = torch.cat([reference_logits(h.reference, prompt)[11:], reference_logits(h.reference, other)[-1:]])
    assert (got - want).abs().max().item() <= atol


def test_tiny_llama_paged_matches_transformers(tiny_pair, device):
    h = Harness(tiny_pair.target_path, device=device)
    check_scenarios(h, vocab=h.runner.vocab_size)
    check_chunked_prefill(h, vocab=h.runner.vocab_size)


def test_tiny_llama_block_size_16(tiny_pair):
    h = Harness(tiny_pair.target_path, block_size=16, num_blocks=64, seed=3)
    check_scenarios(h, vocab=h.runner.vocab_size, lengths=(40, 3, 17))


@pytest.mark.slow
def test_smollm2_paged_matches_transformers(smollm2_path):
    h = Harness(smollm2_path, num_blocks=128, block_size=16)
    check_scenarios(h, vocab=h.runner.vocab_size, lengths=(37, 5), atol=SMOLLM2_ATOL)
    check_chunked_prefill(h, vocab=h.runner.vocab_size, atol=SMOLLM2_ATOL)
