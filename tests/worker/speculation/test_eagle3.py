"""EAGLE-3 heads: loading both stacks' layouts, refusing heads that do not fit, the target's auxiliary hidden
states, the head's catch-up on its own paged KV, and lossless output (tiny target, random tiny heads)."""

import subprocess
import sys

import pytest
import torch

from specdec import step
from tests.tiny_models import save_tiny_eagle3_head
from tests.worker.driver import Driver
from worker_service.runtime.backends.transformers_layers import TransformersForward
from worker_service.runtime.eagle3_head import HeadError, TargetFacts, load_head
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk, pack
from worker_service.speculation.config import WorkerConfig
from worker_service.speculation.proposers.eagle3 import CATCH_UP_EVERY
from worker_service.speculation.proposers.trees import chain_length
from worker_service.speculation.worker import Worker

BLOCK_SIZE, NUM_BLOCKS = 4, 400
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40] * 12, [10, 11, 12, 10, 11, 12, 10], list(range(3, 23)), [100, 101, 102]]


def facts(model) -> TargetFacts:
    return TargetFacts(model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers)


def make_worker(pair, head_dir=None, k=4, dtype="float32", proposer="eagle3", tree_width=1, device="cpu") -> Worker:
    proposer = proposer if head_dir is not None else "none"
    config = WorkerConfig(
        model=str(pair.target_path),
        proposer=proposer,
        num_speculative_tokens=k if head_dir else 0,
        draft_model=str(head_dir) if head_dir else None,
        dtype=dtype,
        draft_tree_width=tree_width,
        device=device,
    )
    target = ModelRunner(load_model(pair.target_path, dtype, device))
    head = None
    if head_dir is not None:
        head = load_head(head_dir, facts(target.model), target.model.model.embed_tokens, target.device)
    worker = Worker(config, target, None, head)
    worker.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return worker


