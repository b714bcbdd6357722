"""Logits processing (penalties, logit_bias, min_tokens, min_p) and top_logprobs: each against a direct
reference, and speculation emitting exactly plain decoding's tokens with them, greedy and seeded, chains and
trees, every proposer, batched with unprocessed requests."""

import math

import pytest
import torch

from specdec import step
from tests.worker.driver import Driver
from tests.worker.speculation import test_eagle3
from tests.worker.speculation.test_seeded_sampling import sharp_pair  # noqa: F401
from tests.worker.speculation.test_speculative import BLOCK_SIZE, NUM_BLOCKS, make_worker
from worker_service.runtime.loader import load_model
from worker_service.speculation import logits_processing
from worker_service.speculation.logits_processing import process_logits, row_paths
from worker_service.speculation.request_state import RequestState
from worker_service.speculation.sampling import logits_to_probs, sampling_tensors

VOCAB = 50


def reference_row(logits: list[float], prompt: list[int], output: list[int], s: step.RequestSampling) -> list[float]:
    """One position's processed logits, token by token, from its whole prefix (`output`: every output token
    before the position, drafts included)."""
    out = list(logits)
    if len(output) < s.min_tokens:
        for t in s.stop_token_ids:
            out[t] = -math.inf
    for t, bias in s.logit_bias:
        out[t] += bias
    for t in range(len(out)):
        if s.repetition_penalty != 1 and (t in prompt or t in output):
            out[t] = out[t] / s.repetition_penalty if out[t] > 0 else out[t] * s.repetition_penalty
        count = output.count(t)
        out[t] -= s.frequency_penalty * count + s.presence_penalty * (count > 0)
    return out


def state_of(prompt: list[int], output: list[int], sampling: step.RequestSampling) -> RequestState:
    return RequestState("r", prompt + output, len(prompt), sampling, [], 0)


PROCESSED = [
    step.RequestSampling(temperature=0, repetition_penalty=1.7),
    step.RequestSampling(temperature=0, repetition_penalty=0.6),
    step.RequestSampling(temperature=0, presence_penalty=1.5, frequency_penalty=-0.5),
    step.RequestSampling(temperature=0, frequency_penalty=1.0),
    step.RequestSampling(temperature=0, logit_bias=((3, 7.5), (9, -100.0))),
    step.RequestSampling(temperature=0, min_tokens=6, stop_token_ids=(3, 4)),
    step.RequestSampling(
        temperature=0,
        repetition_penalty=1.2,
        presence_penalty=0.4,
        logit_bias=((4, 2.0),),
        min_tokens=4,
        stop_token_ids=(3,),
    ),
]


@pytest.mark.parametrize("sampling", PROCESSED)
@pytest.mark.parametrize("parents", [None, [0, 1, 0, 3, 1]], ids=["chain", "tree"])
def test_each_row_is_processed_along_its_own_prefix(sampling, parents):
    generator = torch.Generator().manual_seed(5)
    prompt, output, drafts = [1, 2, 3, 4, 5, 3], [4, 4, 6], [4, 3, 3, 6, 4]
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=generator) * 4  # [R, V]
    got = process_logits(logits, [state_of(prompt, output, sampling)], [drafts], [parents])
    for row, path in enumerate(row_paths(drafts, parents)):
        expected = reference_row(logits[row].tolist(), prompt, output + path, sampling)
        torch.testing.assert_close(got[row], torch.tensor(expected), rtol=0, atol=1e-5)


def test_row_paths_follow_chains_and_trees():
    assert row_paths([7, 8, 9], None) == [[], [7], [7, 8], [7, 8, 9]]
    assert row_paths([7, 8, 9, 10], [0, 1, 0, 3]) == [[], [7], [7, 8], [9], [9, 10]]


