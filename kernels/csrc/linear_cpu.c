/* Batch-invariant linear layers for the CPU (see kernels/linear_cpu.py).
 *
 *   out[r, o] = bias[o] + sum_i x[r, i] * w[o, i]
 *
 * Every output element is one chain of fused multiply-adds over i = 0, 1, ..,
 * in - 1, in that order, from 0, in fp32 (weights and inputs widened exactly),
 * then the bias is added and the result rounded once to the output dtype. An
 * FMA is exactly rounded, so the chain has one result whatever computes it:
 * AVX-512, AVX2 or scalar fmaf. How many rows share the call, how they are
 * tiled and which thread takes a tile change which chains run side by side,
 * never the arithmetic of one. So a row's output is bitwise the same alone or
 * in a batch of any size, on any x86 CPU (and any CPU with an FMA).
 *
 * bf16 (weights and inputs) takes the pairs of inputs (2p, 2p+1) at a time, as
 * AVX-512 BF16's VDPBF16PS does: acc = fma(x[2p+1], w[o][2p+1], acc), then
 * acc = fma(x[2p], w[o][2p], acc), for p = 0, 1, ..: again one fixed chain per
 * element. CPUs without that instruction run the same two FMAs, so they give
 * the same bits too, except where a denormal appears (the instruction
 * flushes those to zero).
 *
 * Weights are packed once (kernels/linear_cpu.py, pack_weight) into groups of
 * GROUP_OUT outputs, [num_groups, in, GROUP_OUT] ([num_groups, in / 2,
 * GROUP_OUT, 2] for bf16, in padded to even with zeros): for each i the
 * weights of a group's outputs lie side by side, so a tile streams them in
 * one pass. A tile
 * is up to ROW_TILE rows times one group: ROW_TILE * GROUP_OUT / 16
 * accumulator vectors held in registers for the whole chain. Work units
 * (a group, a block of rows) run in parallel with OpenMP; a group's weights
 * stay in cache while its row tiles take turns.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors between inline functions, never across the ABI */
#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define LANES 16                /* floats per vector */
#define GROUP_VECTORS 4         /* vectors of outputs per group */
#define GROUP_OUT (LANES * GROUP_VECTORS)
#define ROW_TILE 4              /* rows a tile computes at once: 16 accumulators */
#define ROW_BLOCK (ROW_TILE * 8) /* rows of one work unit */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t half_vec_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef _Float16 vec_f16 __attribute__((vector_size(LANES * sizeof(_Float16))));

/* a * b + c, rounded once, lane by lane. */
static inline vec fma_vec(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 a2[2], b2[2], c2[2];
    memcpy(a2, &a, sizeof a);
    memcpy(b2, &b, sizeof b);
    memcpy(c2, &c, sizeof c);
    c2[0] = _mm256_fmadd_ps(a2[0], b2[0], c2[0]);
    c2[1] = _mm256_fmadd_ps(a2[1], b2[1], c2[1]);
    memcpy(&c, c2, sizeof c);
    return c;
#else
    for (int lane = 0; lane < LANES; lane++) c[lane] = fmaf(a[lane], b[lane], c[lane]);
    return c;
#endif
}

/* LANES weights of dtype at element offset, widened to fp32 (exact). */
static inline vec load_vec(int dtype, const void *base, int64_t offset) {
    vec v;
    if (dtype == DTYPE_F32) {
        memcpy(&v, (const float *)base + offset, sizeof v);
    } else if (dtype == DTYPE_BF16) {
        half_vec_u16 h;
        memcpy(&h, (const uint16_t *)base + offset, sizeof h);
        vec_u32 u = __builtin_convertvector(h, vec_u32) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        vec_f16 h;
        memcpy(&h, (const _Float16 *)base + offset, sizeof h);
        v = __builtin_convertvector(h, vec);
    }
    return v;
}

/* Rows x[0..num_rows) (fp32, row stride in) times one group's packed weights w [in, GROUP_OUT]:
 * acc[r][v] holds outputs v*LANES.. of row r. num_rows is a constant where this is inlined, so the
 * loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(int num_rows, const float *x, int64_t in, int w_dtype,
                                                       const void *w, vec acc[ROW_TILE][GROUP_VECTORS]) {
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = (vec){0};
    for (int64_t i = 0; i < in; i++) {
        vec wv[GROUP_VECTORS];
        for (int v = 0; v < GROUP_VECTORS; v++) wv[v] = load_vec(w_dtype, w, i * GROUP_OUT + v * LANES);
        for (int r = 0; r < num_rows; r++) {
            vec xv = (vec){0} + x[r * in + i];
            for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = fma_vec(xv, wv[v], acc[r][v]);
        }
    }
}

/* acc + x_odd * w_odd, then + x_even * w_even: LANES outputs, each from its pair of bf16 weights (one
 * 32-bit word: even element in the low half) and the pair of bf16 inputs in x_pair. */
static inline vec dot_pairs(vec acc, uint32_t x_pair, const uint16_t *w_pairs) {
#if defined(__AVX512BF16__)
    __m512i w = _mm512_loadu_si512((const void *)w_pairs);
    return (vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)x_pair), (__m512bh)w);
#else
    vec_u32 words, w_even, w_odd;
    memcpy(&words, w_pairs, sizeof words);
    w_even = words << 16;
    w_odd = words & 0xffff0000u;
    vec x_even = (vec){0} + bf16_to_f32((uint16_t)(x_pair & 0xffffu));
    vec x_odd = (vec){0} + bf16_to_f32((uint16_t)(x_pair >> 16));
    vec we, wo;
    memcpy(&we, &w_even, sizeof we);
    memcpy(&wo, &w_odd, sizeof wo);
    return fma_vec(x_even, we, fma_vec(x_odd, wo, acc));
