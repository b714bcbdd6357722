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
 * is up to ROW_TILE rows times PASS_VECTORS vectors of a group's outputs:
 * ROW_TILE * PASS_VECTORS accumulator vectors held in registers for the
 * whole chain. With AVX-512 a vector holds 16 floats and a pass is the
 * whole group (16 of the 32 registers); with AVX2 (16 registers of 8
 * floats) a pass is 16 of the group's 64 outputs, and the group takes four
 * (64-byte vectors there would spill every accumulator to memory: 5-7
 * GFLOP/s instead of ~60 on an AMD EPYC without AVX-512). Work units
 * (a group, a block of rows) run in parallel with OpenMP; a group's weights
 * stay in cache while its row tiles take turns.
 *
 * Block-quantized weights (llama.cpp's q8_0 and q4_1: blocks of QBLOCK
 * inputs of one output share an fp16 scale d, and for q4_1 an fp16 minimum
 * m) are dequantised in registers, a block at a time, to the fp32 value
 * gguf-py and transformers dequantise them to: q8_0 w = d * q (q int8),
 * q4_1 w = d * q + m (q 0..15). d * q is exact in fp32 (11 by at most 8
 * significant bits), so fma(d, q, m) is that value too. The chain is then
 * the fp32 chain above: a quantized linear gives bitwise what the fp32
 * kernel gives on the dequantised weights, on any CPU. Inputs are fp32
 * (others are widened first). Packed per group, per block of inputs, one
 * record: d[GROUP_OUT] (fp16), for q4_1 m[GROUP_OUT] (fp16), then the
 * values for input 0, 1, .., QBLOCK - 1: q8_0 GROUP_OUT int8 each; q4_1
 * GROUP_OUT / 2 bytes each, in two halves of 16 bytes whose byte t holds
 * output 32h + t in its low nibble and output 32h + 16 + t in its high one.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors between inline functions, never across the ABI */
#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16                /* floats per vector: one AVX-512 register */
#define PASS_VECTORS 4          /* vectors of outputs a tile accumulates at once: the whole group */
#else
#define LANES 8                 /* one AVX2 register (the scalar path uses the same shape) */
#define PASS_VECTORS 2          /* 4 rows x 2 accumulators, the weights and x fit in 16 registers */
#endif
#define GROUP_OUT 64            /* outputs per packed group (the layout: the same on every CPU) */
#define GROUP_VECTORS (GROUP_OUT / LANES)
#define HALF_VECTORS (16 / LANES) /* vectors of 16 outputs: a q4_1 record's low or high nibbles of 16 bytes */
#define ROW_TILE 4              /* rows a tile computes at once: 16 accumulators */
#define ROW_BLOCK (ROW_TILE * 8) /* rows of one work unit */
#define QBLOCK 32               /* inputs per quantization block (q8_0, q4_1) */
#define PREFETCH_RECORDS 8      /* how far ahead tile_quantized fetches */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096     /* how far ahead tile and tile_bf16 fetch weights (a -D may override it) */
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t half_vec_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef _Float16 vec_f16 __attribute__((vector_size(LANES * sizeof(_Float16))));
typedef int8_t vec_i8 __attribute__((vector_size(LANES)));
typedef uint8_t vec_u8 __attribute__((vector_size(LANES)));
typedef vec acc_tile[ROW_TILE][GROUP_VECTORS]; /* a tile's rows times a whole group, between passes */

/* a * b + c, rounded once, lane by lane. */
static inline vec fma_vec(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
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
#if !defined(__AVX512F__) && defined(__AVX2__)
        __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset))), 16);
        memcpy(&v, &u, sizeof v);
#else
        half_vec_u16 h;
        memcpy(&h, (const uint16_t *)base + offset, sizeof h);
        vec_u32 u = __builtin_convertvector(h, vec_u32) << 16;
        memcpy(&v, &u, sizeof v);
