"""Paged attention: the SDPA path vs dense ground truth and HF SDPA; Triton vs SDPA.

The CPU's C kernel has its own tests (test_paged_attention_cpu.py), on these cases.
"""

from dataclasses import dataclass
import math

import pytest
import torch

from kernels._triton import HAS_TRITON
import kernels.paged_attention as pa

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")

# (q_len, seq_len) per sequence; seq_len includes the query tokens.
CASES = {
    "decode_batch": [(1, 7), (1, 20), (1, 33), (1, 1)],
    "decode_same_len": [(1, 20), (1, 20)],
    "five_token_queries": [(5, 12), (5, 40), (5, 5)],
    "prefill_no_prefix": [(13, 13)],
    "prefill_same_len": [(9, 9), (9, 9)],
    "four_lengths": [(3, 3), (10, 10), (17, 17), (6, 6)],
    "mixed": [(12, 30), (1, 18), (5, 25), (7, 7), (1, 3), (5, 9)],
}


@dataclass
class Case:
    """A paged batch plus the dense per-sequence K/V it was built from."""

    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    dense_keys: list  # B x [L, KVH, D]
    dense_values: list  # B x [L, KVH, D]
    scale: float

    def args(self, device: str = "cpu") -> tuple:
        tensors = (self.query, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc, self.seq_lens)
        return (*(t.to(device) for t in tensors), self.scale)