#endif
}

/* tile() for bf16 rows x (row stride x_stride, bf16) and pair-packed weights w [ceil(in/2), GROUP_OUT, 2]. */
static inline __attribute__((always_inline)) void tile_bf16(int num_rows, const uint16_t *x, int64_t x_stride,
                                                            int64_t in, const uint16_t *w,
                                                            vec acc[ROW_TILE][GROUP_VECTORS]) {
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = (vec){0};
    int64_t num_pairs = in / 2;
    for (int64_t p = 0; p < num_pairs; p++) {
        const uint16_t *wp = w + p * GROUP_OUT * 2;
        for (int r = 0; r < num_rows; r++) {
            uint32_t x_pair;
            memcpy(&x_pair, x + r * x_stride + 2 * p, 4);
            for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = dot_pairs(acc[r][v], x_pair, wp + v * LANES * 2);
        }
    }
    if (in % 2) { /* the last input pairs with a zero (its weight is padded with zero too) */
        const uint16_t *wp = w + num_pairs * GROUP_OUT * 2;
        for (int r = 0; r < num_rows; r++) {
            uint32_t x_pair = x[r * x_stride + in - 1];
            for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = dot_pairs(acc[r][v], x_pair, wp + v * LANES * 2);
        }
    }
}

static void store_tile(int num_rows, vec acc[ROW_TILE][GROUP_VECTORS], int64_t row0, int64_t out0,
                       int64_t out_features, const float *bias, int out_dtype, void *out, int64_t out_stride) {
    int64_t num_out = out_features - out0 < GROUP_OUT ? out_features - out0 : GROUP_OUT;
    for (int r = 0; r < num_rows; r++) {
        float values[GROUP_OUT];
        memcpy(values, acc[r], sizeof values);
        for (int64_t o = 0; o < num_out; o++) {
            float value = bias ? values[o] + bias[out0 + o] : values[o];
            store_scalar(out_dtype, out, (row0 + r) * out_stride + out0 + o, value);
        }
    }
}

/* One work unit: rows [row0, row_end) of group g. x is fp32 with row stride in, or for bf16 weights the
 * bf16 input itself with row stride x_stride. */
static void run_unit(const void *x, int64_t x_stride, int64_t in, int64_t row0, int64_t row_end, int w_dtype,
                     const void *w, int64_t g, int64_t out_features, const float *bias, int out_dtype, void *out,
                     int64_t out_stride) {
    int64_t group_elements = (w_dtype == DTYPE_BF16 ? (in + 1) / 2 * 2 : in) * GROUP_OUT;
    const void *group_w = (const char *)w + g * group_elements * (w_dtype == DTYPE_F32 ? 4 : 2);
    vec acc[ROW_TILE][GROUP_VECTORS];
    for (int64_t r = row0; r < row_end; r += ROW_TILE) {
        int num_rows = row_end - r < ROW_TILE ? (int)(row_end - r) : ROW_TILE;
        if (w_dtype == DTYPE_BF16) {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride;
            switch (num_rows) { /* each case inlines the tile with a constant row count */
                case 4: tile_bf16(4, xr, x_stride, in, group_w, acc); break;
                case 3: tile_bf16(3, xr, x_stride, in, group_w, acc); break;
                case 2: tile_bf16(2, xr, x_stride, in, group_w, acc); break;
                default: tile_bf16(1, xr, x_stride, in, group_w, acc); break;
            }
        } else {
            const float *xr = (const float *)x + r * in;
            switch (num_rows) {
                case 4: tile(4, xr, in, w_dtype, group_w, acc); break;
                case 3: tile(3, xr, in, w_dtype, group_w, acc); break;
                case 2: tile(2, xr, in, w_dtype, group_w, acc); break;
                default: tile(1, xr, in, w_dtype, group_w, acc); break;
            }
        }
        store_tile(num_rows, acc, r, g * GROUP_OUT, out_features, bias, out_dtype, out, out_stride);
    }
}

/* out[num_rows, out_features] (row stride out_stride) = x[num_rows, in] (row stride x_stride) @ w^T + bias.
 * w: packed as the header says, of w_dtype; bias: fp32 [out_features] or NULL. x and out have dtype
 * x_dtype, which must be bf16 when w_dtype is. Returns 0, 1 when scratch memory cannot be had, 2 for
 * bf16 weights with other inputs. */
int specdec_linear(int x_dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t in, int w_dtype,
                   const void *w, int64_t out_features, const float *bias, void *out, int64_t out_stride,
                   int num_threads) {
    const void *xs = x;
    float *scratch = NULL;
    if (w_dtype == DTYPE_BF16 && x_dtype != DTYPE_BF16) return 2;
    if (w_dtype != DTYPE_BF16 && (x_dtype != DTYPE_F32 || x_stride != in)) { /* a packed fp32 copy (exact) */
        scratch = malloc((size_t)(num_rows * in) * sizeof(float));
        if (!scratch) return 1;
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t i = 0; i < in; i++) scratch[r * in + i] = load_scalar(x_dtype, x, r * x_stride + i);
        xs = scratch;
    }
    int64_t num_groups = (out_features + GROUP_OUT - 1) / GROUP_OUT;
    int64_t num_blocks = (num_rows + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < num_groups; g++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            int64_t row0 = b * ROW_BLOCK;
            int64_t row_end = row0 + ROW_BLOCK < num_rows ? row0 + ROW_BLOCK : num_rows;
            run_unit(xs, x_stride, in, row0, row_end, w_dtype, w, g, out_features, bias, x_dtype, out, out_stride);
        }
    }
    free(scratch);
    return 0;
}

/* The group size pack_weight must use. */
int specdec_linear_group_out(void) { return GROUP_OUT; }
