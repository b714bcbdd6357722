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
#include <string.h>

#include "dtypes.h"
#include "exp_poly.h"

#define MIN_ELEMENTS_PER_THREAD 16384 /* below this, one thread: a fork costs more than the work */

#define SUM_LANES 16 /* a row's sum of squares: lane l adds elements l, l + 16, ..., then a fixed tree */

/* SUM_LANES floats as one GCC vector: element-wise arithmetic, so the compiler cannot reorder a sum. */
typedef float lane_vector __attribute__((vector_size(SUM_LANES * sizeof(float))));

/* 1 / sqrt(mean + eps) of a row's squares summed in SUM_LANES lanes: the lanes joined by a fixed tree, the
 * one order of every build and dtype. */
static inline float inv_rms_of(float lanes[SUM_LANES], int64_t dim, float eps) {
    for (int width = SUM_LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return 1.0f / sqrtf(lanes[0] / (float)dim + eps);
}

/* The fp32 row of specdec_add_rms_norm, vectorised by hand (the generic loop's load_scalar and the residual's
 * possible aliasing keep the compiler scalar): the same operations in the same order, so the same bits. */
static void add_rms_norm_f32(const float *restrict x, float *restrict residual, const float *restrict weight,
                             float *restrict out, int64_t dim, float eps) {
    lane_vector lanes = {0};
    int64_t whole = dim / SUM_LANES * SUM_LANES;
    for (int64_t i = 0; i < whole; i += SUM_LANES) {
        lane_vector h, add;
        memcpy(&h, residual + i, sizeof h);
        if (x) {
            memcpy(&add, x + i, sizeof add);
            h = h + add;
            memcpy(residual + i, &h, sizeof h);
        }
        lanes = lanes + h * h;
    }
    for (int64_t i = whole; i < dim; i++) {
        float h = residual[i];
        if (x) residual[i] = h = h + x[i];
        lanes[i - whole] = lanes[i - whole] + h * h;
    }
    float sums[SUM_LANES];
    memcpy(sums, &lanes, sizeof sums);
    float inv_rms = inv_rms_of(sums, dim, eps);
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (residual[i] * inv_rms);
}

/* residual[r] = round(residual[r] + x[r]) when x is given (else residual is the input as it is), then
 * out[r] = round(w * round(residual[r] * rsqrt(mean(residual[r]^2) + eps))). The mean's sum runs in SUM_LANES
 * independent chains (a serial chain of dependent adds cost ~1 us a row of 576) joined by a fixed tree: the
 * same order on every build and for every number of rows. */
int specdec_add_rms_norm(int dtype, const void *x, int64_t x_stride, void *residual, int64_t res_stride,
                         const void *weight, void *out, int64_t out_stride, int64_t num_rows, int64_t dim,
                         float eps, int num_threads) {
    int threads = num_rows * dim >= 2 * MIN_ELEMENTS_PER_THREAD ? num_threads : 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        if (dtype == DTYPE_F32) {
            add_rms_norm_f32(x ? (const float *)x + r * x_stride : NULL, (float *)residual + r * res_stride,
                             weight, (float *)out + r * out_stride, dim, eps);
            continue;
        }
        float lanes[SUM_LANES] = {0};
        for (int64_t i0 = 0; i0 < dim; i0 += SUM_LANES) {
            int64_t n = dim - i0 < SUM_LANES ? dim - i0 : SUM_LANES;
            for (int64_t l = 0; l < n; l++) {
                float h = load_scalar(dtype, residual, r * res_stride + i0 + l);
                if (x) {
                    h = round_to(dtype, h + load_scalar(dtype, x, r * x_stride + i0 + l));
                    store_scalar(dtype, residual, r * res_stride + i0 + l, h);
                }
                lanes[l] = lanes[l] + h * h;
            }
        }
        float inv_rms = inv_rms_of(lanes, dim, eps);
        for (int64_t i = 0; i < dim; i++) {
            float h = load_scalar(dtype, residual, r * res_stride + i);
            float normed = round_to(dtype, h * inv_rms);
            store_scalar(dtype, out, r * out_stride + i, load_scalar(dtype, weight, i) * normed);
        }
    }
    return 0;
}

/* One fp32 row of specdec_rope, in two halves without a branch so that the compiler vectorises them: the same
 * operations, so the same bits. */
