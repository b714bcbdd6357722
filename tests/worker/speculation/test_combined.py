"""Several proposers at once (`eagle3,suffix`): lossless whichever drafts, each sequence's drafts named by
the proposer that made them, and the choice learnt from what the target emitted."""

import pytest

from specdec import step
from tests.tiny_models import save_tiny_eagle3_head
from tests.worker.driver import Driver
from tests.worker.speculation.test_eagle3 import BLOCK_SIZE, NUM_BLOCKS, PROMPTS, make_worker
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.proposers.combined import CombinedProposer


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return save_tiny_eagle3_head(tmp_path_factory.mktemp("combined") / "head")


def sources(driver: Driver) -> set[str]:
    return {o.proposer for r in driver.results for o in r.outputs if o.num_draft_tokens}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_eagle3_and_suffix_equals_plain_decoding_with_mixed_k(tiny_pair, head_dir, dtype):
    plain = Driver(make_worker(tiny_pair, dtype=dtype).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 24)
    worker = make_worker(tiny_pair, head_dir, k=5, dtype=dtype, proposer="eagle3,suffix")
    assert isinstance(worker.proposer, CombinedProposer)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, 24, num_speculative_tokens=[1, 2, 3, 4, 5]) == plain
    assert sources(driver) == {"eagle3", "suffix"}  # the repetitive prompts copy, the others use the head
    for result in driver.results:
        for out in result.outputs:
            assert bool(out.proposer) == bool(out.num_draft_tokens)


def test_seeded_combined_equals_plain_seeded_alone_and_batched(tiny_pair, head_dir):
    sampling = [step.RequestSampling(temperature=0.9, top_p=0.95, seed=300 + i) for i in range(len(PROMPTS))]
    plain = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 20, sampling)
    worker = make_worker(tiny_pair, head_dir, proposer="eagle3,suffix,ngram")
    batched = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 20, sampling, 4, prefix="b")
    alone = [
        Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate([p], 20, [s], 3, prefix=f"a{i}-")[0]
        for i, (p, s) in enumerate(zip(PROMPTS, sampling))
    ]
    assert batched == alone == plain


def test_every_proposers_draft_is_judged_by_what_the_target_emitted(tiny_pair, head_dir):
    """The ratios that calibrate each proposer's score learn from every step: the random head's drafts never
    match the target, the suffix's copies do, so suffix drafts are scored wherever suffix has one."""
    worker = make_worker(tiny_pair, head_dir, k=4, proposer="eagle3,suffix")
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    driver.generate([[7, 8] * 10], 30, num_speculative_tokens=4)
    ratios = worker.proposer.worker_ratios
    assert ratios["eagle3"].score > 0 and ratios["suffix"].score > 0
    assert ratios["suffix"].matched > ratios["eagle3"].matched


def test_the_head_drafts_only_where_copying_is_expected_to_do_worse(tiny_pair, head_dir):
    """The tiny target answers [7, 8] * 10 with a run of 7s: the suffix's copies match and the random head's
    drafts do not, so after its first drafts the head is asked only in steps where the suffix found no copy
    (asked every step, it would draft in all of them)."""
    worker = make_worker(tiny_pair, head_dir, k=4, proposer="eagle3,suffix")
    head = worker.proposer.proposers["eagle3"]
    asked = []
    propose = head.propose
    head.propose = lambda states, num_drafts: (
        asked.append(sum(1 for k in num_drafts if k)) or propose(states, num_drafts)
    )
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    prompt = [7, 8] * 10
    assert driver.generate([prompt], 14, num_speculative_tokens=4) == Driver(
        make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS
    ).generate([prompt], 14)
    num_steps = len(driver.results) - 2  # decode steps: not the prefill, not the finish
    assert "suffix" in sources(driver) and 0 < len(asked) <= 2 < num_steps, (asked, num_steps)


@pytest.mark.parametrize(
    "proposer, message",
    [
        ("eagle3,draft", "proposer 'draft' runs alone"),
        ("suffix,suffix", "names one proposer twice"),
        ("suffix,medusa", "invalid proposer 'medusa'"),
    ],
)
def test_bad_proposer_lists_are_refused(tiny_pair, proposer, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(model=str(tiny_pair.target_path), proposer=proposer, draft_model="x")
    assert WorkerConfig(model="m", proposer="eagle3, suffix", draft_model="h").proposer == "eagle3,suffix"
    assert WorkerConfig(model="m", proposer="eagle3,suffix", draft_model="h").num_speculative_tokens == 16