@pytest.mark.parametrize("naming", ["specforge", "speculators"])
def test_both_stacks_layouts_load(tiny_pair, tmp_path, naming):
    model = load_model(tiny_pair.target_path)
    head = load_head(
        save_tiny_eagle3_head(tmp_path / naming, naming=naming), facts(model), model.model.embed_tokens, model.device
    )
    assert head.aux_layers == (2, 2, 1)  # 2, L/2, L-3 of the 4-layer target
    assert head.draft_to_target[:3].tolist() == [3, 4, 5]
    configured = load_head(
        save_tiny_eagle3_head(tmp_path / "aux", aux_layers=[0, 1, 3]),
        facts(model),
        model.model.embed_tokens,
        model.device,
    )
    assert configured.aux_layers == (0, 1, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_hidden=32), "it reads hidden states of size 32 (fc takes 96); the target's hidden size is 64"),
        (dict(vocab_size=300), "vocabulary 300; the target's is 256"),
        (dict(drop="midlayer.self_attn.k_proj.weight"), "missing tensor midlayer.self_attn.k_proj.weight"),
        (dict(drop="d2t"), "missing tensor d2t"),
        (dict(drop="midlayer.input_layernorm.weight"), "no decoder layer: missing tensor midlayer.input_layernorm"),
        (dict(aux_layers=[0, 1, 4]), "it reads target layers [0, 1, 4]; the target has 4 layers"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_naming_both_values(tiny_pair, tmp_path, kwargs, message):
    model = load_model(tiny_pair.target_path)
    with pytest.raises(HeadError, match=None) as info:
        load_head(
            save_tiny_eagle3_head(tmp_path / "head", **kwargs), facts(model), model.model.embed_tokens, model.device
        )
    assert message in str(info.value)


def test_the_fast_forward_keeps_the_stream_entering_the_chosen_layers(tiny_pair):
    runner = ModelRunner(load_model(tiny_pair.target_path))
    runner.init_cache(64, BLOCK_SIZE)
    assert runner.backend.name == "cpu_llama"
    runner.aux_layers = (2, 0, 3)
    tokens = list(range(3, 20))
    runner.forward([SequenceChunk(tokens, 0, list(range(5)))])
    with torch.inference_mode():  # transformers' own forward (SDPA) on a fresh copy: hidden_states[i] enters layer i
        states = load_model(tiny_pair.target_path)(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in (2, 0, 3)], dim=-1)  # [T, 3 x hidden]
    torch.testing.assert_close(runner.last_aux_hidden, expected, rtol=1e-4, atol=1e-4)
    runner.backend = TransformersForward(runner.model)  # transformers' forward keeps them too
    runner.forward([SequenceChunk(tokens, 0, list(range(5, 10)))])
    torch.testing.assert_close(runner.last_aux_hidden, expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return save_tiny_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head")


def test_the_heads_fast_cpu_step_is_its_modules_step(tiny_pair, head_dir):
    """On the CPU a head's linears are served as q8_0 blocks and its step runs as direct kernel calls
    (cpu_head.CpuHeadForward): over a prefill chunk and decode rows of two sequences, with history in the
    head's KV, its outputs and K/V equal transformers' modules on the same weights, and its drafts too."""
    model = load_model(tiny_pair.target_path)
    heads = [load_head(head_dir, facts(model), model.model.embed_tokens, model.device) for _ in range(2)]
    assert heads[0].fast is not None and heads[0].lm_head.weight_format == "q8_0 x int8"
    heads[1].fast = None  # transformers' LlamaAttention / LlamaMLP / LlamaRMSNorm over the paged KV
    features = torch.randn(16, heads[0].norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    outputs = []
    for head in heads:
        head.init_cache(16, BLOCK_SIZE)
        chunks = [
            [SequenceChunk(list(range(3, 13)), 0, [0, 1, 2, 3]), SequenceChunk([7, 8, 9], 0, [4, 5])],
            [SequenceChunk([20, 21], 10, [0, 1, 2, 3]), SequenceChunk([22], 3, [4, 5])],
        ]
        rows = iter((features[:13], features[13:16]))
        for batch_chunks in chunks:
            batch = pack(batch_chunks, head.kv_cache, head.device)
            normed, prenorm = head(batch.input_ids, batch.positions, next(rows), batch.metadata)
        outputs.append((normed, prenorm, head.draft_tokens(normed)[0], head.kv_cache.key_caches[0].clone()))
    fast, modules = outputs
    torch.testing.assert_close(fast[0], modules[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast[1], modules[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast[3], modules[3], rtol=1e-4, atol=1e-4)
    assert fast[2] == modules[2]


@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "modules"])
def test_a_catch_up_with_output_rows_writes_the_same_kv_and_outputs(tiny_pair, head_dir, fast):
    """A catch-up asks for the last row's output only (output_rows): every row's K/V, and the output rows'
    normed and pre-norm outputs, equal those of the full step bit for bit (the kernels run the other rows
    only as far as their K/V, projecting only k and v; a mutation that skips writing them, attends an output
    row to fewer positions, or rotates its q at another row's position, fails here)."""
    model = load_model(tiny_pair.target_path)
    head = load_head(head_dir, facts(model), model.model.embed_tokens, model.device)
    if not fast:
        head.fast = None
    else:  # the rows before an output row project only k and v
        assert head.fast.kv is not None and head.fast.kv.out_features < head.fast.qkv.out_features
    features = torch.randn(13, head.norm.weight.shape[0], generator=torch.Generator().manual_seed(1))
    chunks = [
        SequenceChunk(list(range(3, 13)), 0, [0, 1, 2, 3], num_logits=1),
        SequenceChunk([7, 8], 0, [4, 5], num_logits=0),
        SequenceChunk([9], 2, [4, 5], num_logits=1),
    ]
    runs = []
    for output_rows in (False, True):
        head.init_cache(16, BLOCK_SIZE)
        batch = pack(chunks[:2], head.kv_cache, head.device)  # history for the third chunk's sequence
        head(batch.input_ids, batch.positions, features[:12], batch.metadata)
        batch = pack(chunks[::2], head.kv_cache, head.device)
        rows = torch.cat([features[:10], features[12:]])
        normed, prenorm = head(
            batch.input_ids, batch.positions, rows, batch.metadata, batch.logits_indices if output_rows else None
        )
        if not output_rows:
            normed, prenorm = normed[batch.logits_indices], prenorm[batch.logits_indices]
        runs.append((normed, prenorm, head.kv_cache.key_caches[0].clone(), head.kv_cache.value_caches[0].clone()))
    assert runs[1][0].shape[0] == 2
    for full, selected in zip(*runs):
        assert torch.equal(full, selected)


def spy_trees(worker) -> list:
    """Records every proposal's trees (parents per sequence; None: a chain)."""
    trees, propose = [], worker.proposer.propose
    worker.proposer.propose = lambda states, ks: (p := propose(states, ks), trees.extend(p.parents or []))[0]
    return trees


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chains", "trees"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_eagle3_equals_plain_decoding_with_mixed_k(tiny_pair, head_dir, dtype, tree_width, device):
    plain = Driver(make_worker(tiny_pair, dtype=dtype, device=device).execute, BLOCK_SIZE, NUM_BLOCKS).generate(
        PROMPTS, 24
    )
    worker = make_worker(tiny_pair, head_dir, k=5, dtype=dtype, tree_width=tree_width, device=device)
    worker.proposer.min_confidence = 0.0 if tree_width > 1 else worker.proposer.min_confidence  # full trees
    trees = spy_trees(worker)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    assert driver.generate(PROMPTS, 24, num_speculative_tokens=[1, 2, 3, 4, 5]) == plain
    assert sum(o.num_draft_tokens for r in driver.results for o in r.outputs) > 0
    assert all(o.num_draft_tokens <= 5 for r in driver.results for o in r.outputs)
    branched = any(p is not None and chain_length(p) < len(p) for p in trees)
    assert branched == (tree_width > 1)


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chains", "trees"])
def test_seeded_eagle3_equals_plain_seeded_alone_and_batched(tiny_pair, head_dir, tree_width):
    sampling = [step.RequestSampling(temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(PROMPTS))]
    plain = Driver(make_worker(tiny_pair).execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 20, sampling)
    worker = make_worker(tiny_pair, head_dir, tree_width=tree_width)
    batched = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(PROMPTS, 20, sampling, 4, prefix="b")
    alone = [
        Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate([p], 20, [s], 3, prefix=f"a{i}-")[0]
        for i, (p, s) in enumerate(zip(PROMPTS, sampling))
    ]
    assert batched == alone == plain


def next_proposals_after_steps(tiny_pair, head_dir, stepped_worker_hook=None) -> list[tuple]:
    """Steps 3 requests with k = 3 (rejections and all-accepted + bonus among them), then proposes for each as
    it stands and as a fresh run over the same tokens does: (stepped, fresh) drafts and head features each."""
    prompts = [[9] * 5, PROMPTS[0], PROMPTS[3]]
    worker = make_worker(tiny_pair, head_dir, k=3)
    worker.proposer.min_confidence = 0.0  # full-length chains from the random head
    if stepped_worker_hook is not None:
        stepped_worker_hook(worker)
    stepped_driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    stepped_driver.generate(prompts, 14, num_speculative_tokens=3, keep=True)
    outputs = [o for r in stepped_driver.results for o in r.outputs]
    assert any(o.num_accepted_tokens == o.num_draft_tokens == 3 for o in outputs)  # all accepted + bonus
    assert any(o.num_accepted_tokens < o.num_draft_tokens for o in outputs)  # and rejections
    fresh = make_worker(tiny_pair, head_dir, k=3)
    fresh.proposer.min_confidence = 0.0
    Driver(fresh.execute, BLOCK_SIZE, NUM_BLOCKS).generate(
        [worker.requests[f"r{i}"].token_ids[:-1] for i in range(len(prompts))], 1, keep=True, prefix="f"
    )
    proposals = []
    for i in range(len(prompts)):
        stepped, fresh_state = worker.requests[f"r{i}"], fresh.requests[f"f{i}"]
        assert fresh_state.token_ids == stepped.token_ids  # greedy: the same sampled last token
        a = worker.proposer.propose([stepped], [3]).draft_token_ids
        b = fresh.proposer.propose([fresh_state], [3]).draft_token_ids  # catches up on the prompt first
        proposals.append((a, b, worker.proposer._next.get(f"r{i}"), fresh.proposer._next[f"f{i}"]))
    return proposals


@pytest.fixture(scope="module")
def repeating_head_dir(tmp_path_factory):
    """The head maps 3 of 4 draft ids to token 124, which the target repeats after [9] * 5, so runs of drafts
    are accepted there."""
    return save_tiny_eagle3_head(
        tmp_path_factory.mktemp("repeating") / "head", d2t=[124 - i for i in range(150)] + [3] * 50
    )


def test_after_steps_the_next_proposal_equals_a_fresh_runs(tiny_pair, repeating_head_dir):
    """The head's K/V after a prefill, rejected drafts, and all drafts accepted with a bonus token equals a
    fresh prefill's over the same tokens: the same features and drafts for the next step."""
    for stepped, fresh, stepped_next, fresh_next in next_proposals_after_steps(tiny_pair, repeating_head_dir):
        assert torch.equal(stepped_next.feature, fresh_next.feature)
        assert stepped == fresh and len(stepped[0]) == 3


def test_skipping_the_catch_up_after_verification_is_caught(tiny_pair, repeating_head_dir):
    """Mutation check of the test above: a head that catches up on the prompt but not on the tokens each
    step commits drafts from stale K/V and a stale first draft, and no longer proposes as a fresh run does."""

    def prefill_only(worker):
        original, calls = worker.proposer.after_step, []

        def after_step(states, chunks, num_committed):
            calls.append(1)
            if len(calls) == 1:  # the prefill step
                original(states, chunks, num_committed)

        worker.proposer.after_step = after_step

    proposals = next_proposals_after_steps(tiny_pair, repeating_head_dir, prefill_only)
    assert any(stepped != fresh for stepped, fresh, _, _ in proposals)


def run_with_ks(worker, prompt: list[int], ks: list[int], request_id: str = "r0") -> list[int]:
    """A greedy request stepped by hand: its prefill, then one decode step per k in `ks`; the emitted tokens."""
    table = list(range(-(-(len(prompt) + 8 * len(ks) + 8) // BLOCK_SIZE)))
    request = step.NewRequest(
        request_id, prompt, len(prompt), step.RequestSampling(temperature=0.0), table, len(prompt)
    )
    emitted = []
    for step_id, k in enumerate([0] + ks):
        if step_id:
            request = step.CachedRequest(request_id, [], len(table), 1, k)
        result = worker.execute(
            step.StepRequest(step_id, **{"new_requests" if step_id == 0 else "cached_requests": [request]})
        )
        emitted += result.outputs[0].token_ids
    return emitted


def test_at_k_0_the_head_waits_and_drafts_as_a_fresh_run_when_speculation_resumes(tiny_pair, tmp_path):
    """A sequence the policy keeps at k = 0 leaves the head idle (its features wait, at most CATCH_UP_EVERY
    positions); when it speculates again the head catches up first, so its drafts equal a fresh run's (a propose
    without that catch-up would draft from stale K/V, or not at all), and the output stays plain decoding's."""
    head_dir = save_tiny_eagle3_head(tmp_path / "head", d2t=[124 - i for i in range(150)] + [3] * 50)
    prompt = PROMPTS[3]  # 20 tokens
    plain = run_with_ks(make_worker(tiny_pair), prompt, [0] * 60)
    worker = make_worker(tiny_pair, head_dir, k=3)
    worker.proposer.min_confidence = 0.0
    ks = [0] * 5 + [3] * 4 + [0] * 40 + [2] * 3
    emitted = run_with_ks(worker, prompt, ks)
    assert emitted[: len(plain)] == plain[: len(emitted)] and len(emitted) > len(ks)  # some drafts accepted

    head_counts = []
    for steps in (5, 9, len(ks) - 3):  # k = 0 since the prompt; speculated last; 40 steps at k = 0
        probe = make_worker(tiny_pair, head_dir, k=3)
        run_with_ks(probe, prompt, ks[:steps])
        state = probe.requests["r0"]
        head_counts.append((probe.proposer.num_kv_tokens(state), state.num_computed_tokens))
        fresh = make_worker(tiny_pair, head_dir, k=3)
        fresh.proposer.min_confidence = probe.proposer.min_confidence = 0.0
        Driver(fresh.execute, BLOCK_SIZE, NUM_BLOCKS).generate([state.token_ids[:-1]], 1, keep=True, prefix="f")
        fresh_state = fresh.requests["f0"]
        assert fresh_state.token_ids == state.token_ids
        drafts = probe.proposer.propose([state], [3]).draft_token_ids
        assert drafts == fresh.proposer.propose([fresh_state], [3]).draft_token_ids and len(drafts[0]) == 3
        assert probe.proposer.num_kv_tokens(state) == state.num_computed_tokens
    (idle, computed_idle), (after, computed_after), (later, computed_later) = head_counts
    assert idle == 0 and computed_idle == len(prompt) + 5  # the head never ran
    assert after == computed_after  # caught up after each speculating step
    assert after < later <= computed_later < later + CATCH_UP_EVERY  # ran at k = 0 once enough positions waited


def test_a_worker_process_with_a_bad_head_exits_at_start_saying_why(tiny_pair, tmp_path):
    bad = save_tiny_eagle3_head(tmp_path / "bad", vocab_size=300)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec",
            "worker",
            "--port",
            "0",
            "--model",
            str(tiny_pair.target_path),
            "--proposer",
            "eagle3",
            "--draft-model",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"specdec worker: error: EAGLE-3 head {bad}: vocabulary 300; the target's is 256"
    )


def test_a_resumed_request_on_cached_blocks_drafts_as_a_fresh_run(tiny_pair, tmp_path):
    """Preempted (the worker drops it) and sent again with a prefix-cache hit on its old blocks: the head's
    K/V below the hit is what the blocks hold, and its next drafts equal a fresh run's."""
    head_dir = save_tiny_eagle3_head(tmp_path / "head", d2t=[124 - i for i in range(150)] + [3] * 50)
    worker = make_worker(tiny_pair, head_dir, k=3)
    worker.proposer.min_confidence = 0.0
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    driver.generate([[9] * 5], 13, num_speculative_tokens=3, keep=True)
    old = worker.requests["r0"]
    tokens, table = old.token_ids[:-1], list(old.block_table)
    worker.execute(step.StepRequest(next(driver.step_ids), finished_request_ids=["r0"]))  # preempted
    num_cached = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert worker.proposer.num_kv_tokens(old) >= num_cached  # the head wrote those blocks too
    again = step.NewRequest(
        "again",
        tokens,
        len(tokens),
        step.RequestSampling(temperature=0.0),
        table,
        len(tokens) - num_cached,
        3,
        num_computed_tokens=num_cached,
    )
    worker.execute(step.StepRequest(next(driver.step_ids), new_requests=[again]))
    fresh = make_worker(tiny_pair, head_dir, k=3)
    fresh.proposer.min_confidence = 0.0
    Driver(fresh.execute, BLOCK_SIZE, NUM_BLOCKS).generate([tokens], 1, keep=True, prefix="f")
    resumed, fresh_state = worker.requests["again"], fresh.requests["f0"]
    assert resumed.token_ids == fresh_state.token_ids
    assert (
        worker.proposer.propose([resumed], [3]).draft_token_ids
        == fresh.proposer.propose([fresh_state], [3]).draft_token_ids
    )
    assert torch.equal(worker.proposer._next["again"].feature, fresh.proposer._next["f0"].feature)


def test_a_chain_stops_where_the_heads_confidence_runs_out(tiny_pair, head_dir):
    """The random head is unsure of most tokens: with the default threshold its chains end early (at least one
    draft each), without one they run to k; the drafts they share are the same."""
    drafts = {}
    for threshold in (None, 0.0):
        worker = make_worker(tiny_pair, head_dir, k=5)
        if threshold is not None:
            worker.proposer.min_confidence = threshold
        driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
        driver.generate(PROMPTS, 1, keep=True)
        states = [worker.requests[f"r{i}"] for i in range(len(PROMPTS))]
        proposal = worker.proposer.propose(states, [5] * len(states))
        drafts[threshold] = proposal.draft_token_ids
        assert all(0 < s <= len(d) for s, d in zip(proposal.scores, proposal.draft_token_ids))
    assert all(len(d) == 5 for d in drafts[0.0])
    assert any(len(d) < 5 for d in drafts[None]) and all(len(d) >= 1 for d in drafts[None])
    assert all(full[: len(short)] == short for short, full in zip(drafts[None], drafts[0.0]))
