"""Packed CPU linears (kernels/linear_cpu.py): the numbers of `torch.nn.Linear`, and batch invariant.

Batch invariance keeps a sequence's linear-layer results the same whether
it is decoded alone, in a batch, or verified with k drafts behind it.
"""

import pytest
import torch

from kernels import cpu_build, linear_cpu, quantized
from kernels.quantized import BlockWeight
from worker_service.runtime.dtypes import QUANTIZED_ACTIVATIONS
from worker_service.runtime.fast_linear import (
    BLOCK_WEIGHT,
    PackedLinear,
    SharedInputLinears,
    can_pack,
    fuse_shared_inputs,
    pack_linears,
)
from worker_service.runtime.loader import load_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to the output's scale
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (64, 1000), (5, 3)]  # SmolLM2's (in, out) + small
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 96, 127, 256, 512)
FORMATS = list(quantized.FORMATS)  # llama.cpp's block formats (--dtype q8_0, q4_1)
QUANTIZED_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (64, 1000), (32, 5)]  # in: a multiple of 32


def quantized_linear(
    in_features: int, out_features: int, format: str, bias: bool = True, seed: int = 0, activations: str = "fp32"
) -> tuple[PackedLinear, PackedLinear, torch.nn.Linear]:
    """(the linear served from `format` blocks with `activations`, the fp32 linear of the blocks' dequantised
    weights, the torch.nn.Linear of those weights)."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    blocks = BlockWeight.quantize(linear.weight, format)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    fp32 = PackedLinear(linear)
    setattr(linear, BLOCK_WEIGHT, blocks)
    return PackedLinear(linear, activations), fp32, linear


@pytest.fixture(scope="module", autouse=True)
def built():
    assert linear_cpu.available(), "the C kernel must build on a machine with a C compiler"


def rows_that_differ(linear, x: torch.Tensor, row_counts=ROW_COUNTS) -> list[str]:
    """Where `linear` of the first n rows of `x` (and of row n-1 alone) is not bitwise its rows of all of `x`."""
    full = linear(x)
    differ = []
    for n in row_counts:
        if not torch.equal(linear(x[:n]), full[:n]):
            differ.append(f"the first {n} rows")
        if not torch.equal(linear(x[n - 1 : n]), full[n - 1 : n]):
            differ.append(f"row {n - 1} alone")
    return differ


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(in_features, out_features, bias, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(3, 7, in_features, dtype=dtype)
    with torch.inference_mode():
        got, want = (
            packed(x),
            torch.nn.functional.linear(
                x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
            ),
        )
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want).abs().max() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        assert packed(x[0, :1]).shape == (1, out_features)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_packed_linear_rows_do_not_depend_on_batch(dtype, in_features, out_features):
    """1..512 rows, with 1 and 2 threads: every row bitwise as in the 512-row call."""
    torch.manual_seed(1)
    packed = PackedLinear(torch.nn.Linear(in_features, out_features, bias=True).to(dtype))
    assert_rows_do_not_depend_on_batch(packed, torch.randn(512, in_features, dtype=dtype))


def assert_rows_do_not_depend_on_batch(linear, x: torch.Tensor) -> None:
    """With 2 threads and with 1, every row of the first n of `x` bitwise as in the call on all of `x`."""
    threads = torch.get_num_threads()
    with torch.inference_mode():
        assert rows_that_differ(linear, x) == []
        try:
            torch.set_num_threads(1)
            assert rows_that_differ(linear, x, (1, 5, 512)) == []
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("in_features,out_features", QUANTIZED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_is_the_fp32_kernel_on_the_dequantised_weights(format, in_features, out_features, bias):
    """The kernel dequantises each block to exactly gguf-py's fp32 values, then runs the fp32 chain: bitwise
    the fp32 kernel's result (and close to F.linear's), at a quarter to a sixth of the bytes."""
    served, fp32, linear = quantized_linear(in_features, out_features, format, bias)
    assert served.weight_format == format and fp32.weight_format == "float32"
    x = torch.randn(3, 7, in_features)
    with torch.inference_mode():
        got = served(x)
        assert torch.equal(got, fp32(x))
        reference = torch.nn.functional.linear(x, linear.weight, linear.bias)
        assert (got - reference).abs().max() <= TOLERANCE[torch.float32] * max(1.0, reference.abs().max().item())
        blocks = served.packed_weight.numel()
        assert blocks < fp32.packed_weight.numel() * 4 * 0.3  # q8_0: 8.5 bits a weight, q4_1: 5 (padding aside)


@pytest.mark.parametrize("activations", QUANTIZED_ACTIVATIONS)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("in_features,out_features", QUANTIZED_SHAPES[:4])
def test_quantized_linear_rows_do_not_depend_on_batch(format, in_features, out_features, activations):
    """1..512 rows, with 1 and 2 threads: every row bitwise as in the 512-row call, with fp32 activations and
    with int8 ones (each row's quantized on its own)."""
    served, _, _ = quantized_linear(in_features, out_features, format, seed=1, activations=activations)
    assert_rows_do_not_depend_on_batch(served, torch.randn(512, in_features))


@pytest.mark.parametrize("activations", QUANTIZED_ACTIVATIONS)
def test_a_bf16_input_to_quantized_weights_is_widened_exactly(activations):
    served, _, _ = quantized_linear(64, 80, "q4_1", seed=4, activations=activations)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(served(x), served(x.float()).to(torch.bfloat16))


def test_a_strided_input_gives_the_same_rows():
    torch.manual_seed(2)
    packed = PackedLinear(torch.nn.Linear(64, 80).to(torch.bfloat16))
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    strided = x.t().contiguous().t()  # same values, column-major memory
    with torch.inference_mode():
        assert torch.equal(packed(strided), packed(x))


def test_the_invariance_check_has_teeth():
    """rows_that_differ catches a linear whose summation order depends on the number of rows, as a library
    GEMM's blocking does (built here so the check's teeth do not depend on this machine's libraries)."""
    torch.manual_seed(3)
    weight = torch.randn(64, 576)

    def blocked_by_batch(x):  # sums the input features in two halves once more than 16 rows share the call
        if x.shape[0] <= 16:
            return x @ weight.t()
        return x[:, :288] @ weight[:, :288].t() + x[:, 288:] @ weight[:, 288:].t()

    assert rows_that_differ(blocked_by_batch, torch.randn(64, 576), (1, 16, 17, 33))


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


# Instruction sets the kernel's code paths take: AVX-512 without AVX-512 BF16, AVX-512 without VNNI (the
# integer path's AVX2 code), AVX2 + FMA, and plain x86-64 (scalar fmaf). Where this CPU has more
# (-march=native), the default build takes the widest; flags this CPU lacks build a narrower path anyway.
NARROWER_BUILDS = {
    "avx512": ("-mno-avx512bf16",),
    "avx512-no-vnni": ("-mno-avx512bf16", "-mno-avx512vnni"),
    "avx2": ("-march=x86-64-v3",),
    "scalar": ("-march=x86-64",),
}


@pytest.mark.parametrize("build", list(NARROWER_BUILDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_instruction_set_gives_the_same_bits(build, dtype):
    """The kernel's arithmetic is fixed, not its instructions: a build for a narrower CPU gives bitwise this
    build's results, so a row's output is the same on the Intel and AMD kinds too (denormals aside)."""
    narrow = linear_cpu.bind(cpu_build.load_library("linear_cpu", NARROWER_BUILDS[build]))
    for in_features, out_features in ((576, 192), (577, 70)):
        torch.manual_seed(in_features)
        weight = torch.randn(out_features, in_features, dtype=dtype)
        packed, bias = linear_cpu.pack_weight(weight), torch.randn(out_features)
        x = torch.randn(37, in_features, dtype=dtype)
        want = linear_cpu.linear_cpu(x, packed, out_features, bias)
        assert torch.equal(linear_cpu.linear_cpu(x, packed, out_features, bias, library=narrow), want)


@pytest.mark.parametrize("activations", QUANTIZED_ACTIVATIONS)
@pytest.mark.parametrize("build", list(NARROWER_BUILDS))
@pytest.mark.parametrize("format", FORMATS)
def test_every_instruction_set_gives_the_same_bits_for_block_weights(build, format, activations):
    narrow = linear_cpu.bind(cpu_build.load_library("linear_cpu", NARROWER_BUILDS[build]))
    served, _, _ = quantized_linear(576, 200, format, seed=5, activations=activations)
    x = torch.randn(37, 576)
    x[3, 64:96] = 0  # a block of zeros: no scale to take (int8 activations)
    code = served.weight_code
    want = linear_cpu.linear_cpu(x, served.packed_weight, 200, served.bias, weight_code=code)
    got = linear_cpu.linear_cpu(x, served.packed_weight, 200, served.bias, library=narrow, weight_code=code)
    assert torch.equal(got, want)