#endif
    } else {
        vec_f16 h;
        memcpy(&h, (const _Float16 *)base + offset, sizeof h);
        v = __builtin_convertvector(h, vec);
    }
    return v;
}

/* Asks for the weights PREFETCH_BYTES past the `bytes` at p. The weights stream from memory once per step;
 * at a few rows the hardware prefetcher alone leaves the FMAs waiting on them (on the Intel kind a bf16
 * verify of 4 rows took 20% longer without this, a decode 9%: bench/bench_linear.py --build). Past a
 * group's end these are the next group's weights, which come next. */
static inline void prefetch_ahead(const void *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)p + PREFETCH_BYTES + line);
}

/* Rows x[0..num_rows) (fp32, row stride in) times one group's packed weights w [in, GROUP_OUT], the pass of
 * output vectors v0 .. v0 + PASS_VECTORS - 1: acc[r][v] holds outputs v*LANES.. of row r. num_rows is a
 * constant where this is inlined, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(int num_rows, const float *x, int64_t in, int w_dtype,
                                                       const void *w, int v0, acc_tile acc) {
    vec a[ROW_TILE][PASS_VECTORS];
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = (vec){0};
    int w_size = w_dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t i = 0; i < in; i++) {
        vec wv[PASS_VECTORS];
        int64_t first = i * GROUP_OUT + v0 * LANES;
        prefetch_ahead((const char *)w + first * w_size, PASS_VECTORS * LANES * w_size);
        for (int v = 0; v < PASS_VECTORS; v++) wv[v] = load_vec(w_dtype, w, first + v * LANES);
        for (int r = 0; r < num_rows; r++) {
            vec xv = (vec){0} + x[r * in + i];
            for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = fma_vec(xv, wv[v], a[r][v]);
        }
    }
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) acc[r][v0 + v] = a[r][v];
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
                                                            int64_t in, const uint16_t *w, int v0, acc_tile acc) {
    vec a[ROW_TILE][PASS_VECTORS];
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = (vec){0};
    int64_t num_pairs = in / 2;
    for (int64_t p = 0; p < num_pairs; p++) {
        const uint16_t *wp = w + p * GROUP_OUT * 2 + v0 * LANES * 2;
        prefetch_ahead(wp, PASS_VECTORS * LANES * 4);
        for (int r = 0; r < num_rows; r++) {
            uint32_t x_pair;
            memcpy(&x_pair, x + r * x_stride + 2 * p, 4);
            for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = dot_pairs(a[r][v], x_pair, wp + v * LANES * 2);
        }
    }
    if (in % 2) { /* the last input pairs with a zero (its weight is padded with zero too) */
        const uint16_t *wp = w + num_pairs * GROUP_OUT * 2 + v0 * LANES * 2;
        for (int r = 0; r < num_rows; r++) {
            uint32_t x_pair = x[r * x_stride + in - 1];
            for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = dot_pairs(a[r][v], x_pair, wp + v * LANES * 2);
        }
    }
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) acc[r][v0 + v] = a[r][v];
}

/* Bytes of one packed record: a block of QBLOCK inputs times a group's outputs (see the header). */
static inline int64_t record_bytes(int w_dtype) {
    return w_dtype == DTYPE_Q8_0 || w_dtype == DTYPE_Q8_0_INT8 ? GROUP_OUT * 2 + QBLOCK * GROUP_OUT : GROUP_OUT * 4 + QBLOCK * GROUP_OUT / 2;
}

/* The conversions below in vector instructions: GCC turns __builtin_convertvector into scalar ones here. */
#if defined(__AVX512F__)
static inline vec to_vec(__m512 v) { return (vec)v; }
#elif defined(__AVX2__)
static inline vec to_vec(__m256 v) { return (vec)v; }
#endif

/* LANES fp16 values at p, widened to fp32 (exact). */
static inline vec load_f16(const uint8_t *p) {
#if defined(__AVX512F__)
    return to_vec(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
#elif defined(__AVX2__) && defined(__F16C__)
    return to_vec(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
#else
    vec_f16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vec);
#endif
}

/* LANES int8 values at p as fp32 (exact). */
static inline vec load_i8(const uint8_t *p) {
#if defined(__AVX512F__)
    return to_vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
#elif defined(__AVX2__)
    return to_vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
#else
    vec_i8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, vec);
#endif
}

