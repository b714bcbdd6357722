"""A draft tree through the target's forward: every row's logits are those of a plain run over its path, and
after the accepted path's K/V are moved into place the next step is what a fresh run over the same tokens
gives (bitwise, on the CPU's batch-invariant kernels; fp32 and bf16)."""

import pytest
import torch

from tests.worker.runtime.test_model_runner import random_tokens
from worker_service.runtime.backends.transformers_layers import TransformersForward
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

BLOCK_SIZE = 4
#            row: 0   1  2  3  4  5  6  7  8  9
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]  # depth 4 (rows 1, 4, 7, 9), 3 children at the root


def path_of(row: int) -> list[int]:
    """The rows from the root's child down to `row`."""
    path = []
    while row > 0:
        path.insert(0, row)
        row = PARENTS[row]
    return path


class Runner:
    def __init__(self, path, dtype: str, forward: str):
        self.runner = ModelRunner(load_model(path, dtype, "cpu"))
        assert self.runner.backend.name == "cpu_llama"
        if forward == "transformers":  # the model's own layers, our attention registered in them
            self.runner.backend = TransformersForward(self.runner.model)
        self.runner.init_cache(128, BLOCK_SIZE)
        self.next_block = 0
        self.vocab = self.runner.vocab_size

    def table(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        ids = list(range(self.next_block, self.next_block + num_blocks))[::-1]  # not in order
        self.next_block += num_blocks
        return ids

    def fresh_logits(self, token_ids: list[int]) -> torch.Tensor:  # [V]
        """The last token's logits of a new sequence prefilled with `token_ids` (beside another sequence)."""
        other = random_tokens(6, 99, self.vocab)
        logits = self.runner.forward(
            [SequenceChunk(other, 0, self.table(6)), SequenceChunk(token_ids, 0, self.table(len(token_ids)))]
        )
        return logits[1]


@pytest.fixture(
    params=[("float32", "fast"), ("bfloat16", "fast"), ("float32", "transformers"), ("bfloat16", "transformers")],
    ids="-".join,
)
def setup(request, tiny_pair):
    runner = Runner(tiny_pair.target_path, *request.param)
    prompt = random_tokens(11, 1, runner.vocab)
    nodes = random_tokens(len(PARENTS) - 1, 2, runner.vocab)
    table = runner.table(len(prompt) + len(PARENTS) + 4)
    start = len(prompt) - 1
    runner.runner.forward([SequenceChunk(prompt[:-1], 0, table, num_logits=0)])
    other = random_tokens(5, 3, runner.vocab)  # a prefill shares the tree's pass
    tree_chunk = SequenceChunk([prompt[-1], *nodes], start, table, num_logits=len(PARENTS), parents=PARENTS)
    logits = runner.runner.forward([SequenceChunk(other, 0, runner.table(5)), tree_chunk])[1:]  # [rows, V]
    return runner, prompt, nodes, table, logits


def test_each_tree_row_is_a_plain_run_over_its_path(setup):
    runner, prompt, nodes, _, logits = setup
    differ = [
        row
        for row in range(len(PARENTS))
        if not torch.equal(logits[row], runner.fresh_logits(prompt + [nodes[r - 1] for r in path_of(row)]))
    ]
    assert differ == []


@pytest.mark.parametrize("accepted", [[2, 6], [1, 4, 7, 9], [3], []], ids=["second-branch", "deepest", "third", "none"])
def test_after_keeping_a_path_the_next_step_is_a_fresh_runs(setup, accepted):
    runner, prompt, nodes, table, _ = setup
    start = len(prompt) - 1
    runner.runner.keep_path(table, start, accepted)
    tokens = prompt + [nodes[r - 1] for r in accepted]
    verify = random_tokens(3, 4, runner.vocab)  # the next step: the bonus token and two drafts, a chain
    got = runner.runner.forward([SequenceChunk(verify, len(tokens), table, num_logits=3)])  # [3, V]
    for j in range(3):
        assert torch.equal(got[j], runner.fresh_logits(tokens + verify[: j + 1])), j


def test_without_the_move_a_non_first_branch_is_read_wrong(setup):
    """The test above has teeth: skipping keep_path leaves the next step reading the first rows' K/V."""
    runner, prompt, nodes, table, _ = setup
    tokens = prompt + [nodes[r - 1] for r in [2, 6]]
    got = runner.runner.forward([SequenceChunk([7], len(tokens), table)])
    assert not torch.equal(got[0], runner.fresh_logits(tokens + [7]))
