/* Batch-invariant paged attention for the CPU (see kernels/paged_attention_cpu.py).
 *
 * Every query row (one query token of one head) is computed by the same
 * sequence of float operations whatever else shares the call: how many rows,
 * heads or sequences there are only changes which rows run side by side, never
 * the arithmetic of a row. Hence a verify step's row at position p gives
 * bitwise the output a one-row decode at p gives, in fp32, bf16 and fp16.
 *
 * A row's keys 0..n-1 (n = its position + 1) are split at fixed positions
 * into parts of PART_KEYS keys (the split depends on n alone). Per part p,
 * over its keys j, two passes:
 *   s_j = sum_d (q_d * scale) k_jd             fmaf over dimensions in order; 16 keys side by side
 *   m_p = max_j s_j;  l_p = sum_j e^(s_j - m_p)  16 lanes of every 16th key, then a fixed tree
 *   acc_p = sum_j e^(s_j - m_p) v_j             keys in order; dimensions side by side
 * then, parts in order: M = max m_p, w_p = e^(m_p - M),
 *   out = (sum_p w_p acc_p) / (sum_p w_p l_p)  (one part: w_0 = 1, out = acc_0 / l_0)
 * Every product and sum is written out (built with -ffp-contract=off, fmaf
 * where a fused multiply-add is meant), and exp is our own polynomial, so the
 * compiler's vectorisation choices cannot change a bit; nor do the AVX-512
 * paths (keys transposed in registers, values loaded whole, a vector FMA per
 * 16 lanes), which a narrower build's plain loops match bit for bit. A cache
 * whose K blocks are kept transposed (keys_transposed: [num_blocks, KVH, D,
 * block_size], the CPU KVCache's layout) hands over 16 keys' dimension d as
 * one vector, with no transpose at all: the same values, so the same bits. Speed
 * comes from independence, not reordering: pass 1 advances the sums of up to
 * SCORE_ROWS rows times two key tiles side by side, and pass 2 keeps
 * SCORE_ROWS rows' accumulators of VALUE_SLICE dimensions in registers over
 * the keys.
 *
 * Work items are (sequence, KV head, tile of up to ROW_TILE rows sharing that
 * KV head, part), run in parallel with OpenMP, then the tiles' parts are
 * combined; each K/V vector is read once per tile. The parts give a decode
 * step (3 KV heads, one row tile each for SmolLM2) work for every thread.
 *
 * The caches may be in another dtype than the query (cache_dtype: bf16 under fp32 queries, --kv-cache-dtype):
 * keys and values are widened to fp32 exactly as they are read, so a row computes what the fp32 kernel computes
 * over the cached values, bit for bit.
 *
 * Draft trees (kernels/draft_tree.py): a tree row's keys are its sequence's
 * prefix then the positions of its path from the root, read in that order as
 * keys 0..n-1 (n = the prefix + its depth + 1), so the row computes what a
 * decode at its position over those keys computes, bit for bit. A tree sequence's tiles hold the rows
 * (heads) of one query token, which share their keys.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "exp_poly.h"
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors between inline functions, never across the ABI */
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define KEY_TILE 16
#define ROW_TILE 32
#define MAX_HEAD_DIM 256
/* The hot loops' registers: a KEY_TILE vector is one AVX-512 register, or HALVES registers of REG_LANES floats
 * (AVX2 and narrower: GCC moves a 64-byte vector through the stack in 16-byte pieces there, ~10x slower), and
 * fewer rows side by side where there are 16 registers, not 32. Which sums advance side by side, never a sum. */
#if defined(__AVX512F__)
#define REG_LANES 16
#define SCORE_ROWS 4   /* query rows whose sums advance side by side (passes 1 and 2) */
#define VALUE_SLICE 64 /* dimensions of a row's output held in registers at once (pass 2) */
#else
#define REG_LANES 8
#define SCORE_ROWS 2
#define VALUE_SLICE 32
#endif
#define HALVES (KEY_TILE / REG_LANES)
#define PART_KEYS 128  /* keys of one work item (a multiple of KEY_TILE): a row's keys split at fixed positions */