/* The low (high == 0) or high nibbles of the LANES bytes at p, as fp32. */
static inline vec load_nibbles(const uint8_t *p, int high) {
#if defined(__AVX512F__)
    /* A nibble's value as fp32 from a table: the permute reads the low 4 bits of each index, so it both
     * masks and converts (one instruction where and + convert take two). */
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return to_vec(_mm512_permutexvar_ps(high ? _mm512_srli_epi32(u, 4) : u, values));
#elif defined(__AVX2__)
    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return to_vec(_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(u, 4) : _mm256_and_si256(u, _mm256_set1_epi32(15))));
#else
    vec_u8 bytes;
    memcpy(&bytes, p, sizeof bytes);
    vec_u32 u = __builtin_convertvector(bytes, vec_u32);
    return __builtin_convertvector(high ? u >> 4 : u & 15u, vec);
#endif
}

/* A record's scales d (and for q4_1 its minimums m) of output vectors v0 .., widened to fp32. */
static inline __attribute__((always_inline)) void load_scales(int w_dtype, const uint8_t *rec, int v0,
                                                              vec d[PASS_VECTORS], vec m[PASS_VECTORS]) {
    for (int v = 0; v < PASS_VECTORS; v++) {
        d[v] = load_f16(rec + (v0 + v) * LANES * 2);
        m[v] = w_dtype == DTYPE_Q4_1 ? load_f16(rec + GROUP_OUT * 2 + (v0 + v) * LANES * 2) : (vec){0};
    }
}

/* Input j's weights of a record's output vectors v0 .., dequantised to their exact fp32 values: q8_0 d * q,
 * q4_1 d * q + m (= fma(d, q, m): d * q is exact). In a q4_1 record each 32 outputs are 16 bytes, output
 * 32h + t in the low nibble of byte t and 32h + 16 + t in its high one. */
static inline __attribute__((always_inline)) void dequantize_input(int w_dtype, const uint8_t *rec, int j, int v0,
                                                                   const vec d[PASS_VECTORS],
                                                                   const vec m[PASS_VECTORS],
                                                                   vec wv[PASS_VECTORS]) {
    if (w_dtype == DTYPE_Q8_0) {
        const uint8_t *q = rec + GROUP_OUT * 2 + j * GROUP_OUT;
        for (int v = 0; v < PASS_VECTORS; v++) wv[v] = d[v] * load_i8(q + (v0 + v) * LANES);
    } else {
        const uint8_t *q = rec + GROUP_OUT * 4 + j * (GROUP_OUT / 2);
        for (int v = 0; v < PASS_VECTORS; v++) {
            int u = v0 + v, in_half = u % (2 * HALF_VECTORS); /* vector u: outputs u*LANES .. */
            const uint8_t *bytes = q + u / (2 * HALF_VECTORS) * 16 + in_half % HALF_VECTORS * LANES;
            wv[v] = fma_vec(d[v], load_nibbles(bytes, in_half >= HALF_VECTORS), m[v]);
        }
    }
}

/* Record b of a group's block-quantized weights w: asks for the record PREFETCH_RECORDS ahead (at one row a
 * block's arithmetic is short beside its fetch from memory; past the group's end it is the next group's, which
 * comes next). */
static inline __attribute__((always_inline)) const uint8_t *open_record(int w_dtype, const uint8_t *w, int64_t b) {
    int64_t record = record_bytes(w_dtype);
    const uint8_t *rec = w + b * record;
    for (int64_t line = 0; line < record; line += 64) __builtin_prefetch(rec + PREFETCH_RECORDS * record + line);
    return rec;
}

