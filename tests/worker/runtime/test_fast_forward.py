"""The fast CPU Llama forward (worker_service/runtime/backends/cpu_llama.py) and its row-wise kernels
(kernels/layer_ops_cpu.py) against `transformers`: each kernel op by op, and whole steps' logits against the
`transformers` forward of the same model on its own paged cache (prefill chunks, decodes, verify queries)."""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import cpu_build, layer_ops_cpu
from tests.tiny_models import tiny_llama
from worker_service.runtime import backends
from worker_service.runtime.backends.cpu_calls import RopeTable
from worker_service.runtime.backends.cpu_llama import CpuLlamaForward
from worker_service.runtime.backends.transformers_layers import TransformersForward
from worker_service.runtime.kv_cache import KVCache, KVCacheSpec
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import ModelRunner, SequenceChunk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZE = 4


def _random(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_llama_rms_norm(dtype):
    x, residual = _random((37, 96), dtype, 0), _random((37, 96), dtype, 1)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = _random((96,), dtype, 2)
    total = residual + x
    ours_residual = residual.clone()
    out = layer_ops_cpu.add_rms_norm(x, ours_residual, norm.weight.data, 1e-5)
    assert torch.equal(ours_residual, total)  # the add is exact: one rounding, as torch's
    torch.testing.assert_close(out, norm(total))  # the mean's sum order differs: the dtype's tolerance
    alone = layer_ops_cpu.add_rms_norm(None, total.clone(), norm.weight.data, 1e-5)  # the first layer's
    assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rounds_as_apply_rotary_pos_emb(dtype):
    """Bitwise: the same products and sum, each rounded to the dtype where `transformers` rounds."""
    config = tiny_llama(0, 1, 64, 4, 2).config
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 11
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 7, 8, 9, 10, 100, 101, 300, 511]])
    cos, sin = rotary(torch.zeros(1, dtype=dtype), positions)  # [1, T, D]
    qkv = _random((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 3)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim).transpose(0, 1)[None]  # [1, H, T, D]
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim).transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    ours = qkv.clone()
    layer_ops_cpu.rope_(ours, heads + kv_heads, head_dim, cos[0].contiguous(), sin[0].contiguous())
    assert torch.equal(ours[:, : heads * head_dim], q_ref[0].transpose(0, 1).reshape(tokens, -1))
    assert torch.equal(
        ours[:, heads * head_dim : (heads + kv_heads) * head_dim], k_ref[0].transpose(0, 1).reshape(tokens, -1)
    )
    assert torch.equal(ours[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :])  # v


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rope_table_gives_what_the_rotary_module_gives(dtype):
    """Bitwise, for positions of one call in any order and past the table's end (it grows), as the module
    computes them for a step's positions; a dynamic rope type asks the module at every call."""
    config = tiny_llama(0, 1, 64, 4, 2).config
    rotary = LlamaRotaryEmbedding(config)
    table = RopeTable(rotary, dtype)
    assert table.fixed
    for positions in ([5], [0, 1, 2, 3, 4, 5, 6], [1023, 7, 300], [3000, 2999, 12], [1, 4096, 5000, 77]):
        positions = torch.tensor(positions)
        cos, sin = table(positions)
        ref_cos, ref_sin = rotary(torch.zeros(1, dtype=dtype), positions[None])
        assert cos.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    assert table.cos.shape[0] == 8192  # grew past 1024, then 4096 positions

    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    config.max_position_embeddings = 64
    dynamic = LlamaRotaryEmbedding(config)
    table = RopeTable(dynamic, dtype)
    assert not table.fixed
    positions = torch.tensor([3, 200])  # past max_position_embeddings: the module rescales its frequencies
    cos, _ = table(positions)
    ref_cos, _ = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions[None])
    assert torch.equal(cos, ref_cos[0])
    assert table.cos.numel() == 0  # no table


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(dtype):
    gate_up = _random((37, 2 * 80), dtype, 4, scale=3.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 30.0, -30.0])  # ends of exp's range
    gate, up = gate_up.split(80, dim=1)
    torch.testing.assert_close(layer_ops_cpu.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("build", ["-march=x86-64-v3", "-march=x86-64"])  # AVX2, and scalar code
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_rms_norm_give_the_same_bits_on_every_instruction_set(build, dtype):
    """SiLU's exp is our polynomial, not libm's, and RMSNorm's sum runs in fixed lanes, so a build for a
    narrower CPU (whose loops the compiler vectorises otherwise, or not at all) gives bitwise this build's rows."""
    narrow = layer_ops_cpu.bind(cpu_build.load_library("layer_ops_cpu", (build,)))
    gate_up = _random((9, 2 * 1536), dtype, 5, scale=4.0)
    assert torch.equal(layer_ops_cpu.silu_mul(gate_up, narrow), layer_ops_cpu.silu_mul(gate_up))
    x, residual, weight = _random((9, 579), dtype, 6), _random((9, 579), dtype, 7), _random((579,), dtype, 8)
    ours, theirs = residual.clone(), residual.clone()
    want = layer_ops_cpu.add_rms_norm(x, ours, weight, 1e-6)
    assert torch.equal(layer_ops_cpu.add_rms_norm(x, theirs, weight, 1e-6, narrow), want) and torch.equal(theirs, ours)


@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys", "transposed-keys"])
@pytest.mark.parametrize("dtype, cache_dtype", [*((d, d) for d in DTYPES), (torch.float32, torch.bfloat16)], ids=str)
def test_write_kv_stores_each_row_at_its_slot_as_the_cache_does(dtype, cache_dtype, keys_transposed):
    """The fast forward's K/V write equals KVCache.write (index_copy_, or indexing for K kept transposed) from
    the k and v parts of qkv rows; into a bf16 cache under fp32 rows (--kv-cache-dtype) rounded as torch
    rounds."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=cache_dtype)
    ours, theirs = (KVCache(spec, 8, BLOCK_SIZE, keys_transposed=keys_transposed) for _ in range(2))
    qkv = _random((5, (4 + 2 * 2) * 16), dtype, 10)
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    slots = torch.tensor([30, 3, 17, 0, 9])
    theirs.write(0, k, v, slots)
    layer_ops_cpu.write_kv(k, v, slots, ours.key_caches[0], ours.value_caches[0], keys_transposed)
    assert torch.equal(ours.key_caches[0], theirs.key_caches[0])
    assert torch.equal(ours.value_caches[0], theirs.value_caches[0])
    assert torch.equal(theirs.keys(0).view(-1, 2, 16)[slots], k.to(cache_dtype))  # each key at its slot


def test_a_cache_moves_its_slots_alike_in_either_layout():
    """KVCache.move (a kept tree path's K/V to its chain positions) in the transposed layout: what it does in
    the usual one, overlapping sources and targets included."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    caches = [KVCache(spec, 8, BLOCK_SIZE, keys_transposed=t) for t in (False, True)]
    slots = torch.arange(8 * BLOCK_SIZE)
    for cache in caches:
        for layer in range(2):
            cache.write(layer, *(_random((len(slots), 2, 16), torch.float32, 20 + layer + i) for i in (0, 5)), slots)
    source, target = torch.tensor([5, 9, 12, 13]), torch.tensor([4, 5, 6, 7])
    for cache in caches:
        cache.move(source, target)
    for layer in range(2):
        assert torch.equal(caches[1].keys(layer), caches[0].keys(layer))
        assert torch.equal(caches[1].value_caches[layer], caches[0].value_caches[layer])
    assert caches[1].key_caches[0].shape == (8, 2, 16, BLOCK_SIZE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_computes_a_row_alone(dtype):
    """Bitwise the same row whether the call has 1 row or 300 (past the size where threads split rows)."""
    rows = _random((300, 128), dtype, 5)
    weight = _random((128,), dtype, 6)
    cos, sin = _random((300, 32), dtype, 7), _random((300, 32), dtype, 8)
    residual = _random((300, 128), dtype, 9)
    batched = [layer_ops_cpu.add_rms_norm(rows, residual.clone(), weight, 1e-6), layer_ops_cpu.silu_mul(rows)]
    rotated = rows.clone()
    layer_ops_cpu.rope_(rotated, 4, 32, cos, sin)
    for r in (0, 151, 299):
        alone = [
            layer_ops_cpu.add_rms_norm(rows[r : r + 1], residual[r : r + 1].clone(), weight, 1e-6),
            layer_ops_cpu.silu_mul(rows[r : r + 1]),
        ]
        one = rows[r : r + 1].clone()
        layer_ops_cpu.rope_(one, 4, 32, cos[r : r + 1], sin[r : r + 1])
        assert all(torch.equal(b[r : r + 1], a) for b, a in zip(batched, alone)) and torch.equal(
            rotated[r : r + 1], one
        )


def _steps(vocab: int) -> list[list[tuple[int, int, int]]]:
    """Per step, per sequence (index, tokens in the step, logits wanted): prefills (one chunked), decodes,
    verify queries of several rows, all mixed."""
    return [
        [(0, 9, 1), (1, 5, 0)],
        [(0, 1, 1), (1, 6, 6), (2, 3, 3)],
        [(0, 4, 4), (1, 1, 1), (2, 1, 1), (3, 12, 1)],
        [(0, 1, 1), (1, 5, 5), (2, 2, 2), (3, 1, 1)],
    ]


def _run(runner: ModelRunner, seed: int) -> list[torch.Tensor]:
    """The _steps schedule on `runner` (its own cache), with the same tokens and block tables for every runner."""
    rng = random.Random(seed)
    runner.init_cache(num_blocks=64, block_size=BLOCK_SIZE)
    free = list(range(64))
    rng.shuffle(free)
    tokens = [[rng.randrange(3, runner.vocab_size) for _ in range(32)] for _ in range(4)]
    tables = [[free.pop() for _ in range(8)] for _ in range(4)]
    done = [0] * 4
    outputs = []
    for step in _steps(runner.vocab_size):
        chunks = []
        for seq, num, num_logits in step:
            chunks.append(SequenceChunk(tokens[seq][done[seq] : done[seq] + num], done[seq], tables[seq], num_logits))
            done[seq] += num
        outputs.append(runner.forward(chunks))
    return outputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_fast_forward_logits_equal_the_transformers_forward(request, model, dtype):
    path = (
        request.getfixturevalue("tiny_pair").target_path if model == "tiny" else request.getfixturevalue("smollm2_path")
    )
    name = str(dtype).removeprefix("torch.")
    fast = ModelRunner(load_model(path, name))
    reference = ModelRunner(load_model(path, name))
    assert fast.backend.name == "cpu_llama"
    # transformers' decoder layers, on the same kernels for linears and attention
    reference.backend = TransformersForward(reference.model)
    for ours, theirs in zip(_run(fast, 0), _run(reference, 0)):
        # fp32: only sum orders differ (RMSNorm's mean); bf16/fp16: that, carried through the layers in the
        # dtype's rounding, so a tolerance of a few of its ulps at the logits' magnitude.
        scale = theirs.abs().max().item()
        tolerance = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 5e-3}[dtype] * scale
        torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=0)
        if dtype == torch.float32:
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_other_models_keep_the_transformers_forward(tiny_pair):
    runner = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    assert CpuLlamaForward.supports(runner.model) is None
    gelu = tiny_llama(0, 1, 64, 4, 2)
    gelu.config.hidden_act = "gelu"
    assert "hidden_act gelu" in CpuLlamaForward.supports(gelu)
    runner.model.config.model_type = "mistral"
    assert "mistral" in CpuLlamaForward.supports(runner.model)


def test_the_runner_chooses_its_backend_in_one_place(tiny_pair):
    """backends.choose: the first backend that covers the model; build: a named one, or why it cannot."""
    model = load_model(tiny_pair.target_path, "float32")
    assert ModelRunner(model).backend.name == "cpu_llama"
    assert ModelRunner(load_model(tiny_pair.target_path, "float32"), backend="transformers").backend.name == (
        "transformers"
    )
    model.config.model_type = "mistral"  # a model the CPU Llama forward does not cover
    assert backends.choose(model).name == "transformers"
    with pytest.raises(ValueError, match="the cpu_llama forward does not cover this model: a mistral model"):
        backends.build("cpu_llama", model)
    with pytest.raises(ValueError, match="unknown forward backend 'gpu'"):
        backends.build("gpu", model)


def test_a_cpu_runner_keeps_keys_transposed_where_its_attention_reads_them(tiny_pair):
    """The runner asks its backend: the C forwards read K transposed on the CPU; the Triton forward (here in the
    interpreter, on CPU tensors) reads the usual layout."""
    runner = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    assert runner.backend.name == "cpu_llama" and runner.init_cache(4, BLOCK_SIZE).keys_transposed
    runner.backend = TransformersForward(runner.model)
    assert runner.init_cache(4, BLOCK_SIZE).keys_transposed
    runner.backend.transposed_keys = False  # as GpuLlamaForward declares
    assert not runner.init_cache(4, BLOCK_SIZE).keys_transposed


def test_a_new_cache_is_the_one_the_layers_read(tiny_pair):
    """The forward keeps its cache's addresses between steps: after init_cache the layers write and read the new
    cache, as a runner that never had another does (the old one is held here, so it cannot be the new one's
    memory again)."""
    runner = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    _run(runner, seed=1)  # _run makes a new cache first
    old = runner.kv_cache
    again = _run(runner, seed=2)
    fresh_runner = ModelRunner(load_model(tiny_pair.target_path, "float32"))
    fresh = _run(fresh_runner, seed=2)
    assert runner.kv_cache is not old
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
    for mine, theirs in zip(runner.kv_cache.key_caches + runner.kv_cache.value_caches,
                            fresh_runner.kv_cache.key_caches + fresh_runner.kv_cache.value_caches):  # fmt: skip
        assert torch.equal(mine, theirs)


def test_a_bf16_kv_cache_under_an_fp32_model(tiny_pair):
    """--kv-cache-dtype bfloat16: the fast forward keeps K/V in bf16 (half the bytes a block) under an fp32 or
    q4_1 model, and its logits stay within bf16's rounding of the fp32 cache's (not equal: the cache is
    rounded); a backend that cannot read such a cache, or a model in another dtype, is refused by name."""
    path = tiny_pair.target_path
    exact = ModelRunner(load_model(path, "float32"))
    halved = ModelRunner(load_model(path, "float32"), kv_cache_dtype="bfloat16")
    assert halved.kv_spec.dtype == torch.bfloat16
    assert 2 * halved.kv_spec.bytes_per_block(BLOCK_SIZE) == exact.kv_spec.bytes_per_block(BLOCK_SIZE)
    ours, theirs = _run(halved, 0), _run(exact, 0)
    assert halved.kv_cache.key_caches[0].dtype == halved.kv_cache.value_caches[0].dtype == torch.bfloat16
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, atol=4e-2 * reference.abs().max().item(), rtol=0)
    assert not all(torch.equal(mine, reference) for mine, reference in zip(ours, theirs))
    assert ModelRunner(load_model(path, "q4_1"), kv_cache_dtype="bfloat16").kv_spec.dtype == torch.bfloat16
    assert ModelRunner(load_model(path, "bfloat16"), kv_cache_dtype="auto").kv_spec.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 needs .* on the transformers forward"):
        ModelRunner(load_model(path, "float32"), backend="transformers", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 needs .* runs in bfloat16"):
        ModelRunner(load_model(path, "bfloat16"), kv_cache_dtype="float32")
