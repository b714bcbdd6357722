"""The GPU forward's row-wise Triton kernels (kernels/layer_ops.py) against their PyTorch references, on the
CPU in Triton's interpreter and on CUDA in the gpu tier; and each row computed alone."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels import invariant_ops, layer_ops
from kernels._triton import HAS_TRITON
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
DTYPES = [torch.float32, torch.bfloat16]


def assert_rounded_as(ours: torch.Tensor, theirs: torch.Tensor, device: str) -> None:
    """Bitwise, where the device rounds as torch does: on CUDA in bf16 (each product and sum rounded to it);
    in fp32 a GPU may fuse a product and a sum (FMA), and Triton's interpreter rounds fp32 to bf16 towards
    zero: there, within the dtype's rounding."""
    ours = ours.cpu()
    if (device == "cuda") == (ours.dtype != torch.float32):
        assert torch.equal(ours, theirs)
    else:
        bf16 = ours.dtype == torch.bfloat16  # two roundings to it, one of them towards zero: a few of its ulps
        torch.testing.assert_close(ours, theirs, rtol=2**-5 if bf16 else 1e-6, atol=2**-5 if bf16 else 1e-6)


def _random(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_is_the_residual_add_then_llama_rms_norm(dtype, triton_device):
    h, residual, w = _random((37, 96), dtype, 0), _random((37, 96), dtype, 1), _random((96,), dtype, 2)
    want_residual = residual.clone()
    want = layer_ops.add_rms_norm_ref(h, want_residual, w, 1e-5)
    ours_residual = residual.to(triton_device)
    got = layer_ops.add_rms_norm_triton(h.to(triton_device), ours_residual, w.to(triton_device), 1e-5)
    assert_rounded_as(ours_residual, want_residual, triton_device)  # the add: one rounding, as torch's
    # the mean's sum order differs: a few of the dtype's ulps
    tolerance = 2**-5 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.cpu(), want, rtol=tolerance, atol=tolerance)
    first = layer_ops.add_rms_norm_triton(None, ours_residual, w.to(triton_device), 1e-5)  # the first layer's
    assert torch.equal(first.cpu(), got.cpu())
    # each row alone: the first 5 rows by themselves give the same bits
    alone = layer_ops.add_rms_norm_triton(None, ours_residual[:5].clone(), w.to(triton_device), 1e-5)
    assert torch.equal(alone.cpu(), got[:5].cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_linears_split_sums_are_added_by_the_next_kernel_as_by_the_linear(dtype, triton_device, monkeypatch):
    """The GPU forward hands a linear's split sums (a decode step's few rows) to the next kernel: o_proj's and
    down's to the residual add, gate/up's to SiLU·mul, q/k/v's to RoPE and the K/V write. The results are bit
    for bit those of the linear's own sum, then the op; more rows than one tile get the summed output, as from
    linear_triton."""
    monkeypatch.setattr(invariant_ops, "MIN_SPLIT_WEIGHTS", 0)  # a small weight split as a large one is
    assert invariant_ops.k_splits(96, 1030)[0] == 4
    x, w = _random((70, 1030), dtype, 7).to(triton_device), _random((96, 1030), dtype, 8).to(triton_device)
    norm, residual = _random((96,), dtype, 9).to(triton_device), _random((5, 96), dtype, 10, 4.0).to(triton_device)
    parts = invariant_ops.linear_split_sums(x[:5], w)
    assert parts.shape == (4, 5, 96) and parts.dtype == torch.float32
    want_residual, got_residual = residual.clone(), residual.clone()
    want = layer_ops.add_rms_norm_triton(invariant_ops.linear_triton(x[:5], w), want_residual, norm, 1e-5)
    got = layer_ops.add_rms_norm_triton(parts, got_residual, norm, 1e-5)
    assert torch.equal(got_residual.cpu(), want_residual.cpu()) and torch.equal(got.cpu(), want.cpu())
    rows = torch.tensor([4, 1], device=triton_device)  # the last layer's: only the rows whose logits are wanted
    h = invariant_ops.linear_triton(x[:5], w)
    some = layer_ops.add_rms_norm_triton(parts.index_select(-2, rows), residual[rows], norm, 1e-5)
    assert torch.equal(some.cpu(), layer_ops.add_rms_norm_triton(h[rows], residual[rows], norm, 1e-5).cpu())
    many = invariant_ops.linear_split_sums(x, w)  # 70 rows: more than a tile, summed by the linear itself
    assert torch.equal(many.cpu(), invariant_ops.linear_triton(x, w).cpu())
    # gate/up's split sums into SiLU·mul: the same as from the gate_up they sum to
    act = layer_ops.silu_mul_triton(parts, dtype)
    assert act.shape == (5, 48) and act.dtype == dtype
    assert torch.equal(act.cpu(), layer_ops.silu_mul_triton(invariant_ops.linear_triton(x[:5], w)).cpu())
    # q/k/v's split sums into RoPE and the K/V write (4 query heads, 2 KV heads of 16): the same queries and
    # caches as from the qkv they sum to, rotated in place
    config = tiny_llama(0, 1, 64, 4, 2).config
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), torch.arange(5)[None])
    cos, sin = cos[0].contiguous().to(triton_device), sin[0].contiguous().to(triton_device)
    w_qkv = _random((128, 1030), dtype, 11).to(triton_device)
    assert invariant_ops.k_splits(128, 1030)[0] > 1
    slots = torch.tensor([3, 0, 7, 5, 1], device=triton_device)
    caches = [torch.zeros((2, 4, 2, 16), dtype=dtype, device=triton_device) for _ in range(4)]
    qkv = invariant_ops.linear_triton(x[:5], w_qkv)
    want_q = layer_ops.rope_write_kv_triton(qkv, cos, sin, 4, slots, caches[0], caches[1])
    got_q = layer_ops.rope_write_kv_triton(
        invariant_ops.linear_split_sums(x[:5], w_qkv), cos, sin, 4, slots, caches[2], caches[3]
    )
    assert want_q.data_ptr() == qkv.data_ptr() and got_q.shape == want_q.shape == (5, 64)
    assert torch.equal(got_q.cpu(), want_q.cpu())
    assert torch.equal(caches[2].cpu(), caches[0].cpu()) and torch.equal(caches[3].cpu(), caches[1].cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_write_kv_rotates_as_apply_rotary_pos_emb_and_writes_the_cache(dtype, triton_device):
    config = tiny_llama(0, 1, 64, 4, 2).config
    heads, kv_heads, head_dim, tokens, block_size = 4, 2, 16, 11, 4
    positions = torch.tensor([[0, 1, 2, 7, 8, 9, 10, 100, 101, 300, 511]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions)  # [1, T, D]
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    qkv = _random((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 3)
    slots = torch.randperm(8 * block_size, generator=torch.Generator().manual_seed(4))[:tokens]
    caches = [_random((8, block_size, kv_heads, head_dim), dtype, seed) for seed in (5, 6)]
    want = [qkv.clone(), *(c.clone() for c in caches)]
    layer_ops.rope_write_kv_ref(want[0], cos, sin, heads, slots, want[1], want[2])
    got = [t.to(triton_device) for t in (qkv, *caches)]
    args = (cos.to(triton_device), sin.to(triton_device), heads, slots.to(triton_device))
    layer_ops.rope_write_kv_triton(got[0], *args, got[1], got[2])
    q_width = heads * head_dim
    for ours, theirs in ((got[0][:, :q_width], want[0][:, :q_width]), (got[1], want[1]), (got[2], want[2])):
        if dtype == torch.float32 and triton_device == "cuda":  # a GPU may fuse the products and the sum (FMA)
            torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-6, atol=1e-6)
        else:  # each product and the sum rounded to the dtype, as apply_rotary_pos_emb, whatever the compiler does
            assert torch.equal(ours.cpu(), theirs)
    assert torch.equal(got[0][:, q_width:].cpu(), qkv[:, q_width:])  # keys and values stay as they were in qkv
    untouched = torch.ones(8 * block_size, dtype=torch.bool)
    untouched[slots] = False
    for cache, original in zip(got[1:], caches):  # no other slot written
        assert torch.equal(
            cache.cpu().view(-1, kv_heads, head_dim)[untouched], original.view(-1, kv_heads, head_dim)[untouched]
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_is_silu_of_gate_times_up(dtype, triton_device):
    gate_up = _random((37, 2 * 80), dtype, 4, scale=3.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 30.0, -30.0])  # ends of exp's range
    got = layer_ops.silu_mul_triton(gate_up.to(triton_device)).cpu()
    torch.testing.assert_close(got, layer_ops.silu_mul_ref(gate_up))
    assert torch.equal(layer_ops.silu_mul_triton(gate_up[3:4].to(triton_device)).cpu(), got[3:4])