/* tile() for block-quantized weights w (one group's records, w_dtype DTYPE_Q8_0 or DTYPE_Q4_1); in is a
 * multiple of QBLOCK. Each weight is dequantised to its exact fp32 value in registers, then the chain is
 * tile()'s. */
static inline __attribute__((always_inline)) void tile_quantized(int num_rows, const float *x, int64_t in,
                                                                 int w_dtype, const uint8_t *w, int v0,
                                                                 acc_tile acc) {
    vec a[ROW_TILE][PASS_VECTORS];
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = (vec){0};
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        vec d[PASS_VECTORS], m[PASS_VECTORS];
        const uint8_t *rec = open_record(w_dtype, w, b);
        load_scales(w_dtype, rec, v0, d, m);
        const float *xb = x + b * QBLOCK;
        for (int j = 0; j < QBLOCK; j++) {
            vec wv[PASS_VECTORS];
            dequantize_input(w_dtype, rec, j, v0, d, m, wv);
            for (int r = 0; r < num_rows; r++) {
                vec xv = (vec){0} + xb[r * in + j];
                for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = fma_vec(xv, wv[v], a[r][v]);
            }
        }
    }
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) acc[r][v0 + v] = a[r][v];
}

/* Rows xb[r * in + j] (r < num_rows, j < QBLOCK) of one block of inputs times its dequantised weights wv, output
 * vectors v0 ..: the tile()'s chain continued over the block, acc[r] holding row r's outputs before and after. */
static inline __attribute__((always_inline)) void accumulate_block(int num_rows, const float *xb, int64_t in,
                                                                   const vec wv[QBLOCK][GROUP_VECTORS], int v0,
                                                                   vec acc[][GROUP_VECTORS]) {
    vec a[ROW_TILE][PASS_VECTORS]; /* a local copy: stays in registers while x is read */
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = acc[r][v0 + v];
    for (int j = 0; j < QBLOCK; j++)
        for (int r = 0; r < num_rows; r++) {
            vec xv = (vec){0} + xb[r * in + j];
            for (int v = 0; v < PASS_VECTORS; v++) a[r][v] = fma_vec(xv, wv[j][v0 + v], a[r][v]);
        }
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < PASS_VECTORS; v++) acc[r][v0 + v] = a[r][v];
}

/* tile_quantized() for more rows than one tile holds (num_rows <= ROW_BLOCK): dequantising a record costs
 * more than a row's FMAs, so each record is dequantised once into wv (8 KiB, in L1) and every tile of
 * rows runs over it in turn, pass by pass, its accumulators kept in acc between records. Each element's
 * chain is tile_quantized()'s: inputs in order. */
static inline __attribute__((always_inline)) void rows_quantized(int num_rows, const float *x, int64_t in,
                                                                 int w_dtype, const uint8_t *w,
                                                                 vec acc[ROW_BLOCK][GROUP_VECTORS]) {
    for (int r = 0; r < num_rows; r++)
        for (int v = 0; v < GROUP_VECTORS; v++) acc[r][v] = (vec){0};
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        vec wv[QBLOCK][GROUP_VECTORS];
        const uint8_t *rec = open_record(w_dtype, w, b);
        for (int v0 = 0; v0 < GROUP_VECTORS; v0 += PASS_VECTORS) {
            vec d[PASS_VECTORS], m[PASS_VECTORS];
            load_scales(w_dtype, rec, v0, d, m);
            for (int j = 0; j < QBLOCK; j++) dequantize_input(w_dtype, rec, j, v0, d, m, wv[j] + v0);
        }
        for (int r = 0; r < num_rows; r += ROW_TILE) {
            const float *xb = x + r * in + b * QBLOCK;
            for (int v0 = 0; v0 < GROUP_VECTORS; v0 += PASS_VECTORS)
                switch (num_rows - r < ROW_TILE ? num_rows - r : ROW_TILE) {
                    case 4: accumulate_block(4, xb, in, wv, v0, acc + r); break;
                    case 3: accumulate_block(3, xb, in, wv, v0, acc + r); break;
                    case 2: accumulate_block(2, xb, in, wv, v0, acc + r); break;
                    default: accumulate_block(1, xb, in, wv, v0, acc + r); break;
                }
        }
    }
}

