/* Batch-invariant paged attention for the CPU (see kernels/paged_attention_cpu.py).
 *
 * Every query row (one query token of one head) is computed by the same
 * sequence of float operations whatever else shares the call: how many rows,
 * heads or sequences there are only changes which rows run side by side, never
 * the arithmetic of a row. Hence a verify step's row at position p gives
 * bitwise the output a one-row decode at p gives, in fp32, bf16 and fp16.
 *
 * Per row, over its keys 0..n-1 (n = its position + 1), two passes:
 *   s_j = sum_d (q_d * scale) k_jd          dimensions in order; 16 keys side by side
 *   m = max_j s_j;  l = sum_j e^(s_j - m)   16 lanes of every 16th key, then a fixed tree
 *   out = (sum_j e^(s_j - m) v_j) / l       keys in order; dimensions side by side
 * Every product and sum is written out (built with -ffp-contract=off, fmaf
 * where a fused multiply-add is meant), and exp is our own polynomial, so the
 * compiler's vectorisation choices cannot change a bit.
 *
 * Work items are (sequence, KV head, tile of up to ROW_TILE rows sharing that
 * KV head), run in parallel with OpenMP; each K/V vector is read once per tile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#define KEY_TILE 16
#define ROW_TILE 32
#define MAX_HEAD_DIM 256

/* KEY_TILE floats as one GCC vector: element-wise arithmetic, so no reordering of a sum. */
typedef float key_vector __attribute__((vector_size(KEY_TILE * sizeof(float))));

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

/* e^x for x <= 0 (the softmax's arguments): 2^i * p(r) with x = i*ln2 + r, |r| <= ln2/2, a degree-6 Taylor
 * polynomial (relative error < 2e-7). Plain arithmetic, so it vectorises with the same bits as the scalar code. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    const float round_magic = 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float i = (x * 1.44269504f + round_magic) - round_magic;
    float r = fmaf(i, -0.693145752f, x);
    r = fmaf(i, -1.42860677e-6f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
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
    int dtype;
    const void *query; int64_t q_stride_t, q_stride_h;   /* [T, H, D], D contiguous */
    const void *key_cache, *value_cache;                  /* [num_blocks, block_size, KVH, D] contiguous */
    const int32_t *block_tables; int64_t bt_stride;       /* [B, max_blocks] */
    const int32_t *query_start_loc, *seq_lens;            /* [B + 1], [B] */
    void *out;                                            /* [T, H, D] contiguous */
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
};

/* Keys j0 .. j0 + KEY_TILE - 1 of one KV head as floats, transposed: kt[d][i] = key j0 + i, dim d
 * (zeros past num_keys: the block table has no entry there). */
static void load_key_tile(const struct Args *a, const int32_t *table, int kv, int j0, int num_keys,
                          key_vector *kt) {
    const int D = a->head_dim;
    float row[MAX_HEAD_DIM];
    for (int i = 0; i < KEY_TILE; i++) {
        int j = j0 + i;
        if (j < num_keys) {
            int64_t slot = (int64_t)table[j / a->block_size] * a->block_size + j % a->block_size;
            load_row(a->dtype, a->key_cache, (slot * a->num_kv_heads + kv) * D, D, row);
        } else {
            memset(row, 0, sizeof(float) * D);
        }
        for (int d = 0; d < D; d++) kt[d][i] = row[d];
    }
}

/* Rows `first_row .. first_row + num_rows - 1` of (sequence b, KV head kv): row r is query token
 * q_start + r / group of head kv * group + r % group. scores: ROW_TILE * (seq_lens[b] rounded up to KEY_TILE). */
