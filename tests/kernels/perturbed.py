"""A batch-dependent C linear for teeth: the CPU forward's layer loop (kernels/csrc/layer_ops_cpu.c) calls
its projections through a function pointer, cpu_llama.linear_function()'s; a test swaps in this one, which
rounds every call of more than one row another way (as a library GEMM's blocking may), so rows of a mixed
batch differ from the same rows alone."""

import ctypes

import torch

from kernels import linear_cpu
from kernels.cpu_build import DTYPE_CODES

_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
LINEAR_TYPE = ctypes.CFUNCTYPE(_i32, _i32, _ptr, _i64, _i64, _i64, _i32, _ptr, _i64, _ptr, _ptr, _i64, _i32)


def batch_dependent_linear():
    """A C-callable linear: specdec_linear, then outputs of calls with several rows scaled by 1 + 2^-7."""
    exact = linear_cpu.c_library().specdec_linear

    def linear(x_dtype, x, x_stride, rows, in_features, w_dtype, w, out_features, bias, out, out_stride, threads):
        status = exact(
            x_dtype, x, x_stride, rows, in_features, w_dtype, w, out_features, bias, out, out_stride, threads
        )
        if status == 0 and rows > 1:
            dtype = _DTYPES[x_dtype]
            size = torch.tensor([], dtype=dtype).element_size()
            count = (rows - 1) * out_stride + out_features
            buffer = (ctypes.c_char * (count * size)).from_address(out)
            target = torch.frombuffer(buffer, dtype=dtype).as_strided((rows, out_features), (out_stride, 1))
            target.mul_(1 + 2**-7)
        return status

    return LINEAR_TYPE(linear)