def test_unprocessed_rows_are_left_alone_and_processing_is_per_row():
    """A batch of a processed and an unprocessed sequence: the unprocessed rows are bitwise the input, the
    processed ones what they are alone."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2))  # [N, V]
    plain = state_of([1, 2], [3], step.RequestSampling(temperature=0))
    processed = state_of([5, 6], [7, 7], PROCESSED[6])
    unchanged = process_logits(logits, [plain, plain], [[1], [2, 3]], [None, None])
    assert unchanged is logits
    batched = process_logits(logits, [plain, processed], [[1], [2, 3]], [None, None])
    alone = process_logits(logits[2:], [processed], [[2, 3]], [None])
    assert torch.equal(batched[:2], logits[:2]) and torch.equal(batched[2:], alone)


def test_min_p_drops_tokens_below_its_share_of_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.25, 0.25, 0.25, 0.25]]))  # [2, V]
    temperature, top_k, top_p, min_p = sampling_tensors(
        [step.RequestSampling(min_p=0.2), step.RequestSampling(min_p=0.9)]
    )
    probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    # row 0: 0.12 >= 0.2 x 0.5 stays, 0.08 goes; row 1: all tie with the top, all stay.
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)
    torch.testing.assert_close(probs[1], torch.full((4,), 0.25))
    flat = logits_to_probs(logits, temperature * 0 + 2, top_k, top_p, min_p)  # temperature first: sqrt(0.08 / 0.5)
    assert float(flat[0, 3]) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias values"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias keys"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ],
)
def test_invalid_processing_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        step.RequestSampling(**kwargs)


# ------------------------------------------------------------------ exact with speculation, in the worker

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40] * 12, [10, 11, 12, 10, 11, 12, 10], [7, 8] * 8, [100, 101, 102]]
MAX_TOKENS = 20


def samplings(seeded: bool) -> list[step.RequestSampling]:
    """Processed requests batched with an unprocessed one (the third); `seeded`: temperature 0.8, keyed."""
    base = dict(temperature=0.8, seed=0) if seeded else dict(temperature=0)
    params = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.7, frequency_penalty=0.4),
        dict(),
        dict(logit_bias=((7, 3.0), (8, -2.0)), min_p=0.1 if seeded else 0.0),
        dict(min_tokens=15, stop_token_ids=(40, 7, 8), frequency_penalty=0.2),
    ]
    return [step.RequestSampling(**(base | p | ({"seed": 11 + i} if seeded else {}))) for i, p in enumerate(params)]


PROPOSERS = [
    ("ngram", 1),
    ("suffix", 1),
    ("suffix", 3),  # trees
    ("eagle3", 1),
    ("eagle3,suffix", 1),
]


def speculating_worker(pair, head_dir, proposer: str, width: int, dtype: str):
    if "eagle3" in proposer:
        return test_eagle3.make_worker(pair, head_dir, k=4, dtype=dtype, proposer=proposer, tree_width=width)
    return make_worker(pair, proposer, k=5 if width > 1 else 4, dtype=dtype, draft_tree_width=width)


def run(worker, sampling, ks) -> tuple[list[list[int]], Driver]:
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    return driver.generate(PROMPTS, MAX_TOKENS, sampling, ks), driver


@pytest.mark.parametrize("proposer, width", PROPOSERS, ids=[f"{p}-w{w}" for p, w in PROPOSERS])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculation_with_processing_emits_plain_decodings_tokens(
    tiny_pair, sharp_pair, tiny_eagle3_head, proposer, width, seeded
):
    pair = sharp_pair if seeded else tiny_pair
    sampling = samplings(seeded)
    plain, _ = run(make_worker(pair), sampling, 0)
    unprocessed, _ = run(make_worker(pair), [step.RequestSampling(**base_of(s)) for s in sampling], 0)
    assert sum(a != b for a, b in zip(plain, unprocessed)) >= 3  # the processing changes the outputs
    worker = speculating_worker(pair, tiny_eagle3_head, proposer, width, "float32")
    got, driver = run(worker, sampling, [1, 2, 3, 4, 4] if width == 1 else 5)
    assert got == plain
    accepted = sum(o.num_accepted_tokens for r in driver.results for o in r.outputs)
    assert accepted > 0 or "eagle3" == proposer  # drafts past the first row were accepted (the random head's are not)


def base_of(s: step.RequestSampling) -> dict:
    return dict(temperature=s.temperature, seed=s.seed)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["bfloat16", "q4_1"])
def test_processing_is_exact_with_speculation_in_other_dtypes(tiny_pair, sharp_pair, dtype, seeded):
    """Chains and trees, batched and each request alone: plain decoding's tokens in bf16 and q4_1 too."""
    pair = sharp_pair if seeded else tiny_pair
    sampling = samplings(seeded)
    plain, _ = run(make_worker(pair, dtype=dtype), sampling, 0)
    got, _ = run(make_worker(pair, "suffix", k=4, dtype=dtype), sampling, [1, 2, 3, 4, 4])
    tree, _ = run(make_worker(pair, "suffix", k=5, dtype=dtype, draft_tree_width=3), sampling, 5)
    worker = make_worker(pair, "suffix", k=4, dtype=dtype)
    alone = [
        Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate([p], MAX_TOKENS, [s], 4, prefix=f"a{i}-")[0]
        for i, (p, s) in enumerate(zip(PROMPTS, sampling))
    ]
    assert got == tree == alone == plain