/* Rows row0 .. of one group's outputs out0 .. (values[r]: row row0 + r's GROUP_OUT sums) plus the bias, each
 * rounded once to the output dtype; a last group's padding outputs are dropped. */
static void store_rows(int num_rows, const float (*values)[GROUP_OUT], int64_t row0, int64_t out0,
                       int64_t out_features, const float *bias, int out_dtype, void *out, int64_t out_stride) {
    int64_t num_out = out_features - out0 < GROUP_OUT ? out_features - out0 : GROUP_OUT;
    if (out_dtype == DTYPE_F32) { /* the same sums, in loops the compiler vectorises */
        for (int r = 0; r < num_rows; r++) {
            float *target = (float *)out + (row0 + r) * out_stride + out0;
            if (!bias) {
                memcpy(target, values[r], sizeof(float) * num_out);
                continue;
            }
            for (int64_t o = 0; o < num_out; o++) target[o] = values[r][o] + bias[out0 + o];
        }
        return;
    }
    for (int r = 0; r < num_rows; r++)
        for (int64_t o = 0; o < num_out; o++) {
            float value = bias ? values[r][o] + bias[out0 + o] : values[r][o];
            store_scalar(out_dtype, out, (row0 + r) * out_stride + out0 + o, value);
        }
}

static void store_tile(int num_rows, vec acc[ROW_TILE][GROUP_VECTORS], int64_t row0, int64_t out0,
                       int64_t out_features, const float *bias, int out_dtype, void *out, int64_t out_stride) {
    float values[ROW_TILE][GROUP_OUT];
    memcpy(values, acc, (size_t)num_rows * sizeof values[0]);
    store_rows(num_rows, (const float (*)[GROUP_OUT])values, row0, out0, out_features, bias, out_dtype, out,
               out_stride);
}

/* run_unit() for block-quantized weights; w_dtype is a constant where this is inlined, so each format's
 * dequantisation is compiled without a branch. */
static inline __attribute__((always_inline)) void run_quantized_unit(const float *x, int64_t in, int64_t row0,
                                                                     int64_t row_end, int w_dtype,
                                                                     const uint8_t *w, int64_t out0,
                                                                     int64_t out_features, const float *bias,
                                                                     int out_dtype, void *out, int64_t out_stride) {
    if (row_end - row0 > ROW_TILE) {
        vec acc[ROW_BLOCK][GROUP_VECTORS];
        rows_quantized((int)(row_end - row0), x + row0 * in, in, w_dtype, w, acc);
        for (int64_t r = row0; r < row_end; r += ROW_TILE)
            store_tile(row_end - r < ROW_TILE ? (int)(row_end - r) : ROW_TILE, acc + (r - row0), r, out0,
                       out_features, bias, out_dtype, out, out_stride);
        return;
    }
    acc_tile acc;
    const float *xr = x + row0 * in;
    int num_rows = (int)(row_end - row0);
    for (int v0 = 0; v0 < GROUP_VECTORS; v0 += PASS_VECTORS)
        switch (num_rows) {
            case 4: tile_quantized(4, xr, in, w_dtype, w, v0, acc); break;
            case 3: tile_quantized(3, xr, in, w_dtype, w, v0, acc); break;
            case 2: tile_quantized(2, xr, in, w_dtype, w, v0, acc); break;
            default: tile_quantized(1, xr, in, w_dtype, w, v0, acc); break;
        }
    store_tile(num_rows, acc, row0, out0, out_features, bias, out_dtype, out, out_stride);
}

/* One work unit: rows [row0, row_end) of group g. x is fp32 with row stride in, or for bf16 weights the
 * bf16 input itself with row stride x_stride. */
