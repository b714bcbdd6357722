/* Integer dot products for block-quantized weights: linear_cpu.c's DTYPE_Q8_0_INT8 and DTYPE_Q4_1_INT8.
 *
 *   out[r, o] = bias[o] + sum_b (d[o, b] * dx[r, b] * isum[r, o, b] + m[o, b] * dx[r, b] * sx[r, b])
 *
 * Each row's activations are quantized on their own, a block of QBLOCK inputs at a time, as llama.cpp's
 * activation blocks are: dx = amax / 127, qx[j] = x[j] * (127 / amax) rounded to nearest-even (-127..127),
 * sx = sum_j qx[j], mx = dx * sx; scalar fp32 arithmetic that every build does alike. Then per output o
 * and block b, isum = sum_j qx[j] * q[o, j] in int32: an exact integer, whatever computes it (AVX-512
 * VNNI's VPDPBUSD, AVX2's VPMADDUBSW + VPMADDWD, scalar C). The fp32 part is one chain per element over
 * the blocks in order, from 0:
 *
 *     acc = fma(d[o] * dx, (float)isum, acc)      q8_0 and q4_1 (d * q is the weight, q8_0: q int8)
 *     acc = fma(m[o], mx, acc)                    q4_1 only (w = d * q + m, q 0..15: m times sum x)
 *
 * so a row's result depends on that row's input and the weights only, never on the rows beside it, the
 * tiling, the thread or the CPU's vector width: every build gives the same bits. The result differs from
 * the exact fp32-activation kernel (DTYPE_Q8_0, DTYPE_Q4_1) by the activations' 8-bit rounding.
 *
 * Packed per group of GROUP_OUT outputs and block of QBLOCK inputs, one record (kernels/quantized.py,
 * pack_int8): d[GROUP_OUT] (fp16), for q4_1 m[GROUP_OUT] (fp16), then the values as QUADS quads of inputs,
 * each [GROUP_OUT outputs][4 bytes]: a 32-bit lane holds 4 consecutive inputs of one output, the shape
 * VPDPBUSD multiplies. q8_0 stores q + 128 (unsigned: VPDPBUSD's unsigned operand; the 128 * sx it adds
 * is taken off again); q4_1 stores quads k and k + 4 in one [GROUP_OUT][4] of bytes, low and high nibble.
 */
#ifndef SPECDEC_LINEAR_INT8_H
#define SPECDEC_LINEAR_INT8_H

#define QUADS (QBLOCK / 4) /* 4-input lanes of a block */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT_LANES 16 /* outputs per integer vector: 16 int32 of a 512-bit register */
#define INT_PASS 4   /* output vectors a pass accumulates: the whole group */
/* Rows of a tile: 6 rows x 4 vectors of sums and accumulators are more than the 32 registers, and the
 * compiler keeps some in L1 between blocks, but a fifth and sixth row then cost no second pass over the
 * group's weights (loading and unpacking the nibbles, the scales): 5 and 6 rows 8% faster than 4 + 1, 4 + 2. */
#define INT_ROW_TILE 6
typedef __m512i ivec;
#elif defined(__AVX2__)
#define INT_LANES 8
#define INT_PASS 2   /* 4 rows x 2 int32 accumulators, and the weights, in AVX2's 16 registers */
typedef __m256i ivec;
#else
#define INT_LANES 8
#define INT_PASS 2
typedef int32_t ivec __attribute__((vector_size(INT_LANES * 4)));
#endif
#ifndef INT_ROW_TILE
#define INT_ROW_TILE ROW_TILE /* narrower builds: a block's records go through every tile of rows in turn */
#endif
#define INT_VECTORS (GROUP_OUT / INT_LANES)
typedef float fvec __attribute__((vector_size(INT_LANES * sizeof(float))));