/* KEY_TILE floats as one GCC vector: element-wise arithmetic, so no reordering of a sum. */
typedef float key_vector __attribute__((vector_size(KEY_TILE * sizeof(float))));
typedef int32_t key_mask __attribute__((vector_size(KEY_TILE * sizeof(int32_t)))); /* a compare's lanes: 0 or -1 */
/* REG_LANES floats: one register. */
typedef float reg_vector __attribute__((vector_size(REG_LANES * sizeof(float))));

/* n elements of dtype at src (element offset) into floats. */
static inline void load_row(int dtype, const void *src, int64_t offset, int n, float *dst) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        const _Float16 *p = (const _Float16 *)src + offset;
        for (int i = 0; i < n; i++) dst[i] = (float)p[i];
    }
}

static inline void store_row(int dtype, void *dst, int64_t offset, int n, const float *src) {
    if (dtype == DTYPE_F32) {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        uint16_t *p = (uint16_t *)dst + offset;
        for (int i = 0; i < n; i++) p[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *p = (_Float16 *)dst + offset;
        for (int i = 0; i < n; i++) p[i] = (_Float16)src[i];
    }
}

/* Sequence of packed token t: query_start_loc[b] <= t < query_start_loc[b + 1]. */
static int find_sequence(const int32_t *query_start_loc, int num_seqs, int token) {
    int lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid;
    }
    return lo;
}

struct Args {
    int dtype;                                            /* the query's and the output's */
    int cache_dtype;                                      /* the caches': dtype's, or bf16 under fp32 queries */
    const void *query; int64_t q_stride_t, q_stride_h;   /* [T, H, D], D contiguous */
    const void *key_cache, *value_cache;                  /* [num_blocks, block_size, KVH, D] contiguous */
    const int32_t *block_tables; int64_t bt_stride;       /* [B, max_blocks] */
    const int32_t *query_start_loc, *seq_lens;            /* [B + 1], [B] */
    void *out;                                            /* [T, H, D] contiguous */
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    const int32_t *is_tree, *prefix_lens, *depths, *paths; int64_t path_stride; /* [B], [B], [T], [T, P]; */
                                                          /* all NULL without trees */
    int keys_transposed; /* key_cache [num_blocks, KVH, D, block_size]: a key's dimension d block_size apart */
};

/* Where a row's keys are: its sequence's block table, and for a tree row its path (positions, root first),
 * which holds its keys from prefix_len on. */
struct Keys {
    const int32_t *table;
    int prefix_len;
    const int32_t *path; /* NULL: key j is at position j */
};

/* The cache slot (block * block_size + offset) of a row's key j. */
static inline int64_t key_slot(const struct Args *a, const struct Keys *keys, int j) {
    int position = keys->path && j >= keys->prefix_len ? keys->path[j - keys->prefix_len] : j;
    return (int64_t)keys->table[position / a->block_size] * a->block_size + position % a->block_size;
}

static inline int is_tree(const struct Args *a, int b) { return a->is_tree && a->is_tree[b]; }

/* Where the key at a cache slot starts for KV head kv (its dimension d key_stride(a) elements further). */
static inline int64_t key_offset(const struct Args *a, int64_t slot, int kv) {
    if (!a->keys_transposed) return (slot * a->num_kv_heads + kv) * a->head_dim;
    int64_t block = slot / a->block_size, offset = slot % a->block_size;
    return (block * a->num_kv_heads + kv) * a->head_dim * a->block_size + offset;
}

static inline int64_t key_stride(const struct Args *a) { return a->keys_transposed ? a->block_size : 1; }

