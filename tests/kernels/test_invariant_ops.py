"""The batch-invariant linear and RMSNorm (kernels/invariant_ops.py): each equals its PyTorch reference, and a
row's result is bitwise the same alone and in batches of 1..300 rows, wherever it sits in the batch."""

import pytest
import torch

from kernels._triton import HAS_TRITON
from kernels.invariant_ops import linear_ref, linear_triton, rms_norm_ref, rms_norm_triton

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative, over the whole output


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def random(shape, dtype, device, seed) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, bias", [(1, 40, 70, False), (7, 96, 130, True), (65, 33, 64, False)])
def test_linear_matches_reference(triton_device, dtype, m, n, k, bias):
    x, w = random((m, k), dtype, triton_device, 0), random((n, k), dtype, triton_device, 1)
    b = random((n,), dtype, triton_device, 2) if bias else None
    got = linear_triton(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype and not got.isnan().any()
    assert relative_error(got, linear_ref(x, w, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_batch(triton_device, dtype):
    x, w = random((300, 72), dtype, triton_device, 3), random((48, 72), dtype, triton_device, 4)
    whole = linear_triton(x, w)  # [300, 48]
    for rows in (1, 2, 5, 64, 65, 129, 300):
        assert torch.equal(linear_triton(x[:rows], w), whole[:rows]), rows
    for start in (5, 63, 64, 299):  # a row alone, wherever it sat in a tile of the batch
        assert torch.equal(linear_triton(x[start : start + 1], w), whole[start : start + 1]), start
    leading = linear_triton(x.view(3, 100, 72), w)  # leading dimensions are rows too
    assert torch.equal(leading.view(300, 48), whole)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (9, 576), (3, 100)])
def test_rms_norm_matches_reference(triton_device, dtype, rows, hidden):
    x = random((rows, hidden), dtype, triton_device, 5) * 3
    w = random((hidden,), dtype, triton_device, 6)
    got = rms_norm_triton(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    assert relative_error(got, rms_norm_ref(x, w, 1e-5)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(triton_device, dtype):
    x, w = random((300, 96), dtype, triton_device, 7), random((96,), dtype, triton_device, 8)
    whole = rms_norm_triton(x, w, 1e-6)
    for rows in (1, 2, 64, 300):
        assert torch.equal(rms_norm_triton(x[:rows], w, 1e-6), whole[:rows]), rows
    assert torch.equal(rms_norm_triton(x[150:151], w, 1e-6), whole[150:151])
