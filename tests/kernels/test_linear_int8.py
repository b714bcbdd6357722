"""Integer dot products for block-quantized weights (kernels/csrc/linear_int8.h, --quantized-activations int8).

The kernel computes what its PyTorch reference (kernels/quantized.py, linear_int8_reference) computes, close to
the exact fp32-activation kernel; its batch invariance and its bits on every instruction set are checked with
the other packed linears in tests/worker/runtime/test_fast_linear.py.
"""

import pytest
import torch

from kernels import linear_cpu, quantized
from kernels.quantized import BlockWeight
from tests.worker.runtime.test_fast_linear import QUANTIZED_SHAPES, quantized_linear, rows_that_differ

FORMATS = list(quantized.FORMATS)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert linear_cpu.available(), "the C kernel must build on a machine with a C compiler"


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("in_features,out_features", QUANTIZED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_its_reference(format, in_features, out_features, bias):
    """Each row's activations quantized on their own per block of 32, exact integer block sums, one fp32
    chain over the blocks: the reference's numbers (its float64 FMAs may round a rare element differently)."""
    served, _, linear = quantized_linear(in_features, out_features, format, bias, seed=7, activations="int8")
    x = torch.randn(19, in_features)
    x[2, :32] = 0  # a block of zeros: no scale to take
    with torch.inference_mode():
        got = served(x)
    blocks = BlockWeight.quantize(linear.weight, format)
    want = quantized.linear_int8_reference(x, blocks, served.bias)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("in_features,out_features", QUANTIZED_SHAPES[:4])
def test_the_result_is_within_the_activations_rounding_of_the_exact_kernel(format, in_features, out_features):
    """8-bit activations round each input by at most half a step of its block's amax / 127: the outputs stay
    within a percent of the exact (fp32-activation) kernel's scale, and are not that kernel's bits."""
    served, _, _ = quantized_linear(in_features, out_features, format, seed=8, activations="int8")
    exact, _, _ = quantized_linear(in_features, out_features, format, seed=8, activations="fp32")
    x = torch.randn(16, in_features)
    with torch.inference_mode():
        got, want = served(x), exact(x)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.01 * scale
    assert not torch.equal(got, want)


def test_a_scale_shared_across_rows_fails_the_invariance_check():
    """The teeth of the invariance tests: quantizing activations with a scale taken over the whole batch (one
    amax per block for all rows) changes a row's result with the rows beside it, and the check sees it."""
    served, _, linear = quantized_linear(576, 192, "q4_1", seed=9, activations="int8")
    weight = linear.weight.detach()

    def shared_scale(x):  # [N, in]: blocks of 32 quantized with the batch's amax
        blocks = x.view(x.shape[0], -1, 32)
        step = blocks.abs().amax(dim=(0, 2), keepdim=True) / 127
        return (torch.round(blocks / step) * step).view_as(x) @ weight.t()

    x = torch.randn(64, 576)
    x[40:] *= 4  # later rows with larger values: a batch that holds them quantizes the first rows coarser
    with torch.inference_mode():
        assert rows_that_differ(shared_scale, x, (1, 16, 64))
        assert rows_that_differ(served, x, (1, 16, 64)) == []


def test_a_non_finite_input_gives_non_finite_outputs_in_its_row_only():
    """An inf or NaN among a row's activations makes that row's outputs NaN (as the exact kernel's are not
    finite), never a finite number from a wrapped-around 8-bit value; the other rows keep their values."""
    served, _, _ = quantized_linear(64, 80, "q8_0", seed=10, activations="int8")
    x = torch.randn(3, 64)
    with torch.inference_mode():
        clean = served(x)
        x[1, 5], x[2, 40] = float("inf"), float("nan")
        got = served(x)
    assert torch.equal(got[0], clean[0])
    assert torch.isnan(got[1:]).all()
