"""The batch-invariant linear and RMSNorm (kernels/invariant_ops.py): each equals its PyTorch reference, and a
row's result is bitwise the same alone and in batches of 1..300 rows, wherever it sits in the batch."""

import pytest
import torch

from kernels import invariant_ops
from kernels._triton import HAS_TRITON
from kernels.invariant_ops import SPLIT_ROWS, k_splits, linear_ref, linear_triton, rms_norm_ref, rms_norm_triton

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
@pytest.mark.parametrize("n, k", [(48, 72), (40, 1030)])
def test_linear_rows_do_not_depend_on_the_batch(triton_device, dtype, n, k, monkeypatch):
    # (40, 1030): K in 4 splits (a small weight split as a large one is); up to SPLIT_ROWS rows run a program
    # per split and a second kernel adds them, more rows a program per tile over all splits: a row's bits must
    # not tell which ran
    monkeypatch.setattr(invariant_ops, "MIN_SPLIT_WEIGHTS", 0)
    assert k_splits(n, k)[0] == (1 if k < 256 else 4) and SPLIT_ROWS == 64
    x, w = random((300, k), dtype, triton_device, 3), random((n, k), dtype, triton_device, 4)
    b = random((n,), dtype, triton_device, 5) if k > 256 else None
    whole = linear_triton(x, w, b)  # [300, n]
    for rows in (1, 2, 5, 64, 65, 129, 300):
        assert torch.equal(linear_triton(x[:rows], w, b), whole[:rows]), rows
    for start in (5, 63, 64, 299):  # a row alone, wherever it sat in a tile of the batch
        assert torch.equal(linear_triton(x[start : start + 1], w, b), whole[start : start + 1]), start
    leading = linear_triton(x.view(3, 100, k), w, b)  # leading dimensions are rows too
    assert torch.equal(leading.view(300, n), whole)


def test_k_splits_depend_on_the_shape_alone(monkeypatch):
    """Enough programs for a decode of an 8B model's layers, no split under 4 blocks, none left empty, none
    of a small weight."""
    assert k_splits(4096, 4096) == (4, 1024)  # q_proj, o_proj: 128 column tiles
    assert k_splits(1024, 4096) == (16, 256)  # k_proj, v_proj: 32 tiles
    assert k_splits(4096, 14336) == (4, 3584)  # down_proj
    assert k_splits(128256, 4096) == (1, 4096)  # the output layer: 2,004 tiles already
    assert k_splits(576, 576) == (1, 576)  # SmolLM2's q_proj: 0.3M weights
    assert k_splits(40, 1030) == (1, 1088)
    monkeypatch.setattr(invariant_ops, "MIN_SPLIT_WEIGHTS", 0)
    assert k_splits(40, 1030) == (4, 320)  # 17 blocks: 5 + 5 + 5 + 2
    assert k_splits(40, 64) == (1, 64)


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