static void rope_f32(float *restrict x, int64_t num_heads, int64_t head_dim, const float *restrict c,
                     const float *restrict s) {
    const int64_t half = head_dim / 2;
    float v[1024];
    for (int64_t h = 0; h < num_heads; h++, x += head_dim) {
        memcpy(v, x, sizeof(float) * head_dim);
        for (int64_t i = 0; i < half; i++) x[i] = v[i] * c[i] + (-v[i + half]) * s[i];
        for (int64_t i = half; i < head_dim; i++) x[i] = v[i] * c[i] + v[i - half] * s[i];
    }
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
        if (dtype == DTYPE_F32) {
            rope_f32((float *)x + r * x_stride, num_heads, head_dim, (const float *)cos + r * cs_stride,
                     (const float *)sin + r * cs_stride);
            continue;
        }
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

/* n elements of src (src_dtype, from element offset at) into dst (dst_dtype, from element offset first, step
 * apart): copied as they are in one dtype, rounded as torch rounds from fp32 to bf16. */
static void copy_elements(int src_dtype, const void *src, int64_t at, int dst_dtype, void *dst, int64_t first,
                          int64_t step, int64_t n) {
    if (src_dtype != dst_dtype) {
        for (int64_t e = 0; e < n; e++)
            store_scalar(dst_dtype, dst, first + e * step, load_scalar(src_dtype, src, at + e));
    } else if (step == 1) {
        int64_t size = src_dtype == DTYPE_F32 ? 4 : 2;
        memcpy((char *)dst + first * size, (const char *)src + at * size, n * size);
    } else if (src_dtype == DTYPE_F32) {
        for (int64_t e = 0; e < n; e++) ((float *)dst)[first + e * step] = ((const float *)src)[at + e];
    } else {
        for (int64_t e = 0; e < n; e++) ((uint16_t *)dst)[first + e * step] = ((const uint16_t *)src)[at + e];
    }
}

/* Stores each row's K and V heads (kv_width = KVH head_dim elements each, at k and v in the row, dtype) at its
 * cache slot, in cache_dtype (dtype's, or bf16 from fp32: rounded to nearest-even, as torch rounds): value_cache
 * is [num_slots, kv_width], key_cache the same or, keys_transposed, [num_blocks, kv_width, block_size]
 * (= [num_blocks, KVH, head_dim, block_size]; kernels/paged_attention_cpu.c reads 16 keys' dimension d as one
 * vector there). */
int specdec_write_kv(int dtype, int cache_dtype, const void *k, const void *v, int64_t row_stride,
                     int64_t num_rows, int64_t kv_width, const int64_t *slot_mapping, void *key_cache,
                     void *value_cache, int64_t block_size, int keys_transposed) {
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t slot = slot_mapping[r], at = r * row_stride;
        /* element e = h head_dim + d of the slot's key: slot * kv_width + e, or its block's [e][offset] */
        int64_t first = keys_transposed ? (slot / block_size) * kv_width * block_size + slot % block_size
                                        : slot * kv_width;
        copy_elements(dtype, v, at, cache_dtype, value_cache, slot * kv_width, 1, kv_width);
        copy_elements(dtype, k, at, cache_dtype, key_cache, first, keys_transposed ? block_size : 1, kv_width);
    }
    return 0;
}

/* ---- The decoder layers of a Llama step, in one call (worker_service/runtime/backends/cpu_llama.py) ----
 *
 * The same sequence of kernel calls that a Python loop would make, made here: from Python each of a step's
 * ~300 calls cost a few microseconds of argument conversion and interpretation (~1.5 ms of a 7 ms SmolLM2
 * decode step on two cores). The projections and the attention are the other libraries' functions
 * (kernels/csrc/linear_cpu.c, paged_attention_cpu.c), passed as pointers, so each is the very function its
 * own tests check. */

typedef int (*linear_fn)(int x_dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t in, int w_dtype,
                         const void *w, int64_t out_features, const float *bias, void *out, int64_t out_stride,
                         int num_threads);
typedef int (*attention_fn)(int dtype, int cache_dtype, const void *query, int64_t q_stride_t, int64_t q_stride_h,
                            const void *key_cache, const void *value_cache, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            const int32_t *is_tree, const int32_t *prefix_lens, const int32_t *depths,
                            const int32_t *paths, int64_t path_stride, int keys_transposed, int num_threads);

struct LinearArgs { /* a packed projection (kernels/linear_cpu.py's layout) */
    int64_t w_dtype;
    const void *w;
    int64_t in, out;
    const float *bias; /* or NULL */
};

struct LayerArgs {
    const void *input_norm, *post_norm; /* [hidden] each, the model's dtype */
    struct LinearArgs qkv, o, gate_up, down; /* q/k/v and gate/up fused: their outputs side by side */
    float scaling;
};