static void run_unit(const void *x, int64_t x_stride, int64_t in, int64_t row0, int64_t row_end, int w_dtype,
                     const void *w, int64_t g, int64_t out_features, const float *bias, int out_dtype, void *out,
                     int64_t out_stride) {
    if (w_dtype == DTYPE_Q8_0 || w_dtype == DTYPE_Q4_1) {
        const uint8_t *group_w = (const uint8_t *)w + g * (in / QBLOCK * record_bytes(w_dtype));
        if (w_dtype == DTYPE_Q8_0)
            run_quantized_unit((const float *)x, in, row0, row_end, DTYPE_Q8_0, group_w, g * GROUP_OUT,
                               out_features, bias, out_dtype, out, out_stride);
        else
            run_quantized_unit((const float *)x, in, row0, row_end, DTYPE_Q4_1, group_w, g * GROUP_OUT,
                               out_features, bias, out_dtype, out, out_stride);
        return;
    }
    int64_t group_bytes = (w_dtype == DTYPE_BF16 ? (in + 1) / 2 * 2 : in) * GROUP_OUT * (w_dtype == DTYPE_F32 ? 4 : 2);
    const void *group_w = (const char *)w + g * group_bytes;
    acc_tile acc;
    for (int64_t r = row0; r < row_end; r += ROW_TILE) {
        int num_rows = row_end - r < ROW_TILE ? (int)(row_end - r) : ROW_TILE;
        for (int v0 = 0; v0 < GROUP_VECTORS; v0 += PASS_VECTORS) {
            if (w_dtype == DTYPE_BF16) {
                const uint16_t *xr = (const uint16_t *)x + r * x_stride;
                switch (num_rows) { /* each case inlines the tile with a constant row count */
                    case 4: tile_bf16(4, xr, x_stride, in, group_w, v0, acc); break;
                    case 3: tile_bf16(3, xr, x_stride, in, group_w, v0, acc); break;
                    case 2: tile_bf16(2, xr, x_stride, in, group_w, v0, acc); break;
                    default: tile_bf16(1, xr, x_stride, in, group_w, v0, acc); break;
                }
            } else {
                const float *xr = (const float *)x + r * in;
                switch (num_rows) {
                    case 4: tile(4, xr, in, w_dtype, group_w, v0, acc); break;
                    case 3: tile(3, xr, in, w_dtype, group_w, v0, acc); break;
                    case 2: tile(2, xr, in, w_dtype, group_w, v0, acc); break;
                    default: tile(1, xr, in, w_dtype, group_w, v0, acc); break;
                }
            }
        }
        store_tile(num_rows, acc, r, g * GROUP_OUT, out_features, bias, out_dtype, out, out_stride);
    }
}

#include "linear_int8.h"

/* out[num_rows, out_features] (row stride out_stride) = x[num_rows, in] (row stride x_stride) @ w^T + bias.
 * w: packed as the header says, of w_dtype; bias: fp32 [out_features] or NULL. x and out have dtype
 * x_dtype, which must be bf16 when w_dtype is. Returns 0, 1 when scratch memory cannot be had, 2 for
 * bf16 weights with other inputs, 3 for quantized weights whose in is not a multiple of QBLOCK. */
int specdec_linear(int x_dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t in, int w_dtype,
                   const void *w, int64_t out_features, const float *bias, void *out, int64_t out_stride,
                   int num_threads) {
    const void *xs = x;
    float *scratch = NULL;
    if (w_dtype == DTYPE_Q8_0_INT8 || w_dtype == DTYPE_Q4_1_INT8)
        return linear_int8(x_dtype, x, x_stride, num_rows, in, w_dtype, w, out_features, bias, out, out_stride,
                           num_threads);
    if (w_dtype == DTYPE_BF16 && x_dtype != DTYPE_BF16) return 2;
    if ((w_dtype == DTYPE_Q8_0 || w_dtype == DTYPE_Q4_1) && in % QBLOCK) return 3;
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

/* The inputs per quantization block of q8_0 and q4_1. */
int specdec_linear_quant_block(void) { return QBLOCK; }
