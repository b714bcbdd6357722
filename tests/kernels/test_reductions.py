"""argmax_last against torch's argmax: the same indices, the CPU path through numpy included."""

import pytest
import torch

from kernels.reductions import argmax_last

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (6, 4099), (2, 3, 257), (0, 11)], ids=str)
def test_the_indices_of_torch_argmax(dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    got = argmax_last(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_ties_nan_infinities_and_signed_zeros_as_torch():
    """Ties go to the first maximum, a NaN counts as the maximum (its first one), -inf rows give 0."""
    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],
            [5.0, 5.0, 5.0, 5.0],
            [1.0, NAN, 3.0, NAN],
            [INF, 2.0, INF, NAN],
            [1.0, INF, INF, -INF],
            [-INF, -INF, -INF, -INF],
            [-0.0, 0.0, -0.0, 0.0],
        ]
    )
    assert argmax_last(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 1, 3, 1, 0, 0]
    assert argmax_last(x.to(torch.bfloat16)).tolist() == [1, 0, 1, 3, 1, 0, 0]


def test_strided_rows_and_a_row_alone():
    x = torch.randn(8, 200)
    assert torch.equal(argmax_last(x[:, ::3]), x[:, ::3].argmax(dim=-1))
    assert torch.equal(argmax_last(x.t()), x.t().argmax(dim=-1))
    for i in range(8):  # a row's index does not depend on the rows beside it
        assert argmax_last(x[i : i + 1]).item() == argmax_last(x)[i].item()
    assert argmax_last(x[3]).dim() == 0 and argmax_last(x[3]).item() == x[3].argmax().item()