struct StepArgs {
    int64_t dtype, num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_threads;
    float eps;
    /* [T, width] buffers: residual (updated in place), x, h [T, hidden]; attn [T, H D]; qkv [T, (H + 2 KVH) D];
     * gate_up [T, 2 intermediate]; act [T, intermediate]. h holds the previous layer's output. */
    void *residual, *x, *h, *attn, *qkv, *gate_up, *act;
    const void *cos, *sin; /* [T, head_dim] */
    const int64_t *slot_mapping; /* [T] */
    /* The attention's arguments (paged_attention_cpu.c) */
    const int32_t *block_tables;
    int64_t bt_stride, num_seqs, block_size;
    const int32_t *query_start_loc, *seq_lens;
    const int32_t *is_tree, *prefix_lens, *depths, *paths; /* NULL without trees */
    int64_t path_stride;
    void *const *key_caches, *const *value_caches; /* per layer: [num_blocks, block_size, KVH, D] */
    int64_t cache_dtype; /* the caches' dtype: dtype's, or bf16 under an fp32 model (--kv-cache-dtype) */
    int64_t keys_transposed; /* the key caches' layout: [num_blocks, KVH, D, block_size] (specdec_write_kv) */
    linear_fn linear;
    attention_fn attention;
    /* aux [T, num_aux hidden] or NULL: column block j gets the residual stream entering layer aux_layers[j]
     * (EAGLE-3's inputs) */
    void *aux;
    const int64_t *aux_layers;
    int64_t num_aux;
    int64_t failed_status; /* out: the failing kernel's status */
};

static int project(const struct StepArgs *s, const struct LinearArgs *l, const void *x, void *out) {
    return s->linear((int)s->dtype, x, l->in, s->num_tokens, l->in, (int)l->w_dtype, l->w, l->out, l->bias, out,
                     l->out, (int)s->num_threads);
}

/* Every layer of the model, in order: per layer, residual += h (none before layer 0), kept in aux where asked;
 * x = RMSNorm; qkv = x Wqkv;
 * RoPE on q and k; K/V to the cache; attention; h = attn Wo; residual += h; x = RMSNorm; gate_up = x Wgu;
 * act = silu(gate) up; h = act Wdown. Returns 0, 1 when a projection failed or 2 when the attention did
 * (its status in failed_status). */
int specdec_llama_layers(struct StepArgs *s, const struct LayerArgs *layers, int64_t num_layers) {
    const int dtype = (int)s->dtype, threads = (int)s->num_threads;
    const int64_t T = s->num_tokens, hidden = s->hidden, D = s->head_dim;
    const int64_t q_width = s->num_heads * D, kv_width = s->num_kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int64_t size = dtype == DTYPE_F32 ? 4 : 2;
    char *qkv = s->qkv;
    for (int64_t index = 0; index < num_layers; index++) {
        const struct LayerArgs *l = &layers[index];
        specdec_add_rms_norm(dtype, index ? s->h : NULL, hidden, s->residual, hidden, l->input_norm, s->x, hidden,
                             T, hidden, s->eps, threads);
        for (int64_t j = 0; j < s->num_aux; j++) {
            if (s->aux_layers[j] != index) continue;
            for (int64_t r = 0; r < T; r++)
                memcpy((char *)s->aux + (r * s->num_aux + j) * hidden * size,
                       (const char *)s->residual + r * hidden * size, hidden * size);
        }
        int status = project(s, &l->qkv, s->x, qkv);
        if (status) return s->failed_status = status, 1;
        specdec_rope(dtype, qkv, qkv_width, T, s->num_heads + s->num_kv_heads, D, s->cos, s->sin, D, threads);
        specdec_write_kv(dtype, (int)s->cache_dtype, qkv + q_width * size, qkv + (q_width + kv_width) * size,
                         qkv_width, T, kv_width, s->slot_mapping, s->key_caches[index], s->value_caches[index],
                         s->block_size, (int)s->keys_transposed);
        status = s->attention(dtype, (int)s->cache_dtype, qkv, qkv_width, D, s->key_caches[index],
                              s->value_caches[index], s->block_tables, s->bt_stride, s->query_start_loc,
                              s->seq_lens, s->attn, (int)s->num_seqs, (int)s->num_heads, (int)s->num_kv_heads,
                              (int)D, (int)s->block_size, l->scaling, s->is_tree, s->prefix_lens, s->depths,
                              s->paths, s->path_stride, (int)s->keys_transposed, threads);
        if (status) return s->failed_status = status, 2;
        if ((status = project(s, &l->o, s->attn, s->h))) return s->failed_status = status, 1;
        specdec_add_rms_norm(dtype, s->h, hidden, s->residual, hidden, l->post_norm, s->x, hidden, T, hidden, s->eps,
                             threads);
        if ((status = project(s, &l->gate_up, s->x, s->gate_up))) return s->failed_status = status, 1;
        specdec_silu_mul(dtype, s->gate_up, 2 * s->intermediate, T, s->intermediate, s->act, s->intermediate, threads);
        if ((status = project(s, &l->down, s->act, s->h))) return s->failed_status = status, 1;
    }
    return 0;
}
