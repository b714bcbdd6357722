/* The row-wise ops of a decoder layer, fused: residual add + RMSNorm, rotary embedding of q and k,
 * SiLU(gate) * up, and the K/V write into the paged cache (kernels/layer_ops_cpu.py). Each replaces 5-15 small torch ops, each with its own
 * dispatch, allocation and pass over memory.
 *
 * Batch invariance: every row is computed alone, its elements in a fixed order, whatever the number of
 * rows or threads (threads split rows, never a row). Rounding follows `transformers`' Llama code: the
 * math is fp32 and each intermediate the reference keeps in the model's dtype is rounded to it
 * (round_to), so fp32 matches it up to the order of the RMSNorm sum and SiLU's exp (our polynomial,
 * relative error < 2e-7: exp_poly.h), and bf16/fp16 up to those.
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"
#include "exp_poly.h"

#define MIN_ELEMENTS_PER_THREAD 16384 /* below this, one thread: a fork costs more than the work */

/* residual[r] = round(residual[r] + x[r]) when x is given (else residual is the input as it is), then
 * out[r] = round(w * round(residual[r] * rsqrt(mean(residual[r]^2) + eps))). */
int specdec_add_rms_norm(int dtype, const void *x, int64_t x_stride, void *residual, int64_t res_stride,
                         const void *weight, void *out, int64_t out_stride, int64_t num_rows, int64_t dim,
                         float eps, int num_threads) {
    int threads = num_rows * dim >= 2 * MIN_ELEMENTS_PER_THREAD ? num_threads : 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float h = load_scalar(dtype, residual, r * res_stride + i);
            if (x) {
                h = round_to(dtype, h + load_scalar(dtype, x, r * x_stride + i));
                store_scalar(dtype, residual, r * res_stride + i, h);
            }
            sum += h * h;
        }
        float inv_rms = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float h = load_scalar(dtype, residual, r * res_stride + i);
            float normed = round_to(dtype, h * inv_rms);
            store_scalar(dtype, out, r * out_stride + i, load_scalar(dtype, weight, i) * normed);
        }
    }
    return 0;
}

/* In place on num_heads heads of head_dim per row (q's heads then k's, as they lie in a fused qkv row):
 * x = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) = (-x[D/2:], x[:D/2]);
 * cos and sin are [num_rows, head_dim] in the model's dtype. */
int specdec_rope(int dtype, void *x, int64_t x_stride, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                 const void *cos, const void *sin, int64_t cs_stride, int num_threads) {
    if (head_dim % 2 || head_dim > 1024) return 1;
    int64_t half = head_dim / 2;
    int threads = num_rows * num_heads * head_dim >= 2 * MIN_ELEMENTS_PER_THREAD ? num_threads : 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float c[1024], s[1024], v[1024];
        for (int64_t i = 0; i < head_dim; i++) {
            c[i] = load_scalar(dtype, cos, r * cs_stride + i);
            s[i] = load_scalar(dtype, sin, r * cs_stride + i);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            int64_t base = r * x_stride + h * head_dim;
            for (int64_t i = 0; i < head_dim; i++) v[i] = load_scalar(dtype, x, base + i);
            for (int64_t i = 0; i < head_dim; i++) {
                float rotated = i < half ? -v[i + half] : v[i - half];
                float value = round_to(dtype, v[i] * c[i]) + round_to(dtype, rotated * s[i]);
                store_scalar(dtype, x, base + i, value);
            }
        }
    }
    return 0;
}

/* silu(g) = g / (1 + e^-g), from t = e^-|g| (a nonpositive exponent): g / (1 + t) for g >= 0, g t / (1 + t)
 * below. */
static inline float silu(float g) {
    float t = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * t) / (1.0f + t);
}

/* out[r] = round(round(silu(gate[r])) * up[r]), gate and up the two halves of a fused gate/up row. fp32 has
 * its own loop, which the compiler vectorises (the same bits: silu is plain arithmetic). */
int specdec_silu_mul(int dtype, const void *gate_up, int64_t gu_stride, int64_t num_rows, int64_t dim,
                     void *out, int64_t out_stride, int num_threads) {
    int threads = num_rows * dim >= 2 * MIN_ELEMENTS_PER_THREAD ? num_threads : 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        if (dtype == DTYPE_F32) {
            const float *gate = (const float *)gate_up + r * gu_stride, *up = gate + dim;
            float *target = (float *)out + r * out_stride;
            for (int64_t i = 0; i < dim; i++) target[i] = silu(gate[i]) * up[i];
            continue;
        }
        for (int64_t i = 0; i < dim; i++) {
            float g = load_scalar(dtype, gate_up, r * gu_stride + i);
            float u = load_scalar(dtype, gate_up, r * gu_stride + dim + i);
            store_scalar(dtype, out, r * out_stride + i, round_to(dtype, silu(g)) * u);
        }
    }
    return 0;
}

/* Stores each row's K and V heads (kv_width elements each, at k and v in the row) at its cache slot:
 * key_cache and value_cache are [num_slots, kv_width] of the same dtype. */
int specdec_write_kv(int dtype, const void *k, const void *v, int64_t row_stride, int64_t num_rows,
                     int64_t kv_width, const int64_t *slot_mapping, void *key_cache, void *value_cache) {
    int64_t size = dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t slot = slot_mapping[r];
        memcpy((char *)key_cache + slot * kv_width * size, (const char *)k + r * row_stride * size, kv_width * size);
        memcpy((char *)value_cache + slot * kv_width * size, (const char *)v + r * row_stride * size, kv_width * size);
    }
    return 0;
}
