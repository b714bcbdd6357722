"""Structured outputs on the worker: every output follows its JSON schema, speculation changes no token, the
grammar's forced tokens are drafted and accepted, and a resumed request goes on in the same grammar state.

A random tiny model over a byte-level vocabulary (tests/tiny_models.py): left alone it writes bytes at random,
so everything JSON about its output comes from the constraint.
"""

import json

import jsonschema
import pytest

from specdec import step, structured
from tests.tiny_models import BYTE_VOCAB_SIZE, make_tiny_byte_pair
from tests.worker.driver import Driver
from worker_service.speculation import structured as worker_structured
from worker_service.speculation.build import build_worker
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.request_state import InvalidStepError
from worker_service.speculation.worker import Worker

BLOCK_SIZE = 4
NUM_BLOCKS = 600
MAX_TOKENS = 96
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
GRAMMAR = structured.to_grammar("json", json.dumps(SCHEMA))
PROMPTS = [[40, 41, 42, 43], [70] * 12, [100, 101, 100, 101, 100], list(range(50, 80)), [90, 91]]
SEEDED = [step.RequestSampling(temperature=1.0, seed=s) for s in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    return make_tiny_byte_pair(tmp_path_factory.mktemp("bytes"))


def make_worker(pair, proposer="none", k=0, forced_drafts=True) -> Worker:
    draft_model = {"draft": pair.draft_path, "eagle3": pair.eagle3_head_path}.get(proposer)
    worker = build_worker(
        WorkerConfig(
            model=str(pair.target_path),
            proposer=proposer,
            num_speculative_tokens=k,
            draft_model=str(draft_model) if draft_model else None,
            forced_drafts=forced_drafts,
            dtype="float32",
        )
    )
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return worker


def run(pair, proposer="none", k=0, sampling=None, grammar=GRAMMAR, forced_drafts=True):
    """Outputs cut at EOS, and the step results."""
    driver = Driver(make_worker(pair, proposer, k, forced_drafts).execute, BLOCK_SIZE, NUM_BLOCKS)
    outputs = driver.generate(PROMPTS, MAX_TOKENS, sampling=sampling, num_speculative_tokens=k, grammar=grammar)
    return [o[: o.index(EOS)] if EOS in o else o for o in outputs], driver.results


def steps_to_finish(results: list[step.StepResult]) -> int:
    """Steps until every request has emitted EOS (the Driver decodes on past it)."""
    finished = set()
    for index, result in enumerate(results):
        finished |= {o.request_id for o in result.outputs if EOS in o.token_ids}
        if len(finished) == len(PROMPTS):
            return index + 1
    raise AssertionError("a request never finished its constraint")


def decode(pair, tokens: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(pair.target_path / "tokenizer.json")).decode(tokens)


@pytest.fixture(scope="module")
def plain(byte_pair):
    """Constrained decoding without drafts: greedy and seeded."""
    return {"greedy": run(byte_pair)[0], "seeded": run(byte_pair, sampling=SEEDED)[0]}


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_every_output_is_valid_json_of_the_schema(byte_pair, plain, mode):
    for tokens in plain[mode]:
        jsonschema.validate(json.loads(decode(byte_pair, tokens)), SCHEMA)


def test_seeded_draft_model_speculation_follows_the_schema(byte_pair):
    """Sampled drafts from a draft model (rejection sampling with its p; its seeded tokens depend on the
    drafts, so they are not compared with plain decoding): still valid JSON of the schema."""
    outputs, results = run(byte_pair, "draft", 4, sampling=SEEDED)
    assert sum(o.num_draft_tokens for r in results for o in r.outputs) > 0
    for tokens in outputs:
        jsonschema.validate(json.loads(decode(byte_pair, tokens)), SCHEMA)


def test_the_unconstrained_model_writes_no_json(byte_pair):
    """The check above is the constraint's doing: the same model and prompts without it write no JSON."""
    outputs, _ = run(byte_pair, grammar="")
    for tokens in outputs:
        with pytest.raises(ValueError):
            json.loads(decode(byte_pair, tokens))


@pytest.mark.parametrize(
    ("proposer", "mode"),
    [
        (proposer, mode)
        for proposer in ("ngram", "suffix", "draft", "eagle3")
        for mode in ("greedy", "seeded")
        # a draft model's sampled drafts change which keyed samples a seeded request consumes (rejection sampling
        # with its p): seeded, it is checked against the schema above, not against plain decoding
        if (proposer, mode) != ("draft", "seeded")
    ],
)
def test_speculation_changes_no_token(byte_pair, plain, proposer, mode):
    sampling = SEEDED if mode == "seeded" else None
    expected = plain["seeded"] if sampling else plain["greedy"]
    outputs, results = run(byte_pair, proposer, 4, sampling=sampling)
    assert outputs == expected
    drafted = {}
    for out in (o for r in results for o in r.outputs):
        totals = drafted.setdefault(out.proposer, [0, 0])
        totals[0] += out.num_draft_tokens
        totals[1] += out.num_accepted_tokens
    forced = drafted[worker_structured.FORCED]
    assert forced[0] > 0 and forced[1] > 0.8 * forced[0]  # the grammar's own tokens: nearly always accepted
    if mode == "greedy":  # the proposer's own drafts were scored too (seeded random bytes give a suffix
        assert drafted[proposer][0] > 0  # index nothing to copy)


def test_forced_drafts_change_speed_not_output(byte_pair, plain):
    """With k > 0 the schema's keys and punctuation are drafted even where the n-gram finds nothing: fewer
    target steps than without forced drafts (--no-forced-drafts), the same tokens."""
    forced, forced_results = run(byte_pair, "ngram", 4)
    unforced, unforced_results = run(byte_pair, "ngram", 4, forced_drafts=False)
    assert forced == unforced == plain["greedy"]
    assert not any(o.proposer == worker_structured.FORCED for r in unforced_results for o in r.outputs)
    assert steps_to_finish(forced_results) < 0.8 * steps_to_finish(unforced_results)


def test_scoring_with_the_wrong_prefix_mask_is_caught(byte_pair, plain, monkeypatch):
    """Mutation check: every draft row masked as the first row (the committed prefix's mask) breaks losslessness."""

    def first_row_only(matcher, drafts, vocab_size):
        bitmask = original(matcher, [], vocab_size)
        return bitmask.expand(len(drafts) + 1, -1).contiguous()

    original = worker_structured.masks
    monkeypatch.setattr(worker_structured, "masks", first_row_only)
    try:
        outputs, _ = run(byte_pair, "ngram", 4)
    except RuntimeError as exc:  # or the matcher, fed a token its grammar forbids, stops the step
        assert "grammar matcher" in str(exc)
    else:
        assert outputs != plain["greedy"]


def test_a_resumed_request_continues_in_the_same_grammar_state(byte_pair, plain):
    """Preemption or a move: the request comes back as a NewRequest with its tokens so far, on a fresh worker."""
    worker = make_worker(byte_pair, "ngram", 4)
    prompt = PROMPTS[0]
    head = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(
        [prompt], 20, num_speculative_tokens=4, grammar=GRAMMAR
    )[0]
    fresh = make_worker(byte_pair, "ngram", 4)

    def resume(request: step.StepRequest) -> step.StepResult:  # the prompt, then 20 generated tokens
        for new in request.new_requests:
            new.num_prompt_tokens = len(prompt)
        return fresh.execute(request)

    driver = Driver(resume, BLOCK_SIZE, NUM_BLOCKS)
    rest = driver.generate([prompt + head], MAX_TOKENS - 20, num_speculative_tokens=4, grammar=GRAMMAR)[0]
    tokens = head + rest
    assert tokens[: tokens.index(EOS)] == plain["greedy"][0]


def test_forced_only_steps_draft_the_grammar_tokens_without_asking_the_proposer(byte_pair, plain):
    """Each step tells the scheduler how many tokens the constraint forces next (num_forced_tokens_next); a
    step whose k is for those only (forced_drafts_only, as the scheduler sends where its policy's k is 0)
    drafts exactly them, or nothing, and never calls the proposer; the output is constrained plain decoding's."""
    worker = make_worker(byte_pair, "ngram", 4)
    calls, propose = [], worker.proposer.propose
    worker.proposer.propose = lambda states, ks: calls.append(list(ks)) or propose(states, ks)
    prompt, table = PROMPTS[0], list(range(40))
    request = step.NewRequest(
        "r", prompt, len(prompt), step.RequestSampling(temperature=0.0), table, len(prompt), grammar=GRAMMAR
    )
    emitted, forced_next, num_forced = [], 0, 0
    for step_id in range(MAX_TOKENS):
        if step_id:
            # k = 2 where nothing is forced (as an async scheduler's stale count could send): still no proposer
            request = step.CachedRequest("r", [], len(table), 1, forced_next or 2, forced_drafts_only=True)
        out = worker.execute(
            step.StepRequest(step_id, **{"new_requests" if step_id == 0 else "cached_requests": [request]})
        ).outputs[0]
        assert out.num_draft_tokens <= forced_next
        if out.num_draft_tokens:
            assert out.proposer == worker_structured.FORCED
            num_forced += out.num_draft_tokens
        emitted += out.token_ids
        forced_next = out.num_forced_tokens_next
        assert 0 <= forced_next <= 4  # at most the worker's k
        if EOS in emitted:
            break
    assert calls == [] and num_forced > 5
    assert emitted[: emitted.index(EOS)] == plain["greedy"][0]


def test_drafts_the_grammar_forbids_are_not_scored(byte_pair):
    """A matcher at `{"name": "` takes string characters and the closing quote, but not the object's end
    (three keys are missing): the draft `ab"}` is cut to `ab`."""
    tokenizer_json = (byte_pair.target_path / "tokenizer.json").read_text()
    grammars = worker_structured.Grammars(lambda: tokenizer_json, BYTE_VOCAB_SIZE, [EOS])
    matcher = grammars.start(GRAMMAR).result().deep_copy()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(byte_pair.target_path / "tokenizer.json"))
    forced = matcher.compute_ff_tokens()
    assert tok.decode(forced).startswith('{"name"')
    assert worker_structured.forced_tokens(matcher, 3) == forced[:3]
    matcher.consume_tokens(forced + tok.encode(' "').ids)
    assert worker_structured.forced_tokens(matcher, 3) == []  # inside a string: nothing is forced
    closing = tok.encode('"}').ids
    assert worker_structured.valid_drafts(matcher, tok.encode("ab").ids + closing) == tok.encode("ab").ids
    # Drafts sampled from a draft model's p: the forbidden one stays, to be rejected for certain (see the
    # function: cutting it would sample the target there instead of the residual).
    assert (
        worker_structured.valid_drafts(matcher, tok.encode("ab").ids + closing, keep_first_forbidden=True)
        == tok.encode("ab").ids + closing
    )
    bitmask = worker_structured.masks(matcher, tok.encode("ab").ids + closing + [EOS], BYTE_VOCAB_SIZE)
    assert bitmask[2].any() and not bitmask[3:].any()  # the forbidden draft's row has its prefix's mask
    assert worker_structured.valid_drafts(matcher, tok.encode("ab").ids) == tok.encode("ab").ids


