"""oneDNN-packed linears: same results as `torch.nn.Linear`, and batch invariant.

Batch invariance keeps a sequence's linear-layer results the same whether
it is decoded alone, in a batch, or verified with k drafts behind it.
"""

import pytest
import torch

from worker_service.fast_linear import PackedLinear, SharedInputLinears, can_pack, fuse_shared_inputs, pack_linears
from worker_service.model_loader import load_model

BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
DTYPES = [torch.float32] + ([torch.bfloat16] if BF16 else [])
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (64, 1000)]  # SmolLM2's (in, out) + a small one


@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(in_features, out_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(3, 7, in_features)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        assert packed(x[0, :1]).shape == (1, out_features)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_packed_linear_rows_do_not_depend_on_batch(dtype, in_features, out_features):
    torch.manual_seed(1)
    packed = PackedLinear(torch.nn.Linear(in_features, out_features, bias=False).to(dtype))
    x = torch.randn(40, in_features, dtype=dtype)
    with torch.inference_mode():
        full = packed(x)
        for rows in (1, 2, 3, 5, 8, 17, 33):
            assert torch.equal(packed(x[:rows]), full[:rows]), f"{rows} rows differ from the same rows in 40"
            assert torch.equal(packed(x[rows - 1:rows]), full[rows - 1:rows]), f"row {rows - 1} alone differs"


def test_pack_linears_replaces_every_linear(tiny_pair):
    model = load_model(tiny_pair.target_path)
    num_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert can_pack(model)
    assert pack_linears(model) == num_linear > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj_k_proj_v_proj, SharedInputLinears)
    assert isinstance(layer.mlp.gate_proj_up_proj, SharedInputLinears)


@pytest.mark.parametrize("bias", [False, True])
def test_shared_input_group_gives_each_projection_its_own_output(bias):
    """Fused q/k/v: each slice equals its own packed projection (bitwise here), and a projection handed
    another tensor than its siblings computes that one, not the siblings' cached result."""
    torch.manual_seed(0)
    parent = torch.nn.Module()
    for name, out_features in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8)):
        setattr(parent, name, torch.nn.Linear(32, out_features, bias=bias))
    alone = {name: PackedLinear(getattr(parent, name)) for name in ("q_proj", "k_proj", "v_proj")}
    assert fuse_shared_inputs(parent) == 1
    x, other = torch.randn(5, 32), torch.randn(5, 32)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.allclose(getattr(parent, name)(x), alone[name](x), atol=1e-6)
    assert torch.allclose(parent.k_proj(other), alone["k_proj"](other), atol=1e-6)
    assert torch.allclose(parent.v_proj(x), alone["v_proj"](x), atol=1e-6)
    assert torch.allclose(parent.q_proj(x), alone["q_proj"](x), atol=1e-6)  # a slice asked for twice
    group = parent.q_proj_k_proj_v_proj
    parent.k_proj(x)  # v and q of this input were taken above; with k every slice is: the group holds nothing
    assert group._input is None and group._outputs == []


def test_groups_of_different_inputs_are_not_fused():
    parent = torch.nn.Module()
    parent.gate_proj, parent.up_proj = torch.nn.Linear(32, 64), torch.nn.Linear(16, 64)
    assert fuse_shared_inputs(parent) == 0 and type(parent.gate_proj) is torch.nn.Linear
