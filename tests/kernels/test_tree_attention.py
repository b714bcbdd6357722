"""Draft-tree attention: the C kernel, Triton (interpreted on the CPU; CUDA in the gpu tier) and SDPA equal
dense attention over each row's prefix and path; a chain is today's causal result bit for bit; a tree row
is bitwise a one-row decode over its path (what keeps tree verification lossless in bf16)."""

import random

import pytest
import torch

from kernels import cpu_build
from kernels import paged_attention_cpu as cpu_kernel
from kernels.draft_tree import DraftTrees
import kernels.paged_attention as pa
from tests.kernels.test_paged_attention import make_case, requires_triton
from tests.worker.runtime.test_fast_linear import NARROWER_BUILDS

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def random_tree(rng: random.Random, num_nodes: int, max_depth: int, max_width: int) -> list[int]:
    """Parents of a random draft tree in a topological order: row 0 the root (after the cached prefix), every
    other row's parent an earlier row with fewer than max_width children and depth < max_depth."""
    parents, depths, num_children = [-1], [0], [0]
    while len(parents) < num_nodes:
        open_rows = [i for i in range(len(parents)) if depths[i] < max_depth and num_children[i] < max_width]
        if not open_rows:
            break
        parent = rng.choice(open_rows)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        num_children.append(0)
        num_children[parent] += 1
    return parents


def chain(q_len: int) -> list[int]:
    return list(range(-1, q_len - 1))