/* Rows' activations as the integer kernel reads them: qx int8, and per block dx, sx and mx. */
typedef struct {
    int8_t *qx;  /* [num_rows, in] */
    float *dx;   /* [num_rows, in / QBLOCK] */
    float *mx;   /* [num_rows, in / QBLOCK]: dx * sx (q4_1's minimum multiplies it) */
    int32_t *sx; /* [num_rows, in / QBLOCK]: sum of the block's qx (q8_0's stored offset takes 128 * sx off) */
} int8_rows;

/* QBLOCK values as int8: *dx = amax / 127 and q[j] = values[j] * (127 / amax) rounded to nearest-even (the
 * rounding mode's: lrintf and the vector conversions alike), *sum their sum; a block with inf or NaN gets
 * dx = NaN and q = 0. Vectors only find the maximum magnitude (the same number in any order), multiply
 * each value once and convert it, so every build gives the same bytes. */
static inline void quantize_block(const float *values, int8_t *q, float *dx, int32_t *sum) {
    int32_t ints[QBLOCK];
    float amax = 0.0f;
    int finite = 1;
#if defined(__AVX512F__)
    __m512 v0 = _mm512_loadu_ps(values), v1 = _mm512_loadu_ps(values + 16);
    __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1), most = _mm512_set1_ps(FLT_MAX);
    finite = (_mm512_cmp_ps_mask(a0, most, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, most, _CMP_LE_OQ)) == 0xFFFF;
    if (finite) amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
#elif defined(__AVX2__)
    __m256 v[4], most = _mm256_set1_ps(FLT_MAX), magnitudes = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(values + 8 * i);
        __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(magnitude, most, _CMP_LE_OQ)) == 0xFF;
        magnitudes = _mm256_max_ps(magnitudes, magnitude);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, magnitudes);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#else
    for (int j = 0; j < QBLOCK; j++) {
        float magnitude = fabsf(values[j]);
        amax = magnitude > amax ? magnitude : amax;
        finite &= magnitude <= FLT_MAX; /* false for inf and NaN */
    }
#endif
    if (!finite) { /* the block's outputs become NaN, as the exact kernel's would */
        memset(q, 0, QBLOCK);
        *dx = NAN;
        *sum = 0;
        return;
    }
    float scale = amax > 0.0f ? 127.0f / amax : 0.0f;
#if defined(__AVX512F__)
    _mm512_storeu_si512(ints, _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(scale))));
    _mm512_storeu_si512(ints + 16, _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(scale))));
#elif defined(__AVX2__)
    for (int i = 0; i < 4; i++)
        _mm256_storeu_si256((__m256i *)(ints + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(scale))));
#else
    for (int j = 0; j < QBLOCK; j++) ints[j] = (int32_t)lrintf(values[j] * scale);
#endif
    int32_t total = 0;
    for (int j = 0; j < QBLOCK; j++) {
        q[j] = (int8_t)ints[j]; /* -127 .. 127 */
        total += ints[j];
    }
    *dx = amax / 127.0f;
    *sum = total;
}

/* Row r of x (fp32 values of x_dtype, row stride x_stride) quantized into rows (see the header). */
static void quantize_row(int x_dtype, const void *x, int64_t x_stride, int64_t in, int64_t r, int8_rows rows) {
    int64_t num_blocks = in / QBLOCK;
    for (int64_t b = 0; b < num_blocks; b++) {
        float buffer[QBLOCK];
        const float *values = (const float *)x + r * x_stride + b * QBLOCK;
        if (x_dtype != DTYPE_F32) {
            for (int j = 0; j < QBLOCK; j++) buffer[j] = load_scalar(x_dtype, x, r * x_stride + b * QBLOCK + j);
            values = buffer;
        }
        float dx;
        int32_t sum;
        quantize_block(values, rows.qx + r * in + b * QBLOCK, &dx, &sum);
        rows.dx[r * num_blocks + b] = dx;
        rows.mx[r * num_blocks + b] = dx * (float)sum;
        rows.sx[r * num_blocks + b] = sum;
    }
}