/* Row tiles of sequence b per KV head: up to ROW_TILE rows each; a tree sequence's never span two tokens. */
static int tiles_per_head(const struct Args *a, int b) {
    int group = a->num_heads / a->num_kv_heads, q_len = a->query_start_loc[b + 1] - a->query_start_loc[b];
    if (is_tree(a, b)) return q_len * ((group + ROW_TILE - 1) / ROW_TILE);
    return (q_len * group + ROW_TILE - 1) / ROW_TILE;
}

/* Tile `local` of sequence b (numbered KV head by KV head): its KV head, first row and number of rows. */
static void tile_rows(const struct Args *a, int b, int local, int *kv, int *first, int *num_rows) {
    int group = a->num_heads / a->num_kv_heads, q_len = a->query_start_loc[b + 1] - a->query_start_loc[b];
    int per_head = tiles_per_head(a, b), index = local % per_head, end;
    *kv = local / per_head;
    if (is_tree(a, b)) {
        int per_token = (group + ROW_TILE - 1) / ROW_TILE, token = index / per_token;
        *first = token * group + index % per_token * ROW_TILE;
        end = (token + 1) * group;
    } else {
        *first = index * ROW_TILE;
        end = q_len * group;
    }
    *num_rows = end - *first < ROW_TILE ? end - *first : ROW_TILE;
}

#if defined(__AVX512F__)
/* r[i] = row i of a 16 x 16 block of floats; afterwards r[d] = column d (lane i: row i). Unpacks pair rows
 * within 128-bit lanes, then the lanes of four rows at a time trade places (64 shuffles, no memory). */
static inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + k], lane L: rows 4i .. 4i + 3 of column 4L + k */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int k = 0; k < 4; k++) { /* column 4L + k, lane M: r[4M + k]'s lane L */
        __m512 v0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), v1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        __m512 v3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
        t[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        t[8 + k] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        t[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

/* Keys j0 .. j0 + KEY_TILE - 1 of one KV head as floats, transposed: key j0 + i's dimension d is element i of
 * the KEY_TILE floats at the returned pointer + d * *stride (zeros past num_keys: the block table has no entry
 * there). An fp32 cache whose K blocks are transposed holds such a tile already, and the pointer is into it;
 * otherwise the tile is built in kt (stride KEY_TILE). Moves values only: no arithmetic. */
static const float *load_key_tile(const struct Args *a, const struct Keys *where, int kv, int j0, int num_keys,
                                  key_vector *kt, int64_t *stride) {
    const int D = a->head_dim;
    *stride = KEY_TILE;
    if (a->keys_transposed && a->block_size % KEY_TILE == 0 && j0 + KEY_TILE <= num_keys
        && (!where->path || j0 + KEY_TILE <= where->prefix_len)) {
        /* Keys j0 .. j0 + 15 are consecutive positions of one block (j0 is a multiple of KEY_TILE), so their
         * dimension d lies in 16 consecutive elements: no transpose, and in fp32 no copy either. */
        int64_t base = key_offset(a, key_slot(a, where, j0), kv);
        if (a->cache_dtype == DTYPE_F32) {
            *stride = a->block_size;
            return (const float *)a->key_cache + base;
        }
        for (int d = 0; d < D; d++)
            load_row(a->cache_dtype, a->key_cache, base + d * a->block_size, KEY_TILE, (float *)&kt[d]);
        return (const float *)kt;
    }
#if defined(__AVX512F__)
    if (!a->keys_transposed && j0 + KEY_TILE <= num_keys && D % 16 == 0 && a->cache_dtype != DTYPE_F16) {
        const char *keys[KEY_TILE];
        int element = a->cache_dtype == DTYPE_F32 ? 4 : 2;
        for (int i = 0; i < KEY_TILE; i++) {
            int64_t slot = key_slot(a, where, j0 + i);
            keys[i] = (const char *)a->key_cache + (slot * a->num_kv_heads + kv) * D * element;
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < KEY_TILE; i++)
                r[i] = a->cache_dtype == DTYPE_F32
                    ? _mm512_loadu_ps(keys[i] + d0 * 4)
                    : _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(keys[i] + d0 * 2))), 16));
            transpose_16x16(r);
            for (int d = 0; d < 16; d++) memcpy(&kt[d0 + d], &r[d], sizeof r[d]);
        }
        return (const float *)kt;
    }