def make_case(specs, block_size, num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, seed=0):
    """Write random dense K/V into shuffled blocks of a cache full of large garbage."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Garbage is large so that reading a slot outside the causal range shows at once.
    key_cache = 30 * torch.randn(shape, generator=gen)
    value_cache = 30 * torch.randn(shape, generator=gen)
    block_tables = torch.full((len(specs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    free_ids = torch.randperm(num_blocks, generator=gen).tolist()
    dense_keys, dense_values = [], []
    for b, (_, seq_len) in enumerate(specs):
        ids = [free_ids.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        positions = torch.arange(seq_len)  # [L]
        slots = torch.tensor(ids)[positions // block_size] * block_size + positions % block_size  # [L]
        dense_keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        dense_values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = dense_keys[-1]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = dense_values[-1]
    q_lens = torch.tensor([q_len for q_len, _ in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen)
    return Case(
        query.to(dtype),
        key_cache.to(dtype),
        value_cache.to(dtype),
        block_tables,
        query_start_loc,
        torch.tensor([s for _, s in specs], dtype=torch.int32),
        dense_keys,
        dense_values,
        1 / math.sqrt(head_dim),
    )


def dense_attention(case: Case) -> torch.Tensor:  # [T, H, D] float64
    """Ground truth: softmax(QK^T * scale + causal mask) V per sequence, in float64."""
    outs = []
    starts = case.query_start_loc.tolist()
    for b, (keys, values) in enumerate(zip(case.dense_keys, case.dense_values)):
        q = case.query[starts[b] : starts[b + 1]].double()  # [Q, H, D]
        group = q.shape[1] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = values.double().repeat_interleave(group, dim=1)  # [L, H, D]
        q_len, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale  # [H, Q, L]
        visible = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]  # [Q, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, Q, L]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))  # [Q, H, D]
    return torch.cat(outs)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_sdpa_matches_dense(name, block_size, heads):
    case = make_case(CASES[name], block_size, num_heads=heads[0], num_kv_heads=heads[1])
    out = pa.paged_attention_sdpa(*case.args())
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    assert (out.double() - dense_attention(case)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "name, expected_groups, is_uniform",
    [("five_token_queries", [3], True), ("decode_batch", [4], True), ("mixed", [1, 2, 2, 1], False)],
)
def test_sdpa_batches_sequences_by_q_len(monkeypatch, name, expected_groups, is_uniform):
    """Uniform batches take the no-regrouping fast path; mixed ones one SDPA call per q_len."""
    group_sizes, num_regroupings = [], []
    attend, group_by_q_len = pa.attend_uniform, pa.group_by_q_len

    def spy_attend(query, *args):
        group_sizes.append(query.shape[0])
        return attend(query, *args)

    def spy_group(q_lens):
        num_regroupings.append(1)
        return group_by_q_len(q_lens)

    monkeypatch.setattr(pa, "attend_uniform", spy_attend)
    monkeypatch.setattr(pa, "group_by_q_len", spy_group)
    case = make_case(CASES[name], block_size=4)
    out = pa.paged_attention_sdpa(*case.args())
    assert group_sizes == expected_groups
    assert len(num_regroupings) == (0 if is_uniform else 1)
    assert (out.double() - dense_attention(case)).abs().max() <= 1e-5


def test_sdpa_matches_transformers_sdpa():
    """Same numbers as the attention `transformers` runs with a contiguous cache."""
    sdpa_attention = pytest.importorskip("transformers.integrations.sdpa_attention")
    case = make_case(CASES["mixed"], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16)
    out = pa.paged_attention_sdpa(*case.args())  # [T, H, D]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    starts = case.query_start_loc.tolist()
    for b, (keys, values) in enumerate(zip(case.dense_keys, case.dense_values)):
        q = case.query[starts[b] : starts[b + 1]].transpose(0, 1)[None]  # [1, H, Q, L]
        q_len, seq_len = q.shape[2], keys.shape[0]
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)[None, None]  # [1, 1, Q, L]
        expected, _ = sdpa_attention.sdpa_attention_forward(
            module,
            q,
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attention_mask=None if q_len == seq_len else mask,
            scaling=case.scale,
        )  # [1, Q, H, D]
        assert (out[starts[b] : starts[b + 1]] - expected[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["five_token_queries", "mixed"])
def test_sdpa_bf16(name):
    case = make_case(CASES[name], block_size=4, dtype=torch.bfloat16)
    out = pa.paged_attention_sdpa(*case.args())
    assert out.dtype == torch.bfloat16
    assert (out.double() - dense_attention(case)).abs().max() <= 3e-2


def test_dispatcher_uses_the_c_kernel_on_cpu():
    case = make_case(CASES["mixed"], block_size=4)
    assert torch.equal(pa.paged_attention(*case.args()), pa.cpu_kernel.paged_attention_cpu(*case.args()))


def test_dispatcher_falls_back_to_sdpa_without_the_c_kernel(monkeypatch):
    monkeypatch.setattr(pa.cpu_kernel, "available", lambda: False)
    case = make_case(CASES["mixed"], block_size=4)
    assert torch.equal(pa.paged_attention(*case.args()), pa.paged_attention_sdpa(*case.args()))


@requires_triton
@pytest.mark.parametrize(
    "name, block_size, heads, head_dim",
    [
        ("mixed", 4, (4, 2), 8),
        ("mixed", 16, (4, 1), 12),
        ("five_token_queries", 16, (2, 2), 8),
        ("four_lengths", 4, (4, 2), 8),
    ],
)
def test_triton_matches_ref(name, block_size, heads, head_dim, triton_device):
    case = make_case(CASES[name], block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
    expected = pa.paged_attention_sdpa(*case.args())
    out = pa.paged_attention_triton(*case.args(triton_device))
    assert (out.cpu() - expected).abs().max() <= 1e-4


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_triton_row_does_not_depend_on_its_batch(dtype, triton_device):
    """Each row of a batch of prefills, decodes and verifies (tiles of 5 rows x 3 heads, so rows sit at every
    place of a tile) equals bitwise the same row computed alone, a one-row decode at its position."""
    specs = CASES["mixed"]
    case = make_case(specs, 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    together = pa.paged_attention_triton(*case.args(triton_device), max_query_len=12).cpu()
    assert rows_unlike_alone(case, specs, together, triton_device) == []


def rows_unlike_alone(case, specs, together: torch.Tensor, device: str) -> list[int]:
    """The rows of `together` (the Triton kernel's output for the whole case) that differ from the same row
    computed alone, a one-row decode at its position."""
    query, key_cache, value_cache, tables, _, _, scale = case.args(device)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    differ = []
    for b, (q_len, seq_len) in enumerate(specs):
        for i in range(q_len):
            token = int(case.query_start_loc[b]) + i
            position = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32, device=device)
            alone = pa.paged_attention_triton(
                query[token : token + 1], key_cache, value_cache, tables[b : b + 1], one, position, scale
            )
            if not torch.equal(together[token], alone[0].cpu()):
                differ.append(token)
    return differ


@requires_triton
def test_stale_values_past_a_row_do_not_reach_it(triton_device):
    """A tile reads up to its last row's keys. A row whose later rows' slots hold stale non-finite values (a
    graph's padding rows, whose K/V go to scratch blocks, sit past the step's real rows) gets its own result,
    finite, bit for bit the row alone."""
    case = make_case([(3, 22)], 4, num_heads=4, num_kv_heads=2, head_dim=16)
    table = case.block_tables[0].long()
    for position, value in ((20, float("nan")), (21, float("inf"))):
        case.key_cache[table[position // 4], position % 4] = value
        case.value_cache[table[position // 4], position % 4] = value
    query, key_cache, value_cache, tables, starts, _, scale = case.args(triton_device)
    padded = pa.paged_attention_triton(*case.args(triton_device)).cpu()
    one = torch.tensor([0, 1], dtype=torch.int32, device=triton_device)
    alone = pa.paged_attention_triton(
        query[:1],
        key_cache,
        value_cache,
        tables,
        one,
        torch.tensor([20], dtype=torch.int32, device=triton_device),
        scale,
    ).cpu()
    assert torch.isfinite(padded[0]).all() and torch.equal(padded[0], alone[0])


# Contexts past SPLIT_KEYS (512): rows of 1, 2 and 3 splits, and rows on either side of a split's end.
LONG = [(1, 1300), (6, 700), (3, 513), (1, 512), (2, 30)]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_long_rows_are_the_same_split_in_programs_or_in_turn(dtype, triton_device, monkeypatch):
    """A row's keys are cut at multiples of SPLIT_KEYS and the splits merged in order: a program per split
    (and the combining kernel), one program over all of them, and the row alone give the same bits, near
    SDPA's result."""
    case = make_case(LONG, 16, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype)
    args = case.args(triton_device)
    parallel = pa.paged_attention_triton(*args, max_query_len=6).cpu()
    monkeypatch.setattr(pa, "PARALLEL_BYTES", 0)  # every split in turn, by the tile's program
    in_turn = pa.paged_attention_triton(*args, max_query_len=6).cpu()
    assert torch.equal(parallel, in_turn)
    monkeypatch.undo()
    assert rows_unlike_alone(case, LONG, parallel, triton_device) == []
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert (parallel.double() - dense_attention(case)).abs().max() <= tolerance


@requires_triton
def test_triton_keys_cut_shorter_merge_to_the_same_attention(triton_device, monkeypatch):
    """split_keys (the benchmark's choice of where to cut): rows of 1..6 splits of 128 keys, a program per
    split or one over all giving the same bits, near SDPA's result."""
    rows = [(1, 700), (3, 129), (2, 128), (1, 30)]
    case = make_case(rows, 16, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    args = case.args(triton_device)
    parallel = pa.paged_attention_triton(*args, max_query_len=3, split_keys=128).cpu()
    monkeypatch.setattr(pa, "PARALLEL_BYTES", 0)
    assert torch.equal(pa.paged_attention_triton(*args, max_query_len=3, split_keys=128).cpu(), parallel)
    assert (parallel.double() - dense_attention(case)).abs().max() <= 1e-4
    with pytest.raises(AssertionError, match="multiple"):
        pa.paged_attention_triton(*args, split_keys=100)


@requires_triton
def test_triton_bf16_matches_dense(triton_device):
    """bf16 caches and queries: products accumulated in fp32, the probabilities rounded to bf16."""
    case = make_case(CASES["mixed"], block_size=4, dtype=torch.bfloat16)
    out = pa.paged_attention_triton(*case.args(triton_device))
    assert out.dtype == torch.bfloat16
    assert (out.cpu().double() - dense_attention(case)).abs().max() <= 3e-2