static inline fvec fma_fvec(fvec a, fvec b, fvec c) {
#if INT_LANES == 16
    return (fvec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (fvec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int lane = 0; lane < INT_LANES; lane++) c[lane] = fmaf(a[lane], b[lane], c[lane]);
    return c;
#endif
}

/* INT_LANES fp16 values at p as fp32 (exact). */
static inline fvec load_f16_int(const uint8_t *p) {
#if INT_LANES == 16
    return (fvec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (fvec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    _Float16 h[INT_LANES];
    fvec v;
    memcpy(h, p, sizeof h);
    for (int lane = 0; lane < INT_LANES; lane++) v[lane] = (float)h[lane];
    return v;
#endif
}

static inline fvec int_to_float(ivec v) {
#if INT_LANES == 16
    return (fvec)_mm512_cvtepi32_ps(v);
#elif defined(__AVX2__)
    return (fvec)_mm256_cvtepi32_ps(v);
#else
    return __builtin_convertvector(v, fvec);
#endif
}

static inline ivec broadcast_i32(int32_t value) {
#if INT_LANES == 16
    return _mm512_set1_epi32(value);
#elif defined(__AVX2__)
    return _mm256_set1_epi32(value);
#else
    return (ivec){0} + value;
#endif
}

/* Activations p[0..3] as one int32 in every lane: a broadcast load (AVX-512 folds it into VPDPBUSD's operand). */
static inline ivec broadcast_quad(const int8_t *p) {
    int32_t value;
    memcpy(&value, p, sizeof value);
    return broadcast_i32(value);
}

static inline ivec load_ivec(const uint8_t *p) {
    ivec v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if INT_LANES != 16 && !defined(__AVX2__)
/* acc + per 32-bit lane sum_i (u[4 lane + i] - offset) * s[4 lane + i], u unsigned bytes, s signed ones: the
 * scalar build's dot products. */
static inline ivec dot_bytes(ivec acc, ivec u, ivec s, int32_t offset) {
    uint8_t ub[INT_LANES * 4];
    int8_t sb[INT_LANES * 4];
    memcpy(ub, &u, sizeof ub);
    memcpy(sb, &s, sizeof sb);
    for (int lane = 0; lane < INT_LANES; lane++)
        for (int i = 0; i < 4; i++) acc[lane] += ((int32_t)ub[4 * lane + i] - offset) * sb[4 * lane + i];
    return acc;
}
#endif

/* q4_1's nibbles u (0..15) against activations s: acc + per 32-bit lane sum_i u[4 lane + i] * s[4 lane + i]
 * (VPDPBUSD). AVX2 keeps the sums in int16 instead, two per output (VPMADDUBSW: 2 * 15 * 127 per quad, so a
 * block's 8 quads stay within int16), and one widen_q4 at the block's end makes them int32: two
 * instructions a quad instead of three. */
static inline ivec dot_q4(ivec acc, ivec u, ivec s) {
#if INT_LANES == 16
    return _mm512_dpbusd_epi32(acc, u, s);
#elif defined(__AVX2__)
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#else
    return dot_bytes(acc, u, s, 0);
#endif
}

static inline ivec widen_q4(ivec acc) {
#if INT_LANES == 8 && defined(__AVX2__)
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#else
    return acc;
#endif
}

/* q8_0's stored bytes u = q + 128 against activations s: acc + sum_i u * s on AVX-512 VNNI (its start,
 * q8_start, then holds -128 * sx, so the block's sum comes out as sum_i q * s), acc + sum_i q * s elsewhere
 * (AVX2's VPMADDUBSW would overflow int16 on u * s: it takes |q| and s with q's sign, llama.cpp's trick). */
static inline ivec dot_q8(ivec acc, ivec u, ivec s) {
#if INT_LANES == 16
    return _mm512_dpbusd_epi32(acc, u, s);
#elif defined(__AVX2__)
    __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); /* u - 128 as int8 */
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
    return dot_bytes(acc, u, s, 128);
#endif
}

/* Where dot_q8 starts a block's sums for a row whose block's activations sum to sx. */
static inline ivec q8_start(int32_t sx) {
#if INT_LANES == 16
    return broadcast_i32(-128 * sx);
#else
    (void)sx;
    return broadcast_i32(0);
#endif
}

/* The low (high == 0) or high nibbles of the bytes of v, as bytes 0..15. */
static inline ivec nibbles(ivec v, int high) {
#if INT_LANES == 16
    return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(15));
#elif defined(__AVX2__)
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
#else
    uint8_t b[INT_LANES * 4];
    memcpy(b, &v, sizeof b);
    for (int i = 0; i < INT_LANES * 4; i++) b[i] = high ? b[i] >> 4 : b[i] & 15;
    memcpy(&v, b, sizeof v);
    return v;
#endif
}

/* Rows r0 .. r0 + num_rows - 1 of one block b of inputs times a record rec of the integer layout, output
 * vectors v0 .. v0 + INT_PASS - 1: each element's int32 sum over the block, then its step of the fp32 chain
 * (the header) on the accumulator acc[r][v] (row r's outputs (v0 + v) * INT_LANES ..). num_rows and w_dtype
 * are constants where this is inlined, so the loops unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void block_int8(int num_rows, int w_dtype, const uint8_t *rec,
                                                             int8_rows rows, int64_t r0, int64_t b, int64_t in,
                                                             fvec (*acc)[INT_PASS], int v0) {
    int64_t num_blocks = in / QBLOCK;
    const int8_t *xq[INT_ROW_TILE]; /* each row's block of activations, read 4 at a time (one int32 lane) */
    ivec sums[INT_ROW_TILE][INT_PASS];
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++) {
        xq[r] = rows.qx + (r0 + r) * in + b * QBLOCK;
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++)
            sums[r][v] = w_dtype == DTYPE_Q8_0_INT8 ? q8_start(rows.sx[(r0 + r) * num_blocks + b]) : broadcast_i32(0);
    }
    if (w_dtype == DTYPE_Q8_0_INT8) {
        const uint8_t *q = rec + GROUP_OUT * 2;
        #pragma GCC unroll 8
        for (int k = 0; k < QUADS; k++) {
            ivec wv[INT_PASS];
            #pragma GCC unroll 8
            for (int v = 0; v < INT_PASS; v++) wv[v] = load_ivec(q + (k * GROUP_OUT + (v0 + v) * INT_LANES) * 4);
            #pragma GCC unroll 8
            for (int r = 0; r < num_rows; r++) {
                ivec xs = broadcast_quad(xq[r] + 4 * k);
                #pragma GCC unroll 8
                for (int v = 0; v < INT_PASS; v++) sums[r][v] = dot_q8(sums[r][v], wv[v], xs);
            }
        }
    } else {
        const uint8_t *q = rec + GROUP_OUT * 4;
        #pragma GCC unroll 8
        for (int k = 0; k < QUADS / 2; k++) {
            ivec low[INT_PASS], high[INT_PASS];
            #pragma GCC unroll 8
            for (int v = 0; v < INT_PASS; v++) {
                ivec bytes = load_ivec(q + (k * GROUP_OUT + (v0 + v) * INT_LANES) * 4);
                low[v] = nibbles(bytes, 0);
                high[v] = nibbles(bytes, 1);
            }
            #pragma GCC unroll 8
            for (int r = 0; r < num_rows; r++) {
                ivec xs_low = broadcast_quad(xq[r] + 4 * k), xs_high = broadcast_quad(xq[r] + 4 * (k + QUADS / 2));
                #pragma GCC unroll 8
                for (int v = 0; v < INT_PASS; v++) {
                    sums[r][v] = dot_q4(sums[r][v], low[v], xs_low);
                    sums[r][v] = dot_q4(sums[r][v], high[v], xs_high);
                }
            }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < num_rows; r++)
            #pragma GCC unroll 8
            for (int v = 0; v < INT_PASS; v++) sums[r][v] = widen_q4(sums[r][v]);
    }
    fvec d[INT_PASS], m[INT_PASS];
    #pragma GCC unroll 8
    for (int v = 0; v < INT_PASS; v++) {
        d[v] = load_f16_int(rec + (v0 + v) * INT_LANES * 2);
        m[v] = w_dtype == DTYPE_Q4_1_INT8 ? load_f16_int(rec + GROUP_OUT * 2 + (v0 + v) * INT_LANES * 2) : (fvec){0};
    }
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++) {
        fvec dx = (fvec){0} + rows.dx[(r0 + r) * num_blocks + b];
        fvec mx = (fvec){0} + rows.mx[(r0 + r) * num_blocks + b];
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++) {
            acc[r][v] = fma_fvec(d[v] * dx, int_to_float(sums[r][v]), acc[r][v]);
            if (w_dtype == DTYPE_Q4_1_INT8) acc[r][v] = fma_fvec(m[v], mx, acc[r][v]);
        }
    }
}