#endif
    const int64_t step = key_stride(a);
    for (int i = 0; i < KEY_TILE; i++) {
        int j = j0 + i;
        if (j >= num_keys) {
            for (int d = 0; d < D; d++) kt[d][i] = 0.0f;
            continue;
        }
        int64_t offset = key_offset(a, key_slot(a, where, j), kv);
        for (int d = 0; d < D; d++) kt[d][i] = load_scalar(a->cache_dtype, a->key_cache, offset + d * step);
    }
    return (const float *)kt;
}

/* REG_LANES floats at p (any alignment) in one load. */
static inline reg_vector load_vector(const float *p) {
#if defined(__AVX512F__)
    return (reg_vector)_mm512_loadu_ps(p);
#elif defined(__FMA__) /* AVX2 builds: the header is included with FMA (an AVX-only build takes memcpy) */
    return (reg_vector)_mm256_loadu_ps(p);
#else
    reg_vector v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

/* x in every lane. */
static inline reg_vector broadcast_float(float x) {
#if defined(__AVX512F__)
    return (reg_vector)_mm512_set1_ps(x);
#elif defined(__FMA__)
    return (reg_vector)_mm256_set1_ps(x);
#else
    reg_vector v;
    for (int i = 0; i < REG_LANES; i++) v[i] = x;
    return v;
#endif
}

/* a * b + c, rounded once, lane by lane: fmaf's result. */
static inline reg_vector fma_vector(reg_vector a, reg_vector b, reg_vector c) {
#if defined(__AVX512F__)
    return (reg_vector)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (reg_vector)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int i = 0; i < REG_LANES; i++) c[i] = fmaf(a[i], b[i], c[i]);
    return c;
#endif
}

/* Rows q[0..num_rows) (num_rows <= SCORE_ROWS, a constant where inlined) against the two key tiles kt (keys
 * j0 ..): each score a chain of fused multiply-adds over d in order, as in pass 1; stored for the tiles a row
 * has keys in. */
static inline __attribute__((always_inline)) void score_rows(int num_rows, int D, const float (*q)[MAX_HEAD_DIM],
                                                             const float *const kt[2], const int64_t stride[2],
                                                             const int *end, int j0, int k0, float *scores) {
    reg_vector s[SCORE_ROWS][2 * HALVES]; /* [r][t * HALVES + h]: keys j0 + t * KEY_TILE + h * REG_LANES .. */
    for (int r = 0; r < num_rows; r++)
        for (int u = 0; u < 2 * HALVES; u++) s[r][u] = (reg_vector){0};
    for (int d = 0; d < D; d++) {
        reg_vector k[2 * HALVES];
        for (int t = 0; t < 2; t++)
            for (int h = 0; h < HALVES; h++) memcpy(&k[t * HALVES + h], kt[t] + d * stride[t] + h * REG_LANES,
                                                    sizeof k[0]);
        for (int r = 0; r < num_rows; r++)
            for (int u = 0; u < 2 * HALVES; u++) s[r][u] = fma_vector(broadcast_float(q[r][d]), k[u], s[r][u]);
    }
    for (int r = 0; r < num_rows; r++)
        for (int t = 0; t < 2; t++)
            if (j0 + t * KEY_TILE < end[r] && j0 + t * KEY_TILE < k0 + PART_KEYS)
                memcpy(scores + r * PART_KEYS + (j0 + t * KEY_TILE - k0), &s[r][t * HALVES], sizeof(key_vector));
}