static void attend_tile(const struct Args *a, int b, int kv, int first_row, int num_rows, float *scores) {
    const int D = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start_loc[b], q_len = a->query_start_loc[b + 1] - q_start;
    const int ctx_start = a->seq_lens[b] - q_len;  /* position of the sequence's first query token */
    const int64_t stride = ((int64_t)a->seq_lens[b] + KEY_TILE - 1) / KEY_TILE * KEY_TILE;  /* of a scores row */
    float q[ROW_TILE][MAX_HEAD_DIM], acc[ROW_TILE][MAX_HEAD_DIM], v[MAX_HEAD_DIM];
    key_vector kt[MAX_HEAD_DIM];
    int num_keys[ROW_TILE], token[ROW_TILE], head[ROW_TILE], max_keys = 0;
    for (int r = 0; r < num_rows; r++) {
        int row = first_row + r;
        token[r] = q_start + row / group;
        head[r] = kv * group + row % group;
        num_keys[r] = ctx_start + row / group + 1;
        if (num_keys[r] > max_keys) max_keys = num_keys[r];
        load_row(a->dtype, a->query, token[r] * a->q_stride_t + head[r] * a->q_stride_h, D, q[r]);
        for (int d = 0; d < D; d++) q[r][d] = q[r][d] * a->scale;
        memset(acc[r], 0, sizeof(float) * D);
    }
    const int32_t *table = a->block_tables + (int64_t)b * a->bt_stride;
    /* Pass 1: s_j = sum over d in order of q[d] * k_j[d] (q scaled), KEY_TILE keys side by side. */
    for (int j0 = 0; j0 < max_keys; j0 += KEY_TILE) {
        load_key_tile(a, table, kv, j0, max_keys, kt);
        for (int r = 0; r < num_rows; r++) {
            if (j0 >= num_keys[r]) continue;
            key_vector s = {0};
            for (int d = 0; d < D; d++) s = s + q[r][d] * kt[d];
            memcpy(scores + r * stride + j0, &s, sizeof s);
        }
    }
    /* Softmax weights in place; the denominator sums lane i = keys i, i + KEY_TILE, ..., then a fixed tree. */
    float denom[ROW_TILE];
    for (int r = 0; r < num_rows; r++) {
        float *s = scores + r * stride, m = -INFINITY, lanes[KEY_TILE] = {0};
        const int n = num_keys[r];
        for (int j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        for (int j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - m);
        for (int j = n; j < (n + KEY_TILE - 1) / KEY_TILE * KEY_TILE; j++) s[j] = 0.0f;
        for (int j0 = 0; j0 < n; j0 += KEY_TILE)
            for (int i = 0; i < KEY_TILE; i++) lanes[i] = lanes[i] + s[j0 + i];
        for (int width = KEY_TILE / 2; width > 0; width /= 2)
            for (int i = 0; i < width; i++) lanes[i] = lanes[i] + lanes[i + width];
        denom[r] = lanes[0];
    }
    /* Pass 2: acc[d] = sum over keys in order of p_j * v_j[d]. */
    for (int j = 0; j < max_keys; j++) {
        int64_t slot = (int64_t)table[j / a->block_size] * a->block_size + j % a->block_size;
        load_row(a->dtype, a->value_cache, (slot * a->num_kv_heads + kv) * D, D, v);
        for (int r = 0; r < num_rows; r++) {
            if (j >= num_keys[r]) continue;
            float p = scores[r * stride + j];
            for (int d = 0; d < D; d++) acc[r][d] = fmaf(p, v[d], acc[r][d]);
        }
    }
    for (int r = 0; r < num_rows; r++) {
        for (int d = 0; d < D; d++) acc[r][d] = acc[r][d] / denom[r];
        store_row(a->dtype, a->out, ((int64_t)token[r] * a->num_heads + head[r]) * D, D, acc[r]);
    }
}

/* Returns 0, or -1 for a head_dim above MAX_HEAD_DIM (the caller checks first). */
int specdec_paged_attention(int dtype, const void *query, int64_t q_stride_t, int64_t q_stride_h,
                            const void *key_cache, const void *value_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads) {
    if (head_dim > MAX_HEAD_DIM) return -1;
    struct Args a = {dtype, query, q_stride_t, q_stride_h, key_cache, value_cache, block_tables, bt_stride,
                     query_start_loc, seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale};
    const int group = num_heads / num_kv_heads;
    /* Work items: (sequence, KV head, row tile); tile_start[b] numbers sequence b's first item. */
    int *tile_start = malloc(sizeof(int) * (num_seqs + 1));
    int max_len = 1;
    tile_start[0] = 0;
    for (int b = 0; b < num_seqs; b++) {
        int rows = (query_start_loc[b + 1] - query_start_loc[b]) * group;
        tile_start[b + 1] = tile_start[b] + num_kv_heads * ((rows + ROW_TILE - 1) / ROW_TILE);
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    const int num_items = tile_start[num_seqs];
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)ROW_TILE * (max_len + KEY_TILE));
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_items; item++) {
            int b = find_sequence(tile_start, num_seqs, item);
            int rows = (query_start_loc[b + 1] - query_start_loc[b]) * group;
            int tiles_per_head = (rows + ROW_TILE - 1) / ROW_TILE;
            int local = item - tile_start[b], kv = local / tiles_per_head, tile = local % tiles_per_head;
            int first = tile * ROW_TILE, n = rows - first < ROW_TILE ? rows - first : ROW_TILE;
            attend_tile(&a, b, kv, first, n, scores);
        }
        free(scores);
    }
    free(tile_start);
    return 0;
}
