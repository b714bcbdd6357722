"""Step graphs (worker_service/runtime/graphs.py): the bookkeeping, through the eager replay on the CPU.

A graphed step is padded (sequences to a bucket, rows to the step's most, tables to a power of two) and run
on fixed buffers: its real rows' logits must be the eager step's, bitwise (the CPU's kernels are batch
invariant, as the GPU's invariant layers are), padding must write only the scratch blocks, and the buffers
must stay where they are from one step to the next. Captures themselves need CUDA: the gpu tier runs the
worker's lossless tests with graphs on (the default there).
"""

import gc
import weakref

import pytest
import torch

from tests.worker.driver import Driver
from tests.worker.speculation import test_eagle3, test_speculative
from worker_service.runtime.graphs import BUCKETS, MAX_ROWS, EagerReplay, GraphKey, graph_key, scratch_blocks_needed
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

BLOCK_SIZE = 4
NUM_BLOCKS = 40
SCRATCH = range(NUM_BLOCKS, NUM_BLOCKS + scratch_blocks_needed(BLOCK_SIZE))  # the runner's, past the scheduler's


def chunk(rows: int, start: int, table: list[int], parents=None, num_logits=None) -> SequenceChunk:
    tokens = [3 + (start + i) % 50 for i in range(rows)]
    return SequenceChunk(tokens, start, table, rows if num_logits is None else num_logits, parents)


def test_a_decode_or_verify_step_gets_a_padded_key_and_anything_else_runs_eagerly():
    decode, verify = chunk(1, 6, [1, 2]), chunk(3, 9, [3, 4, 5])
    assert graph_key([decode, verify, decode], (), BLOCK_SIZE) == GraphKey(4, 3, 8, ())
    assert graph_key([verify] * 17, (2,), BLOCK_SIZE) == GraphKey(24, 3, 8, (2,))
    assert graph_key([chunk(1, 60, list(range(16)))], (), BLOCK_SIZE).table_width == 16
    assert graph_key([decode], (), 1).table_width == MAX_ROWS  # room for MAX_ROWS padding rows' scratch
    assert graph_key([chunk(5, 0, [1, 2], num_logits=1)], (), BLOCK_SIZE) is None  # a prefill
    assert graph_key([chunk(3, 9, [3, 4, 5], parents=[-1, 0, 0])], (), BLOCK_SIZE) is None  # a tree
    assert graph_key([chunk(MAX_ROWS + 1, 9, list(range(12)))], (), BLOCK_SIZE) is None
    assert graph_key([decode] * (BUCKETS[-1] + 1), (), BLOCK_SIZE) is None
    assert graph_key([], (), BLOCK_SIZE) is None


def runners(tiny_pair):
    """An eager runner and one that graphs (eager replay), on the same weights, their caches prefilled alike."""
    eager = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    graphed = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    graphed.use_graphs(EagerReplay)
    for runner in (eager, graphed):
        runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
        prefills = [chunk(9, 0, [1, 2, 3], num_logits=1), chunk(6, 0, [4, 5], num_logits=1)]
        runner.forward(prefills + [chunk(11, 0, [6, 7, 8], num_logits=1)])  # eager: prefill chunks
    return eager, graphed