def test_a_mask_row_is_what_llguidance_writes_and_the_worker_does_not_import_its_torch_module(byte_pair):
    """fill_mask writes the bits llguidance.torch's own helper writes, at the start and after tokens; the worker
    leaves that module out (importing it compiles a function with torch.compile: ~1.3 s of every start)."""
    import subprocess
    import sys

    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from tokenizers import Tokenizer
    import torch

    tokenizer_json = (byte_pair.target_path / "tokenizer.json").read_text()
    matcher = worker_structured.Grammars(lambda: tokenizer_json, BYTE_VOCAB_SIZE, [EOS]).start(GRAMMAR).result()
    matcher = matcher.deep_copy()
    in_string = Tokenizer.from_str(tokenizer_json).encode(' "ab').ids
    for tokens in ([], matcher.compute_ff_tokens(), in_string):  # the start, after `{"name"`, inside its string
        assert matcher.consume_tokens(tokens)
        ours = torch.zeros((2, (BYTE_VOCAB_SIZE + 31) // 32), dtype=torch.int32)
        theirs = allocate_token_bitmask(2, BYTE_VOCAB_SIZE)
        worker_structured.fill_mask(matcher, ours[1])
        fill_next_token_bitmask(matcher, theirs, 1)
        assert torch.equal(ours[1], theirs[1]) and ours[1].any() and not ours[1].all()
    with pytest.raises(ValueError, match="contiguous int32"):
        worker_structured.fill_mask(matcher, torch.zeros((4, 2), dtype=torch.int32)[:, 0])
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, worker_service.serving.main; print('llguidance.torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert imported == "False"


def test_a_grammar_the_worker_cannot_compile_fails_the_step_naming_the_request(byte_pair):
    worker = make_worker(byte_pair)
    bad = structured.to_grammar("regex", "(unclosed")
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(InvalidStepError, match="request 'r0'.*regex"):
        driver.generate([PROMPTS[0]], 4, grammar=bad)