/* block_int8 with the accumulators kept in memory between blocks (acc: a row block's, GROUP_OUT floats a row):
 * the narrower builds, whose registers do not hold a whole group's. */
static inline __attribute__((always_inline)) void tile_int8(int num_rows, int w_dtype, const uint8_t *rec,
                                                            int8_rows rows, int64_t r0, int64_t b, int64_t in,
                                                            float (*acc)[GROUP_OUT], int v0) {
    fvec a[INT_ROW_TILE][INT_PASS];
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++)
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++) memcpy(&a[r][v], acc[r] + (v0 + v) * INT_LANES, sizeof a[r][v]);
    block_int8(num_rows, w_dtype, rec, rows, r0, b, in, a, v0);
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++)
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++) memcpy(acc[r] + (v0 + v) * INT_LANES, &a[r][v], sizeof a[r][v]);
}

/* A tile of at most INT_ROW_TILE rows where a pass is the whole group (INT_PASS == INT_VECTORS): block_int8 over
 * every block with the accumulators in registers throughout (each output's chain in the same order, so the
 * same bits as tile_int8's), then stored once into acc. At one row their trips through memory at every block
 * took about as long as waiting for the weights. */
static inline __attribute__((always_inline)) void tile_int8_blocks(int num_rows, int w_dtype, const uint8_t *w,
                                                                   int8_rows rows, int64_t r0, int64_t in,
                                                                   float (*acc)[GROUP_OUT]) {
    fvec a[INT_ROW_TILE][INT_PASS];
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++)
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++) a[r][v] = (fvec){0};
    for (int64_t b = 0; b < in / QBLOCK; b++)
        block_int8(num_rows, w_dtype, open_record(w_dtype, w, b), rows, r0, b, in, a, 0);
    #pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++)
        #pragma GCC unroll 8
        for (int v = 0; v < INT_PASS; v++) memcpy(acc[r] + v * INT_LANES, &a[r][v], sizeof a[r][v]);
}