def test_graphed_steps_give_the_eager_steps_logits_and_touch_only_their_slots(tiny_pair):
    eager, graphed = runners(tiny_pair)
    assert graphed.kv_cache.num_blocks == SCRATCH.stop and eager.kv_cache.num_blocks == NUM_BLOCKS
    steps = [
        [chunk(1, 9, [1, 2, 3]), chunk(1, 6, [4, 5]), chunk(1, 11, [6, 7, 8])],  # decodes: 3 -> bucket 4
        [chunk(4, 10, [1, 2, 3, 9]), chunk(1, 7, [4, 5]), chunk(2, 12, [6, 7, 8, 10])],  # verifies, mixed k
        [chunk(2, 14, [1, 2, 3, 9])],  # one verify
    ]
    graphed.aux_layers = eager.aux_layers = (1, 3)  # as an EAGLE-3 head asks: their rows come back too
    for chunks in steps:
        layers = range(len(graphed.kv_cache.key_caches))
        before = [graphed.kv_cache.keys(i).clone() for i in layers]  # [blocks, block size, KVH, D] each
        want, got = eager.forward(chunks), graphed.forward(chunks)
        assert torch.equal(got, want)
        assert torch.equal(graphed.last_aux_hidden, eager.last_aux_hidden)
        written = {(t[p // BLOCK_SIZE], p % BLOCK_SIZE) for c in chunks for t in [c.block_table] for p in
                   range(c.start_pos, c.start_pos + len(c.token_ids))}  # fmt: skip
        for old, new in zip(before, map(graphed.kv_cache.keys, layers)):
            changed = {(b, o) for b, o in (old != new).any(-1).any(-1).nonzero().tolist()}
            assert {b for b, _ in changed - written} <= set(SCRATCH)  # the rest: scratch blocks only
    assert len(graphed.graphs.graphs) == 3  # three keys: (4, 1), (4, 4), (1, 2)
    for a, b in zip(eager.kv_cache.key_caches, graphed.kv_cache.key_caches):
        assert torch.equal(a, b[:NUM_BLOCKS])  # every request's K/V as the eager runner wrote it


def test_a_keys_buffers_stay_in_place_across_steps(tiny_pair):
    _, graphed = runners(tiny_pair)
    graphed.forward([chunk(1, 9, [1, 2, 3]), chunk(1, 6, [4, 5])])
    (graph,) = graphed.graphs.graphs.values()
    addresses = (graph.int64.data_ptr(), graph.int32.data_ptr())
    graphed.forward([chunk(1, 10, [1, 2, 3]), chunk(1, 7, [4, 5])])
    graphed.forward([chunk(1, 12, [6, 7, 8, 9])])  # another bucket: another graph, the first untouched
    assert len(graphed.graphs.graphs) == 2
    assert (graph.int64.data_ptr(), graph.int32.data_ptr()) == addresses


def test_padding_rows_write_only_the_scratch_blocks(tiny_pair):
    _, graphed = runners(tiny_pair)
    chunks = [chunk(3, 9, [1, 2, 3]), chunk(1, 6, [4, 5])]
    key = graph_key(chunks, (), BLOCK_SIZE)
    int64, int32, real = graphed.graphs.host_inputs(chunks, key)
    n = key.num_tokens
    slots = int64[2 * n :]
    scratch = {b * BLOCK_SIZE + o for b in SCRATCH for o in range(BLOCK_SIZE)}
    assert real == [0, 1, 2, 3]  # sequence 0's three rows, sequence 1's first
    assert slots[:3] == [3 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 3]  # block 3: table entry 2
    assert slots[3] == 5 * BLOCK_SIZE + 2
    assert set(slots[4:]) <= scratch and set(slots[:4]).isdisjoint(scratch)
    seq_lens = int32[key.num_seqs * key.table_width : -(key.num_seqs + 1)]
    assert seq_lens == [12, 9]  # each sequence's rows padded to 3: the causal bound keeps padding out


@pytest.mark.parametrize("proposer, ks", [("none", 0), ("ngram", [1, 2, 3, 4, 5]), ("draft", 3)])
def test_greedy_speculation_with_graphs_is_plain_decoding(tiny_pair, proposer, ks):
    plain = Driver(test_speculative.make_worker(tiny_pair).execute, test_speculative.BLOCK_SIZE, 400).generate(
        test_speculative.PROMPTS, 16
    )
    worker = test_speculative.make_worker(tiny_pair, proposer, 5 if proposer != "none" else 0)
    for runner in filter(None, (worker.target, worker.draft)):
        runner.use_graphs(EagerReplay)
        runner.init_cache(400, test_speculative.BLOCK_SIZE)
    driver = Driver(worker.execute, test_speculative.BLOCK_SIZE, 400)
    assert driver.generate(test_speculative.PROMPTS, 16, num_speculative_tokens=ks) == plain
    assert len(worker.target.graphs.graphs) >= 1


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chains", "trees"])
def test_greedy_eagle3_with_graphs_is_plain_decoding(tiny_pair, tiny_eagle3_head, tree_width):
    """The head reads the target's aux hidden states, which a graphed step returns for its real rows; a tree
    step runs eagerly."""
    plain = Driver(test_eagle3.make_worker(tiny_pair).execute, test_eagle3.BLOCK_SIZE, 400).generate(
        test_speculative.PROMPTS, 16
    )
    worker = test_eagle3.make_worker(tiny_pair, tiny_eagle3_head, k=4, tree_width=tree_width)
    worker.proposer.min_confidence = 0.0
    worker.target.use_graphs(EagerReplay)
    worker.target.init_cache(test_eagle3.NUM_BLOCKS, test_eagle3.BLOCK_SIZE)
    driver = Driver(worker.execute, test_eagle3.BLOCK_SIZE, test_eagle3.NUM_BLOCKS)
    assert driver.generate(test_speculative.PROMPTS, 16, num_speculative_tokens=[1, 2, 3, 4, 4]) == plain
    assert (len(worker.target.graphs.graphs) > 0) == (tree_width == 1)  # a full tree step runs eagerly


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-forward", "transformers-modules"])
def test_the_heads_draft_steps_replay_graphs_and_draft_what_its_eager_steps_draft(tiny_pair, tiny_eagle3_head, fast):
    """The EAGLE-3 head's chain steps (one row per drafting sequence, its feature an extra input) and its
    catch-ups (a row per committed position, up to a verify's) replay graphs: the same drafts as eager steps,
    every one (the CPU's head is batch invariant; CUDA's fp32 linears are not, so there drafts may differ, and
    outputs may not), and plain decoding's outputs. Through the head's CPU forward, and through the
    `transformers` modules a GPU runs."""
    runs = {}
    for graphed in (False, True):
        worker = test_eagle3.make_worker(tiny_pair, tiny_eagle3_head, k=4)
        worker.proposer.min_confidence = 0.0
        head = worker.proposer.head
        if not fast:
            head.fast = None
        if graphed:
            head.use_graphs(EagerReplay)
            head.init_cache(test_eagle3.NUM_BLOCKS, test_eagle3.BLOCK_SIZE)
        drafts = []

        def recording(states, num_drafts, propose=worker.proposer.propose, drafts=drafts):
            proposal = propose(states, num_drafts)
            drafts.append(proposal.draft_token_ids)
            return proposal

        worker.proposer.propose = recording
        driver = Driver(worker.execute, test_eagle3.BLOCK_SIZE, test_eagle3.NUM_BLOCKS)
        outputs = driver.generate(test_speculative.PROMPTS, 16, num_speculative_tokens=[1, 2, 3, 4, 4])
        runs[graphed] = (drafts, outputs)
        assert (head.graphs is not None and len(head.graphs.graphs) > 0) == graphed
    assert runs[True] == runs[False]
    assert sum(len(d) for step in runs[True][0] for d in step) > 0


def test_the_table_width_covers_where_padding_rows_read():
    """A sequence whose table is full up to its real rows still has padding rows after them: they read the
    table at their positions, which the width must cover (else they read the next sequence's row)."""
    full = chunk(1, 31, list(range(8)))  # 8 blocks of 4: positions 0..31, all its table holds
    assert graph_key([full], (), BLOCK_SIZE).table_width == 8
    assert graph_key([full, chunk(3, 2, [9])], (), BLOCK_SIZE).table_width == 16  # rows 32, 33 need block 9


class FailingReplay(EagerReplay):
    """A capture that fails for shapes of more than 2 rows, as an out-of-memory or an illegal op would."""

    def __init__(self, fn, pool=None):
        if fn()[0].shape[0] > 2:
            raise RuntimeError("capture failed")
        super().__init__(fn, pool)


def test_a_failed_capture_runs_that_shape_eagerly_and_keeps_the_others(tiny_pair, monkeypatch):
    eager, graphed = runners(tiny_pair)
    monkeypatch.setattr(graphed.graphs, "replay_type", FailingReplay)
    decodes = [chunk(1, 9, [1, 2, 3]), chunk(1, 6, [4, 5])]
    verifies = [chunk(3, 10, [1, 2, 3, 9]), chunk(2, 6, [4, 5])]
    for chunks in (decodes, verifies, [chunk(1, 13, [1, 2, 3, 9]), chunk(1, 9, [4, 5, 10])]):
        assert torch.equal(graphed.forward(chunks), eager.forward(chunks))
    assert len(graphed.graphs.failed) == 1 and len(graphed.graphs.graphs) == 1  # the decode key still replays


def test_a_shape_whose_logits_pass_the_cap_runs_eagerly(tiny_pair, monkeypatch):
    eager, graphed = runners(tiny_pair)
    monkeypatch.setattr("worker_service.runtime.graphs.MAX_GRAPH_OUTPUT_BYTES", 4 * graphed.vocab_size * 4)
    small, large = [chunk(1, 9, [1, 2, 3])], [chunk(3, 10, [1, 2, 3, 9]), chunk(2, 6, [4, 5])]
    for chunks in (small, large):
        assert torch.equal(graphed.forward(chunks), eager.forward(chunks))
    assert [key.num_tokens for key in graphed.graphs.graphs] == [1]  # 2 sequences x 3 rows: past the cap


def test_a_new_cache_frees_the_old_one_and_its_graphs(tiny_pair):
    """A graph's replay holds the graph, which holds the KV cache it reads: a cycle. init_cache breaks it, so
    the old cache is gone before the new one is allocated (both may not fit), with the collector off too."""
    _, graphed = runners(tiny_pair)
    graphed.forward([chunk(1, 9, [1, 2, 3])])
    assert graphed.graphs.graphs  # a graph holds the cache
    old = weakref.ref(graphed.kv_cache.key_caches[0])
    gc.disable()
    try:
        graphed.init_cache(NUM_BLOCKS, BLOCK_SIZE)
        assert old() is None
    finally:
        gc.enable()