def tree_batch(seed: int, context: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Specs ((q_len, seq_len) per sequence) and parents of a batch mixing a prefill chunk, a decode, a
    (k+1)-token chain (a tree of width 1) and three trees of depth 1-8 and width 2-4."""
    rng = random.Random(seed)
    trees = [random_tree(rng, 30, 8, 4)]  # the largest
    while len(trees) < 3:  # two more, each branching somewhere (a tree of width 1 is a chain)
        parents = random_tree(rng, rng.randint(3, 24), rng.randint(1, 8), rng.randint(2, 4))
        trees += [parents] if parents != chain(len(parents)) else []
    sequences = [chain(9), trees[0], chain(1), trees[1], random_tree(rng, 5, 5, 1), trees[2]]
    specs = [(len(p), context + rng.randint(0, 20) + len(p)) for p in sequences]
    specs[0] = (9, 9)  # a prefill from position 0
    return specs, [p for parents in sequences for p in parents]


def dense_tree_attention(case, trees: DraftTrees) -> torch.Tensor:  # [T, H, D] float64
    """Ground truth: softmax over the keys each row sees (its prefix and path), in float64."""
    outs = []
    starts, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    for b, (keys, values) in enumerate(zip(case.dense_keys, case.dense_values)):
        q = case.query[starts[b] : starts[b + 1]].double()  # [Q, H, D]
        group = q.shape[1] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = values.double().repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale  # [H, Q, L]
        visible = trees.visible(starts, lens, b)  # [Q, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, Q, L]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))  # [Q, H, D]
    return torch.cat(outs)


def chains_as_trees(specs) -> DraftTrees:
    """Chains of these (q_len, seq_len) sequences, every one flagged a tree: they take the tree path."""
    starts = [sum(q for q, _ in specs[:b]) for b in range(len(specs))]
    paths = [list(range(seq_len - q_len, seq_len - q_len + i + 1)) for q_len, seq_len in specs for i in range(q_len)]
    return DraftTrees.from_paths(starts, [seq_len - q_len for q_len, seq_len in specs], paths)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 8), ((4, 4), 8), ((9, 3), 64)], ids=["gqa", "mha", "smollm2"])
@pytest.mark.parametrize("context", [3, 150])
def test_c_and_sdpa_equal_dense_on_random_trees(context, heads, head_dim, dtype):
    specs, parents = tree_batch(seed=context + heads[0] + head_dim, context=context)
    case = make_case(specs, 16, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    assert trees.is_tree.tolist() == [0, 1, 0, 1, 0, 1]
    want = dense_tree_attention(case, trees)
    for name, attention in (("c", cpu_kernel.paged_attention_cpu), ("sdpa", pa.paged_attention_sdpa)):
        out = attention(*case.args(), trees)
        assert out.dtype == dtype
        assert (out.double() - want).abs().max() <= TOLERANCE[dtype], name
    # The trees matter: causal attention over the same rows sees siblings and cousins, and differs.
    assert (cpu_kernel.paged_attention_cpu(*case.args()).double() - want).abs().max() > 0.1


@requires_triton
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_triton_equals_dense_on_random_trees(heads, dtype, triton_device):
    specs, parents = tree_batch(seed=heads[1], context=20)
    case = make_case(specs, 4, num_heads=heads[0], num_kv_heads=heads[1], head_dim=8, dtype=dtype)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    out = pa.paged_attention_triton(*case.args(triton_device), trees.to(triton_device))
    assert (out.cpu().double() - dense_tree_attention(case, trees)).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_a_chain_sent_as_a_tree_is_the_causal_result_bitwise(dtype):
    """Chains down the tree path (every sequence flagged a tree, paths 0..i) give bitwise today's causal
    result, in the C kernel and in the SDPA reference."""
    specs = [(5, 40), (1, 7), (5, 200), (3, 3)]
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    trees = chains_as_trees(specs)
    for attention in (cpu_kernel.paged_attention_cpu, pa.paged_attention_sdpa):
        assert torch.equal(attention(*case.args(), trees), attention(*case.args()))


@requires_triton
def test_triton_chain_sent_as_a_tree_is_the_causal_result_bitwise(triton_device):
    specs = [(5, 40), (1, 7), (3, 3)]
    case = make_case(specs, 4, num_heads=4, num_kv_heads=2, head_dim=8)
    trees = chains_as_trees(specs).to(triton_device)
    args = case.args(triton_device)
    assert torch.equal(pa.paged_attention_triton(*args, trees), pa.paged_attention_triton(*args))


def decode_over_path(
    case, trees: DraftTrees, token: int, seq: int, attention=cpu_kernel.paged_attention_cpu, device: str = "cpu"
) -> torch.Tensor:  # [H, D]
    """Row `token` (of sequence `seq`) as a one-row decode by `attention`: its prefix and path copied to the
    front of a fresh sequence's blocks, at the positions a plain decode would have written them."""
    path = trees.paths[token][trees.paths[token] >= 0].long()
    positions = torch.cat([torch.arange(int(trees.prefix_lens[seq])), path])  # [n] where its keys are
    block_size = case.key_cache.shape[1]
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    table = case.block_tables[seq].long()
    slots = table[positions // block_size] * block_size + positions % block_size  # [n]
    fresh_ids = [b for b in range(key_cache.shape[0]) if b not in set(case.block_tables.flatten().tolist())]
    num_blocks = -(-len(positions) // block_size)
    fresh = torch.tensor(fresh_ids[:num_blocks])  # blocks no sequence uses
    offsets = torch.arange(len(positions))  # [n]
    fresh_slots = fresh[offsets // block_size] * block_size + offsets % block_size
    for cache in (key_cache, value_cache):
        flat = cache.view(-1, *cache.shape[2:])
        flat[fresh_slots] = flat[slots].clone()
    tensors = (
        case.query[token : token + 1],
        key_cache,
        value_cache,
        fresh[None].to(torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([len(positions)], dtype=torch.int32),
    )
    return attention(*(t.to(device) for t in tensors), case.scale)[0].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("context", [10, 140])
def test_tree_rows_read_transposed_keys_to_the_same_bits(dtype, context):
    """Tree rows over K kept transposed (kv_cache.py): their prefixes a tile of keys at a time, their paths a key
    at a time, bitwise what the usual layout gives."""
    specs, parents = tree_batch(seed=context, context=context)
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    query, keys, *rest = case.args()
    want = cpu_kernel.paged_attention_cpu(query, keys, *rest, trees)
    transposed = keys.permute(0, 2, 3, 1).contiguous()  # [num_blocks, KVH, D, block_size]
    assert torch.equal(cpu_kernel.paged_attention_cpu(query, transposed, *rest, trees, keys_transposed=True), want)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("context", [10, 140])
def test_a_tree_row_is_bitwise_a_decode_over_its_path(dtype, context):
    """Each tree row, computed among others (1 or 2 threads), equals bitwise a one-row decode at its position
    over its prefix and path: a verified tree emits plain decoding's tokens in bf16 too."""
    specs, parents = tree_batch(seed=context, context=context)
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    # spare blocks for the decodes' copies
    case.key_cache = torch.cat([case.key_cache, torch.zeros(12, *case.key_cache.shape[1:], dtype=dtype)])
    case.value_cache = torch.cat([case.value_cache, torch.zeros(12, *case.value_cache.shape[1:], dtype=dtype)])
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    starts = case.query_start_loc.tolist()
    threads = torch.get_num_threads()
    for num_threads in (1, threads):
        torch.set_num_threads(num_threads)
        try:
            together = cpu_kernel.paged_attention_cpu(*case.args(), trees)  # [T, H, D]
            differ = [
                (seq, token)
                for seq in (1, 3, 5)
                for token in range(starts[seq], starts[seq + 1])
                if not torch.equal(together[token], decode_over_path(case, trees, token, seq))
            ]
        finally:
            torch.set_num_threads(threads)
        assert differ == [], num_threads


@requires_triton
def test_triton_trees_past_a_split_are_the_same_in_programs_or_in_turn(triton_device, monkeypatch):
    """Prefixes past SPLIT_KEYS: a tree row's logical keys (its prefix, then its path) split at the same
    places whether each split has its program or the row's program does them in turn."""
    specs = [(6, pa.SPLIT_KEYS + 30), (1, 2 * pa.SPLIT_KEYS + 300), (4, pa.SPLIT_KEYS - 2)]
    parents = [-1, 0, 0, 1, 2, 1] + [-1] + [-1, 0, 0, 1]
    case = make_case(specs, 16, num_heads=4, num_kv_heads=2, head_dim=16)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    args = (*case.args(triton_device), trees.to(triton_device))
    parallel = pa.paged_attention_triton(*args).cpu()
    monkeypatch.setattr(pa, "PARALLEL_BYTES", 0)
    assert torch.equal(pa.paged_attention_triton(*args).cpu(), parallel)
    assert (parallel.double() - dense_tree_attention(case, trees)).abs().max() <= 1e-5


@requires_triton
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_a_triton_tree_row_is_bitwise_a_decode_over_its_path(dtype, triton_device):
    """The Triton kernel's tree rows (a tile each) against its one-row decodes (a chain tile)."""
    specs, parents = tree_batch(seed=5, context=70)
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    case.key_cache = torch.cat([case.key_cache, torch.zeros(12, *case.key_cache.shape[1:], dtype=dtype)])
    case.value_cache = torch.cat([case.value_cache, torch.zeros(12, *case.value_cache.shape[1:], dtype=dtype)])
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    together = pa.paged_attention_triton(*case.args(triton_device), trees.to(triton_device)).cpu()
    starts = case.query_start_loc.tolist()
    differ = [
        (seq, token)
        for seq in (1, 3)
        for token in range(starts[seq], starts[seq + 1])
        if not torch.equal(
            together[token], decode_over_path(case, trees, token, seq, pa.paged_attention_triton, triton_device)
        )
    ]
    assert differ == []


@pytest.mark.parametrize("build", list(NARROWER_BUILDS))
def test_every_instruction_set_gives_the_same_tree_bits(build):
    narrow = cpu_kernel.bind(cpu_build.load_library("paged_attention_cpu", NARROWER_BUILDS[build]))
    specs, parents = tree_batch(seed=7, context=140)
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    want = cpu_kernel.paged_attention_cpu(*case.args(), trees)
    assert torch.equal(cpu_kernel.paged_attention_cpu(*case.args(), trees, function=narrow), want)


def test_the_dispatcher_passes_trees_on():
    specs, parents = tree_batch(seed=3, context=30)
    case = make_case(specs, 16)
    trees = DraftTrees.from_parents(case.query_start_loc.tolist(), case.seq_lens.tolist(), parents)
    assert torch.equal(pa.paged_attention(*case.args(), trees), cpu_kernel.paged_attention_cpu(*case.args(), trees))


def test_from_parents_computes_depths_and_paths():
    trees = DraftTrees.from_parents([0, 1, 6], [4, 10], [-1, -1, 0, 0, 1, 3])
    assert trees.is_tree.tolist() == [0, 1] and trees.prefix_lens.tolist() == [0, 5]
    assert trees.depths.tolist() == [0, 0, 1, 1, 2, 3]
    assert trees.paths.tolist()[1:] == [[5, -1, -1, -1], [5, 6, -1, -1], [5, 7, -1, -1], [5, 6, 8, -1], [5, 6, 8, 9]]


@pytest.mark.parametrize("parents", [[-1, 1], [-1, -2], [0, 0]])
def test_from_parents_refuses_a_parent_that_is_not_an_earlier_row(parents):
    with pytest.raises(ValueError, match="an earlier row of the same sequence"):
        DraftTrees.from_parents([0, 2], [2], parents)


def level_batch(dtype, context: int = 40):
    """A drafter's third level: per tree sequence, 3 levels of 2 nodes were written after a prefix of `context`
    keys (positions context .. context + 5) and the query is the newest level (2 rows at the end), each row's
    path two earlier nodes and itself. Beside them a decode and a chain."""
    specs = [(2, context + 6), (1, 30), (2, context + 8), (3, 50)]
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    starts = case.query_start_loc.tolist()
    paths = [
        [context + 1, context + 2, context + 4],
        [context + 1, context + 3, context + 5],
        None,
        [context, context + 3, context + 6],
        [context + 1, context + 2, context + 7],
        None,
        None,
        None,
    ]
    trees = DraftTrees.from_paths(starts[:-1], [context, 0, context, 0], paths)
    assert trees.is_tree.tolist() == [1, 0, 1, 0]
    return case, trees


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_a_level_whose_ancestors_came_earlier_equals_dense(dtype):
    case, trees = level_batch(dtype)
    want = dense_tree_attention(case, trees)
    for attention in (cpu_kernel.paged_attention_cpu, pa.paged_attention_sdpa):
        assert (attention(*case.args(), trees).double() - want).abs().max() <= TOLERANCE[dtype]
    case.key_cache = torch.cat([case.key_cache, torch.zeros(6, *case.key_cache.shape[1:], dtype=dtype)])
    case.value_cache = torch.cat([case.value_cache, torch.zeros(6, *case.value_cache.shape[1:], dtype=dtype)])
    together = cpu_kernel.paged_attention_cpu(*case.args(), trees)
    starts = case.query_start_loc.tolist()
    for seq in (0, 2):
        for token in range(starts[seq], starts[seq + 1]):
            assert torch.equal(together[token], decode_over_path(case, trees, token, seq)), token


@requires_triton
def test_triton_level_whose_ancestors_came_earlier_equals_dense(triton_device):
    case, trees = level_batch(torch.float32, context=10)
    out = pa.paged_attention_triton(*case.args(triton_device), trees.to(triton_device))
    assert (out.cpu().double() - dense_tree_attention(case, trees)).abs().max() <= 1e-5