/* Rows [row0, row_end) (at most ROW_BLOCK) of one group's records w, out0 its first output. Where a pass is
 * the whole group, tile by tile, each over every block; otherwise block by block, each record read from
 * memory once and run by every tile of rows while it is in L1. */
static inline __attribute__((always_inline)) void run_int8_unit(int w_dtype, int8_rows rows, int64_t in,
                                                                int64_t row0, int64_t row_end, const uint8_t *w,
                                                                int64_t out0, int64_t out_features,
                                                                const float *bias, int out_dtype, void *out,
                                                                int64_t out_stride) {
    float acc[ROW_BLOCK][GROUP_OUT];
    int num_rows = (int)(row_end - row0);
    if (INT_PASS == INT_VECTORS) { /* tile by tile, each over every block (later tiles read the records from L2) */
        for (int r = 0; r < num_rows; r += INT_ROW_TILE)
            switch (num_rows - r < INT_ROW_TILE ? num_rows - r : INT_ROW_TILE) {
#if INT_ROW_TILE >= 6
                case 6: tile_int8_blocks(6, w_dtype, w, rows, row0 + r, in, acc + r); break;
                case 5: tile_int8_blocks(5, w_dtype, w, rows, row0 + r, in, acc + r); break;
#endif
                case 4: tile_int8_blocks(4, w_dtype, w, rows, row0 + r, in, acc + r); break;
                case 3: tile_int8_blocks(3, w_dtype, w, rows, row0 + r, in, acc + r); break;
                case 2: tile_int8_blocks(2, w_dtype, w, rows, row0 + r, in, acc + r); break;
                default: tile_int8_blocks(1, w_dtype, w, rows, row0 + r, in, acc + r); break;
            }
        store_rows(num_rows, (const float (*)[GROUP_OUT])acc, row0, out0, out_features, bias, out_dtype, out,
                   out_stride);
        return;
    }
    memset(acc, 0, (size_t)num_rows * sizeof acc[0]);
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        const uint8_t *rec = open_record(w_dtype, w, b);
        for (int r = 0; r < num_rows; r += ROW_TILE)
            for (int v0 = 0; v0 < INT_VECTORS; v0 += INT_PASS)
                switch (num_rows - r < ROW_TILE ? num_rows - r : ROW_TILE) {
                    case 4: tile_int8(4, w_dtype, rec, rows, row0 + r, b, in, acc + r, v0); break;
                    case 3: tile_int8(3, w_dtype, rec, rows, row0 + r, b, in, acc + r, v0); break;
                    case 2: tile_int8(2, w_dtype, rec, rows, row0 + r, b, in, acc + r, v0); break;
                    default: tile_int8(1, w_dtype, rec, rows, row0 + r, b, in, acc + r, v0); break;
                }
    }
    store_rows(num_rows, (const float (*)[GROUP_OUT])acc, row0, out0, out_features, bias, out_dtype, out, out_stride);
}

