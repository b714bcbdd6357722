"""The CPU's C attention kernel: the same numbers as dense attention, and bitwise batch invariance."""

import importlib

import pytest
import torch

from kernels import cpu_build
from kernels import paged_attention_cpu as cpu_kernel
from tests.kernels.test_paged_attention import CASES, dense_attention, make_case
from tests.worker.runtime.test_fast_linear import NARROWER_BUILDS

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernel.available(), "the C kernel must build on a machine with a C compiler"


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize(
    "heads, head_dim", [((4, 2), 8), ((4, 4), 8), ((6, 2), 20), ((9, 3), 64)], ids=["gqa", "mha", "odd-dim", "smollm2"]
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense(name, block_size, heads, head_dim, dtype):
    case = make_case(CASES[name], block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype)
    out = cpu_kernel.paged_attention_cpu(*case.args())
    assert out.dtype == dtype and out.shape == case.query.shape
    assert (out.double() - dense_attention(case)).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_matches_dense_over_several_key_parts(dtype):
    """Rows with more keys than one work item takes (the kernel's PART_KEYS, 128): their parts' partial
    softmaxes are combined; a verify query whose rows end in different parts; exactly one part's keys."""
    case = make_case(
        [(1, 300), (4, 259), (2, 129), (1, 128), (3, 700)], 16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype
    )
    out = cpu_kernel.paged_attention_cpu(*case.args())
    assert (out.double() - dense_attention(case)).abs().max() <= TOLERANCE[dtype]


def test_takes_a_strided_query():
    """`transformers` hands attention a transposed [T, H, D] view of its [1, H, T, D] query."""
    case = make_case(CASES["mixed"], 4)
    strided = case.query.transpose(0, 1).contiguous().transpose(0, 1)  # same values, head-major memory
    args = case.args()
    assert torch.equal(cpu_kernel.paged_attention_cpu(strided, *args[1:]), cpu_kernel.paged_attention_cpu(*args))


def one_row_decode(attention, case, token: int, seq: int) -> torch.Tensor:  # [H, D]
    """Query `token` of sequence `seq` alone, as a one-token decode at its position."""
    starts, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    position = lens[seq] - (starts[seq + 1] - starts[seq]) + (token - starts[seq])
    out = attention(
        case.query[token : token + 1],
        case.key_cache,
        case.value_cache,
        case.block_tables[seq : seq + 1],
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([position + 1], dtype=torch.int32),
        case.scale,
    )
    return out[0]


def rows_that_differ(attention, dtype, context: int) -> list[tuple[int, int]]:
    """(query length, token) of every row whose output differs from a one-row decode of it: 1..16 query rows
    of one sequence, next to other sequences, with 1 or 2 threads."""
    threads = torch.get_num_threads()
    differ = []
    for q_len in range(1, 17):
        # The sequence under test among others of other shapes; SmolLM2's heads (9 query heads per 3 KV heads).
        specs = [(3, 40), (q_len, context + q_len), (1, 7)]
        case = make_case(specs, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=q_len)
        together = attention(*case.args())  # [T, H, D]
        start = case.query_start_loc[1].item()
        try:
            torch.set_num_threads(1 if q_len % 2 else threads)
            differ += [
                (q_len, token)
                for token in range(start, start + q_len)
                if not torch.equal(together[token], one_row_decode(attention, case, token, seq=1))
            ]
        finally:
            torch.set_num_threads(threads)
    return differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("context", [1, 16, 130, 600])
def test_rows_are_bitwise_batch_invariant(dtype, context):
    """A row's output is bitwise the same whether it is computed alone or with other rows: what makes a verify
    step equal plain decoding."""
    assert rows_that_differ(cpu_kernel.paged_attention_cpu, dtype, context) == []


def test_the_invariance_check_has_teeth():
    """rows_that_differ catches an attention whose rows change once a call holds more than 8 rows (built here,
    so the check's teeth do not depend on whether this machine's SDPA happens to be invariant)."""

    def rounds_by_batch(query, *args):
        if query.shape[0] > 8:
            query = query * (1 + 2**-6)  # another rounding of the scores, as another blocking would give
        return cpu_kernel.paged_attention_cpu(query, *args)

    differ = rows_that_differ(rounds_by_batch, torch.bfloat16, 130)
    assert differ and all(q_len >= 5 for q_len, _ in differ)  # 3 + q_len + 1 rows in the call


@pytest.mark.parametrize("build", list(NARROWER_BUILDS))
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_every_instruction_set_gives_the_same_bits(build, dtype):
    """The kernel's arithmetic is fixed, not its instructions (AVX-512 transposes keys in registers and keeps
    sums in vectors; narrower builds take the plain loops): a build for a narrower CPU gives bitwise this
    build's results, so a row's output is the same on the Intel and AMD kinds too."""
    narrow = cpu_kernel.bind(cpu_build.load_library("paged_attention_cpu", NARROWER_BUILDS[build]))
    specs = [(1, 300), (5, 259), (3, 40), (1, 7), (2, 129)]  # decodes, a verify across key parts, prefills
    for heads, head_dim in (((9, 3), 64), ((6, 2), 20), ((4, 2), 128)):
        case = make_case(specs, 16, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype)
        want = cpu_kernel.paged_attention_cpu(*case.args())
        assert torch.equal(cpu_kernel.paged_attention_cpu(*case.args(), function=narrow), want), (heads, head_dim)


def transposed(key_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, KVH, D] keys in the layout a CPU KVCache keeps: [num_blocks, KVH, D, block_size]."""
    return key_cache.permute(0, 2, 3, 1).contiguous()


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_transposed_keys_give_the_same_bits(dtype, block_size):
    """K kept transposed in its blocks (kv_cache.py) moves values, not arithmetic: the same bits as the usual
    layout, where 16 keys lie in one block (block_size 16, 32) and where they do not (4: a key at a time),
    for every build (the narrower ones read both layouts with plain loads). Teeth: a block's keys read in
    another order would give other numbers."""
    builds = [None] + [
        cpu_kernel.bind(cpu_build.load_library("paged_attention_cpu", flags)) for flags in NARROWER_BUILDS.values()
    ]
    specs = [(1, 300), (5, 259), (3, 40), (1, 7), (2, 129), (16, 16)]
    for heads, head_dim in (((9, 3), 64), ((6, 2), 20), ((4, 2), 128)):
        case = make_case(specs, block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype)
        want = cpu_kernel.paged_attention_cpu(*case.args())
        query, keys, *rest = case.args()
        for function in builds:
            got = cpu_kernel.paged_attention_cpu(
                query, transposed(keys), *rest, function=function, keys_transposed=True
            )
            assert torch.equal(got, want), (heads, head_dim, function)
    reversed_blocks = transposed(keys).flip(-1)  # each block's keys in the other order
    got = cpu_kernel.paged_attention_cpu(query, reversed_blocks, *rest, keys_transposed=True)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("keys_transposed", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_bf16_cache_under_fp32_queries_is_the_fp32_kernel_over_its_values(block_size, keys_transposed):
    """--kv-cache-dtype bfloat16 under an fp32 model: keys and values widen to fp32 as they are read, so the
    output is bitwise the fp32 kernel's over an fp32 cache holding the same (bf16-rounded) numbers, on every
    build. Teeth: the fp32 kernel over the unrounded cache gives other numbers."""
    builds = [None] + [
        cpu_kernel.bind(cpu_build.load_library("paged_attention_cpu", flags)) for flags in NARROWER_BUILDS.values()
    ]
    specs = [(1, 300), (5, 259), (3, 40), (1, 7), (2, 129)]
    case = make_case(specs, block_size, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    query, keys, values, *rest = case.args()
    if keys_transposed:
        keys = transposed(keys)
    rounded = [t.to(torch.bfloat16) for t in (keys, values)]
    want = cpu_kernel.paged_attention_cpu(query, *(t.float() for t in rounded), *rest, keys_transposed=keys_transposed)
    for function in builds:
        got = cpu_kernel.paged_attention_cpu(query, *rounded, *rest, function=function, keys_transposed=keys_transposed)
        assert got.dtype == torch.float32 and torch.equal(got, want), function
    assert not torch.equal(
        cpu_kernel.paged_attention_cpu(query, keys, values, *rest, keys_transposed=keys_transposed), want
    )
    assert cpu_kernel.supports(query, rounded[0]) and not cpu_kernel.supports(query.bfloat16(), keys)


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_build.load_library.cache_clear()
    try:
        with pytest.raises(cpu_build.KernelBuildError, match="does not run"):
            cpu_build.load_library("paged_attention_cpu")
    finally:
        cpu_build.load_library.cache_clear()


@pytest.mark.parametrize("module", ["linear_cpu", "layer_ops_cpu", "sampling_cpu", "token_bitmask"])
def test_without_a_compiler_each_kernel_module_falls_back_and_says_to_what(module, monkeypatch, tmp_path, caplog):
    """cpu_build.optional_library: no library (the module's fallback runs) and one warning naming the kernel and
    what runs instead."""
    kernel_module = importlib.import_module(f"kernels.{module}")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_build.load_library.cache_clear()
    kernel_module.c_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kernels.cpu_build"):
            assert kernel_module.c_library() is None
        assert len(caplog.records) == 1 and "are unavailable; using" in caplog.text and "does not run" in caplog.text
    finally:
        cpu_build.load_library.cache_clear()
        kernel_module.c_library.cache_clear()


def test_builds_once_per_source_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    cpu_build.load_library.cache_clear()
    try:
        cpu_build.load_library("paged_attention_cpu")
        built = list((tmp_path / "kernels").glob("paged_attention_cpu-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_build.load_library.cache_clear()
        cpu_build.load_library("paged_attention_cpu")
        assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    finally:
        cpu_build.load_library.cache_clear()