def test_starting_counts_instead_of_each_rows_prefix_would_change_the_tokens(tiny_pair, monkeypatch):
    """Teeth: with every row penalised by the step's starting counts (its drafts not counted), greedy
    speculation no longer emits plain decoding's tokens. The bias makes the target repeat 7 until the penalty
    outweighs it, so the suffix's drafts of 7s are accepted up to that point."""
    sampling = [step.RequestSampling(temperature=0, logit_bias=((7, 5.0),), frequency_penalty=0.5)] * len(PROMPTS)
    plain, _ = run(make_worker(tiny_pair), sampling, 0)
    assert run(make_worker(tiny_pair, "suffix", k=4), sampling, 4)[0] == plain
    monkeypatch.setattr(logits_processing, "row_paths", lambda drafts, parents: [[] for _ in range(len(drafts) + 1)])
    assert run(make_worker(tiny_pair, "suffix", k=4), sampling, 4)[0] != plain


def test_min_tokens_holds_the_stop_tokens_back(tiny_pair):
    """Without min_tokens the tiny target answers [7, 8] * 8 with fifteen 7s; with min_tokens 15 and 7 a stop
    token, no 7 before the 16th token."""
    plain = run(make_worker(tiny_pair), step.RequestSampling(temperature=0), 0)[0][3]
    assert plain[:15] == [7] * 15
    held = step.RequestSampling(temperature=0, min_tokens=15, stop_token_ids=(7,))
    got = run(make_worker(tiny_pair, "suffix", k=4), held, 4)[0][3]
    assert 7 not in got[:15] and got == run(make_worker(tiny_pair), held, 0)[0][3]


# ------------------------------------------------------------------ top_logprobs


def test_top_logprobs_are_the_processed_log_softmax_with_and_without_speculation(tiny_pair):
    """Each emitted position's top-3 alternatives equal the log-softmax of `transformers`' logits for the whole
    prefix after the request's processing; the chosen token's logprob is among them (greedy); speculation
    returns the same values."""
    sampling = step.RequestSampling(temperature=0, logprobs=True, top_logprobs=3, repetition_penalty=1.3)
    plain_driver = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS)
    plain = plain_driver.generate(PROMPTS[:3], 12, sampling)
    spec_driver = Driver(make_worker(tiny_pair, "suffix", k=4).execute, BLOCK_SIZE, NUM_BLOCKS)
    assert spec_driver.generate(PROMPTS[:3], 12, sampling, 4) == plain
    model = load_model(tiny_pair.target_path)
    for i, (prompt, output) in enumerate(zip(PROMPTS, plain)):
        plain_tops = [
            t for r in plain_driver.results for o in r.outputs if o.request_id == f"r{i}" for t in o.top_logprobs
        ]
        spec_tops = [
            t for r in spec_driver.results for o in r.outputs if o.request_id == f"r{i}" for t in o.top_logprobs
        ]
        assert len(plain_tops) == len(spec_tops) >= 12
        for j, (top, spec_top) in enumerate(zip(plain_tops[:12], spec_tops)):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + output[:j]])).logits[0, -1].float()
            processed = torch.tensor(reference_row(logits.tolist(), prompt, output[:j], sampling))
            values, ids = torch.log_softmax(processed, dim=-1).topk(3)
            assert top.token_ids == ids.tolist() and top.token_ids[0] == output[j]
            torch.testing.assert_close(torch.tensor(top.logprobs), values, rtol=0, atol=1e-4)
            assert spec_top.token_ids == top.token_ids
            torch.testing.assert_close(torch.tensor(spec_top.logprobs), torch.tensor(top.logprobs), rtol=0, atol=1e-5)