/* specdec_linear for the integer layouts: quantizes each row's activations (in parallel by rows), then runs
 * the units (group, block of rows) in parallel. Returns specdec_linear's statuses. */
static int linear_int8(int x_dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t in, int w_dtype,
                       const uint8_t *w, int64_t out_features, const float *bias, void *out, int64_t out_stride,
                       int num_threads) {
    if (in % QBLOCK) return 3;
    int64_t num_blocks = in / QBLOCK;
    char *scratch = malloc((size_t)(num_rows * in) + (size_t)(num_rows * num_blocks) * 12);
    if (!scratch) return 1;
    int8_rows rows = {(int8_t *)scratch, (float *)(scratch + num_rows * in), NULL, NULL};
    /* in is a multiple of QBLOCK, so the float arrays after qx start 4-byte aligned */
    rows.mx = rows.dx + num_rows * num_blocks;
    rows.sx = (int32_t *)(rows.mx + num_rows * num_blocks);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; r++) quantize_row(x_dtype, x, x_stride, in, r, rows);
    int64_t num_groups = (out_features + GROUP_OUT - 1) / GROUP_OUT;
    int64_t num_row_blocks = (num_rows + ROW_BLOCK - 1) / ROW_BLOCK;
    int64_t group_bytes = num_blocks * record_bytes(w_dtype);
    #pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < num_groups; g++) {
        for (int64_t rb = 0; rb < num_row_blocks; rb++) {
            int64_t row0 = rb * ROW_BLOCK, row_end = row0 + ROW_BLOCK < num_rows ? row0 + ROW_BLOCK : num_rows;
            if (w_dtype == DTYPE_Q8_0_INT8)
                run_int8_unit(DTYPE_Q8_0_INT8, rows, in, row0, row_end, w + g * group_bytes, g * GROUP_OUT,
                              out_features, bias, x_dtype, out, out_stride);
            else
                run_int8_unit(DTYPE_Q4_1_INT8, rows, in, row0, row_end, w + g * group_bytes, g * GROUP_OUT,
                              out_features, bias, x_dtype, out, out_stride);
        }
    }
    free(scratch);
    return 0;
}

#endif
