/* The dtypes our C kernels take (DTYPE_CODES in kernels/cpu_build.py),
 * and bf16 <-> fp32 as torch converts them. */
#ifndef SPECDEC_DTYPES_H
#define SPECDEC_DTYPES_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
/* Block-quantized weight formats (llama.cpp's, kernels/quantized.py): linear_cpu.c's weights only. */
enum { DTYPE_Q8_0 = 3, DTYPE_Q4_1 = 4 };
/* The same formats packed for integer dot products with 8-bit activations (linear_int8.h). */
enum { DTYPE_Q8_0_INT8 = 5, DTYPE_Q4_1_INT8 = 6 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One element of a tensor of `dtype` at base[offset], as fp32 (and back, rounded as torch rounds). */
static inline float load_scalar(int dtype, const void *base, int64_t offset) {
    if (dtype == DTYPE_F32) return ((const float *)base)[offset];
    if (dtype == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[offset]);
    return (float)((const _Float16 *)base)[offset];
}

static inline void store_scalar(int dtype, void *base, int64_t offset, float value) {
    if (dtype == DTYPE_F32) ((float *)base)[offset] = value;
    else if (dtype == DTYPE_BF16) ((uint16_t *)base)[offset] = f32_to_bf16(value);
    else ((_Float16 *)base)[offset] = (_Float16)value;
}

/* fp32 rounded to `dtype` and back: what storing an intermediate result in the model's dtype does. */
static inline float round_to(int dtype, float value) {
    if (dtype == DTYPE_F32) return value;
    if (dtype == DTYPE_BF16) return bf16_to_f32(f32_to_bf16(value));
    return (float)(_Float16)value;
}

#endif