/* Value row j (fp32 in place, other dtypes from `values`: keys k0 .., D floats each). */
static const float *value_row(const struct Args *a, const struct Keys *keys, int kv, int k0, int j,
                              const float *values) {
    if (a->cache_dtype != DTYPE_F32) return values + (int64_t)(j - k0) * a->head_dim;
    return (const float *)a->value_cache + (key_slot(a, keys, j) * a->num_kv_heads + kv) * a->head_dim;
}

/* Pass 2 for rows r < num_rows (a constant where inlined) and dimensions d0 .. d0 + VALUE_SLICE - 1:
 * acc[d] = fmaf(p_j, v_j[d], acc[d]) over the row's keys in order, from 0, the accumulators in registers
 * (first the keys every row has, without a branch, then each row's last ones). rows[j - k0]: value row j
 * (value_row's, found once per part). */
static inline __attribute__((always_inline)) void accumulate_values(const struct Args *a, int num_rows,
                                                                    int k0, int d0, const float *const *rows,
                                                                    const float *scores, const int *end,
                                                                    float *partial) {
    enum { SLICE_VECTORS = VALUE_SLICE / REG_LANES };
    reg_vector acc[SCORE_ROWS][SLICE_VECTORS];
    int all_end = k0 + PART_KEYS, row_end = k0; /* keys k0 .. all_end - 1 every row has; some, up to row_end */
    for (int r = 0; r < num_rows; r++) {
        for (int c = 0; c < SLICE_VECTORS; c++) acc[r][c] = (reg_vector){0};
        if (end[r] > row_end) row_end = end[r];
        if (end[r] < all_end) all_end = end[r];
    }
    for (int j = k0; j < all_end; j++) {
        const float *v = rows[j - k0] + d0;
        reg_vector vv[SLICE_VECTORS];
        for (int c = 0; c < SLICE_VECTORS; c++) vv[c] = load_vector(v + c * REG_LANES);
        for (int r = 0; r < num_rows; r++) {
            reg_vector p = broadcast_float(scores[r * PART_KEYS + (j - k0)]);
            for (int c = 0; c < SLICE_VECTORS; c++) acc[r][c] = fma_vector(p, vv[c], acc[r][c]);
        }
    }
    for (int j = all_end > k0 ? all_end : k0; j < row_end; j++) {
        const float *v = rows[j - k0] + d0;
        reg_vector vv[SLICE_VECTORS];
        for (int c = 0; c < SLICE_VECTORS; c++) vv[c] = load_vector(v + c * REG_LANES);
        for (int r = 0; r < num_rows; r++) {
            if (j >= end[r]) continue;
            reg_vector p = broadcast_float(scores[r * PART_KEYS + (j - k0)]);
            for (int c = 0; c < SLICE_VECTORS; c++) acc[r][c] = fma_vector(p, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < num_rows; r++) memcpy(partial + r * (a->head_dim + 2) + 2 + d0, acc[r], sizeof acc[r]);
}

/* Rows `first_row .. first_row + num_rows - 1` of (sequence b, KV head kv) over keys part * PART_KEYS ..
 * (part + 1) * PART_KEYS - 1 (those each row has): row r is query token q_start + r / group of head
 * kv * group + r % group (a tree sequence's tiles: one token). Writes each row's partial result to
 * partial + r * (D + 2): m (its scores' max), l (sum of e^(s_j - m)) and acc[D] (sum of e^(s_j - m) v_j);
 * a row with no key here gets m = -inf, l = 0. scores: ROW_TILE * PART_KEYS floats. */
static void attend_part(const struct Args *a, int b, int kv, int first_row, int num_rows, int part,
                        float *scores, float *values, float *partial) {
    const int D = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start_loc[b], q_len = a->query_start_loc[b + 1] - q_start;
    const int ctx_start = a->seq_lens[b] - q_len;  /* position of the sequence's first query token */
    const int k0 = part * PART_KEYS;
    float q[ROW_TILE][MAX_HEAD_DIM];
    key_vector kt[2][MAX_HEAD_DIM];
    int end[ROW_TILE], max_end = k0;  /* row r's keys here: k0 .. end[r] - 1 */
    struct Keys keys = {a->block_tables + (int64_t)b * a->bt_stride, ctx_start, NULL};
    if (is_tree(a, b)) {
        keys.path = a->paths + (int64_t)(q_start + first_row / group) * a->path_stride;
        keys.prefix_len = a->prefix_lens[b];
    }
    for (int r = 0; r < num_rows; r++) {
        int row = first_row + r, token = q_start + row / group;
        int num_keys = keys.prefix_len + (keys.path ? a->depths[token] : row / group) + 1;
        end[r] = num_keys < k0 + PART_KEYS ? num_keys : k0 + PART_KEYS;
        if (end[r] > max_end) max_end = end[r];
        load_row(a->dtype, a->query, (q_start + row / group) * a->q_stride_t + (kv * group + row % group) * a->q_stride_h,
                 D, q[r]);
        for (int d = 0; d < D; d++) q[r][d] = q[r][d] * a->scale;
    }
    /* Pass 1: s_j = sum over d in order of q[d] * k_j[d] (q scaled), KEY_TILE keys side by side; two tiles
     * of keys and up to SCORE_ROWS rows at a time, so that many sums advance side by side. */
    for (int j0 = k0; j0 < max_end; j0 += 2 * KEY_TILE) {
        int64_t stride[2];
        const float *const tiles[2] = {load_key_tile(a, &keys, kv, j0, max_end, kt[0], &stride[0]),
                                       load_key_tile(a, &keys, kv, j0 + KEY_TILE, max_end, kt[1], &stride[1])};
        for (int r = 0; r < num_rows; r += SCORE_ROWS) {
            switch (num_rows - r < SCORE_ROWS ? num_rows - r : SCORE_ROWS) {
#if SCORE_ROWS > 2
                case 4: score_rows(4, D, q + r, tiles, stride, end + r, j0, k0, scores + r * PART_KEYS); break;
                case 3: score_rows(3, D, q + r, tiles, stride, end + r, j0, k0, scores + r * PART_KEYS); break;
#endif
                case 2: score_rows(2, D, q + r, tiles, stride, end + r, j0, k0, scores + r * PART_KEYS); break;
                default: score_rows(1, D, q + r, tiles, stride, end + r, j0, k0, scores + r * PART_KEYS); break;
            }
        }
    }
    /* Softmax weights in place; l sums lane i = keys k0 + i, k0 + i + KEY_TILE, ..., then a fixed tree. */
    for (int r = 0; r < num_rows; r++) {
        float *s = scores + r * PART_KEYS, *out = partial + r * (D + 2), m = -INFINITY, lanes[KEY_TILE] = {0};
        const int n = end[r] - k0;
        out[0] = -INFINITY;
        out[1] = 0.0f;
        if (n <= 0 || D % VALUE_SLICE) /* pass 2 stores a row's acc whole, except element by element */
            memset(out + 2, 0, sizeof(float) * D);
        if (n <= 0) continue;
        /* The max as 16 running maxima, then across them (no chain of dependent compares): a max is the same
         * number in any order (at most the sign of a zero differs, which no e^(s - m) below can tell). */
        key_vector lane_max = (key_vector){0} - INFINITY;
        int whole = n / KEY_TILE * KEY_TILE; /* lane i: keys i, i + 16, ..., a tile's 16 at once */
        for (int j0 = 0; j0 < whole; j0 += KEY_TILE) {
            key_vector tile;
            memcpy(&tile, s + j0, sizeof tile);
            key_mask greater = tile > lane_max; /* false for a NaN score, as the tail's compare below */
            lane_max = (key_vector)(((key_mask)tile & greater) | ((key_mask)lane_max & ~greater));
        }
        for (int j = whole; j < n; j++)
            lane_max[j % KEY_TILE] = s[j] > lane_max[j % KEY_TILE] ? s[j] : lane_max[j % KEY_TILE];
        for (int i = 0; i < KEY_TILE; i++) m = lane_max[i] > m ? lane_max[i] : m;
        for (int j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - m);
        for (int j = n; j < (n + KEY_TILE - 1) / KEY_TILE * KEY_TILE; j++) s[j] = 0.0f;
        for (int j0 = 0; j0 < n; j0 += KEY_TILE)
            for (int i = 0; i < KEY_TILE; i++) lanes[i] = lanes[i] + s[j0 + i];
        for (int width = KEY_TILE / 2; width > 0; width /= 2)
            for (int i = 0; i < width; i++) lanes[i] = lanes[i] + lanes[i + width];
        out[0] = m;
        out[1] = lanes[0];
    }
    /* Pass 2: acc[d] = sum over the keys in order of p_j * v_j[d]. */
    if (a->cache_dtype != DTYPE_F32) { /* the values as fp32, once for all rows */
        for (int j = k0; j < max_end; j++)
            load_row(a->cache_dtype, a->value_cache, (key_slot(a, &keys, j) * a->num_kv_heads + kv) * D, D,
                     values + (j - k0) * D);
    }
    const float *rows[PART_KEYS];
    for (int j = k0; j < max_end; j++) rows[j - k0] = value_row(a, &keys, kv, k0, j, values);
    if (D % VALUE_SLICE) { /* element by element: the same sums */
        for (int j = k0; j < max_end; j++) {
            const float *v = rows[j - k0];
            for (int r = 0; r < num_rows; r++) {
                if (j >= end[r]) continue;
                float p = scores[r * PART_KEYS + (j - k0)], *acc = partial + r * (D + 2) + 2;
                for (int d = 0; d < D; d++) acc[d] = fmaf(p, v[d], acc[d]);
            }
        }
        return;
    }
    for (int d0 = 0; d0 < D; d0 += VALUE_SLICE)
        for (int r = 0; r < num_rows; r += SCORE_ROWS) {
            const float *s = scores + r * PART_KEYS;
            float *out = partial + r * (D + 2);
            switch (num_rows - r < SCORE_ROWS ? num_rows - r : SCORE_ROWS) {
#if SCORE_ROWS > 2
                case 4: accumulate_values(a, 4, k0, d0, rows, s, end + r, out); break;
                case 3: accumulate_values(a, 3, k0, d0, rows, s, end + r, out); break;
#endif
                case 2: accumulate_values(a, 2, k0, d0, rows, s, end + r, out); break;
                default: accumulate_values(a, 1, k0, d0, rows, s, end + r, out); break;
            }
        }
}

/* Row r's output from its num_parts partial results (attend_part's, PARTIAL_STRIDE(D) floats apart), in part
 * order: M = max m_p, w_p = e^(m_p - M), out = (sum_p w_p acc_p) / (sum_p w_p l_p). With one part w_0 = 1
 * exactly, so the output is acc / l. */
static void combine_row(const struct Args *a, const float *partial, int64_t part_stride, int num_parts,
                        int64_t out_offset) {
    const int D = a->head_dim;
    float acc[MAX_HEAD_DIM] = {0}, l = 0.0f, m = -INFINITY;
    for (int p = 0; p < num_parts; p++) m = partial[p * part_stride] > m ? partial[p * part_stride] : m;
    for (int p = 0; p < num_parts; p++) {
        const float *part = partial + p * part_stride;
        float w = exp_nonpositive(part[0] - m);  /* 0 for a part without keys (m_p = -inf) */
        l = fmaf(w, part[1], l);
        for (int d = 0; d < D; d++) acc[d] = fmaf(w, part[2 + d], acc[d]);
    }
    for (int d = 0; d < D; d++) acc[d] = acc[d] / l;
    store_row(a->dtype, a->out, out_offset, D, acc);
}

/* Present in builds that take draft trees, the key layout and a cache dtype of its own (the arguments below): a
 * binding can tell an older build. */
int specdec_paged_attention_takes_cache_dtype(void) { return 1; }

/* Returns 0, -1 for a head_dim above MAX_HEAD_DIM (the caller checks first), -2 when scratch memory cannot
 * be had. */
int specdec_paged_attention(int dtype, int cache_dtype, const void *query, int64_t q_stride_t, int64_t q_stride_h,
                            const void *key_cache, const void *value_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            const int32_t *is_tree, const int32_t *prefix_lens, const int32_t *depths,
                            const int32_t *paths, int64_t path_stride, int keys_transposed, int num_threads) {
    if (head_dim > MAX_HEAD_DIM) return -1;
    struct Args a = {dtype, cache_dtype, query, q_stride_t, q_stride_h, key_cache, value_cache, block_tables, bt_stride,
                     query_start_loc, seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                     is_tree, prefix_lens, depths, paths, path_stride, keys_transposed};
    const int group = num_heads / num_kv_heads, D = head_dim;
    /* Tiles: (sequence, KV head, tile of up to ROW_TILE rows); tile_start[b] numbers sequence b's first.
     * Work items: (tile, part of PART_KEYS keys); part_start[b] numbers sequence b's first. The parts of a
     * row are fixed by its own number of keys, so splitting them never changes with the batch. */
    int *tile_start = malloc(sizeof(int) * (num_seqs + 1)), *part_start = malloc(sizeof(int) * (num_seqs + 1));
    tile_start[0] = part_start[0] = 0;
    int max_parts = 1;
    for (int b = 0; b < num_seqs; b++) {
        int parts = (seq_lens[b] + PART_KEYS - 1) / PART_KEYS;
        if (parts > max_parts) max_parts = parts;
        tile_start[b + 1] = tile_start[b] + num_kv_heads * tiles_per_head(&a, b);
        part_start[b + 1] = part_start[b] + (tile_start[b + 1] - tile_start[b]) * parts;
    }
    const int num_tiles = tile_start[num_seqs], num_items = part_start[num_seqs];
    const int64_t row_stride = D + 2, part_stride = ROW_TILE * row_stride;  /* of `partials` */
    float *partials = malloc(sizeof(float) * (size_t)num_items * part_stride);
    if (!partials) {
        free(tile_start);
        free(part_start);
        return -2;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)ROW_TILE * PART_KEYS);
        float *values = cache_dtype == DTYPE_F32 ? NULL : malloc(sizeof(float) * (size_t)PART_KEYS * head_dim);
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_items; item++) {
            int b = find_sequence(part_start, num_seqs, item);
            int parts = (seq_lens[b] + PART_KEYS - 1) / PART_KEYS, local = item - part_start[b], kv, first, n;
            tile_rows(&a, b, local / parts, &kv, &first, &n);
            attend_part(&a, b, kv, first, n, local % parts, scores, values, partials + (int64_t)item * part_stride);
        }
        free(scores);
        free(values);
        #pragma omp for schedule(static)
        for (int tile = 0; tile < num_tiles; tile++) {
            int b = find_sequence(tile_start, num_seqs, tile);
            int parts = (seq_lens[b] + PART_KEYS - 1) / PART_KEYS, local = tile - tile_start[b], kv, first, n;
            tile_rows(&a, b, local, &kv, &first, &n);
            const float *tile_partials = partials + ((int64_t)part_start[b] + (int64_t)local * parts) * part_stride;
            for (int r = 0; r < n; r++) {
                int row = first + r;
                int64_t out_offset = ((int64_t)(query_start_loc[b] + row / group) * num_heads
                                      + kv * group + row % group) * D;
                combine_row(&a, tile_partials + r * row_stride, part_stride, parts, out_offset);
            }
        }
    }
    free(partials);
    free(part_start);
    free(tile_start);
    return 0;
}
