/* The sampler's vocabulary-wide passes on the CPU (kernels/sampling_cpu.py).
 *
 * specdec_argmax_rows: out[r] = the first index of the largest value of row r, or of its first NaN (a NaN counts
 * as the largest, as in torch's argmax): the same index whatever the build.
 *
 * specdec_race_rows, the exponential race over rows of fp32 distributions and their noise (race_rows):
 *
 *   out[r] = the first v with the largest score[v],   score[v] = dist[r, v] > 0 ? dist[r, v] / noise[r, v] : -1
 *
 * torch.where(dist > 0, dist / noise, -1).argmax(-1) in one pass, with no temporaries: the scores are the same
 * IEEE divisions and the comparison keeps the first maximum, so the index is the reference's. A NaN in dist
 * scores -1 (its comparison is false), as in the reference; noise is positive and finite, so no score is NaN.
 * The AVX-512 path keeps 16 lanes' first maxima (a lane updates only on a strictly larger score) and then takes
 * the smallest index among the lanes that hold the largest: the same first maximum as the scalar loop.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* The first maximum over 16 lanes that each hold the first maximum of their own elements (a lane moves only to a
 * strictly larger value): the largest value, and the smallest index among the lanes holding it. */
static inline int64_t first_of_lanes(__m512 best_lanes, __m512i index_lanes, float *best) {
    float values[16];
    int32_t indices[16];
    _mm512_storeu_ps(values, best_lanes);
    _mm512_storeu_si512(indices, index_lanes);
    int64_t best_index = indices[0];
    *best = values[0];
    for (int lane = 1; lane < 16; lane++)
        if (values[lane] > *best || (values[lane] == *best && indices[lane] < best_index))
            *best = values[lane], best_index = indices[lane];
    return best_index;
}

/* Lanes whose value beats their best so far take it and its index v + lane. */
static inline void update_lanes(__m512 values, int64_t v, __m512 *best_lanes, __m512i *index_lanes) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 larger = _mm512_cmp_ps_mask(values, *best_lanes, _CMP_GT_OQ);
    *best_lanes = _mm512_mask_mov_ps(*best_lanes, larger, values);
    *index_lanes = _mm512_mask_mov_epi32(*index_lanes, larger, _mm512_add_epi32(lanes, _mm512_set1_epi32((int32_t)v)));
}
#endif

static int64_t race_row(const float *dist, const float *noise, int64_t vocab) {
    int64_t v = 0, best_index = 0;
    float best = -INFINITY;
#if defined(__AVX512F__)
    if (vocab >= 16) {
        __m512 best_lanes = _mm512_set1_ps(-INFINITY), minus_one = _mm512_set1_ps(-1.0f);
        __m512i index_lanes = _mm512_setzero_si512();
        for (; v + 16 <= vocab; v += 16) {
            __m512 d = _mm512_loadu_ps(dist + v);
            __mmask16 has_mass = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
            update_lanes(_mm512_mask_div_ps(minus_one, has_mass, d, _mm512_loadu_ps(noise + v)), v, &best_lanes,
                         &index_lanes);
        }
        best_index = first_of_lanes(best_lanes, index_lanes, &best);
    }
#endif
    for (; v < vocab; v++) {
        float score = dist[v] > 0.0f ? dist[v] / noise[v] : -1.0f;
        if (score > best) best = score, best_index = v;
    }
    return best_index;
}

/* out[r] for rows r of dist and noise (row strides in elements; each row's vocab contiguous). Returns 0. */
int specdec_race_rows(const float *dist, int64_t dist_stride, const float *noise, int64_t noise_stride,
                      int64_t num_rows, int64_t vocab, int64_t *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) out[r] = race_row(dist + r * dist_stride, noise + r * noise_stride, vocab);
    return 0;
}

/* murmur3's 32-bit finaliser (worker_service/speculation/keyed_random.py's fmix32). */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

/* specdec_keyed_uniform_rows: out[r, c] = u(fmix32(row_keys[r] ^ column_hashes[c])) for c < num_cols, where
 * u(bits) = ((bits as int32 >> 9) + 2^22 + 0.5) * 2^-23 (keyed_random.py's uniform_from_bits): integer hashing
 * and float operations that are exact, so the values are bitwise those of its torch passes, in one pass. out's
 * rows are out_stride floats apart. Returns 0. */
int specdec_keyed_uniform_rows(const uint32_t *row_keys, int64_t num_rows, const uint32_t *column_hashes,
                               int64_t num_cols, float *out, int64_t out_stride, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) {
        uint32_t key = row_keys[r];
        float *row = out + r * out_stride;
        for (int64_t c = 0; c < num_cols; c++) {
            int32_t top = (int32_t)fmix32(key ^ column_hashes[c]) >> 9; /* arithmetic: -2^22 .. 2^22 - 1 */
            row[c] = ((float)top + 4194304.5f) * 0x1p-23f;
        }
    }
    return 0;
}

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t v = 0, best_index = 0;
    float best = -INFINITY;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 best_lanes = _mm512_set1_ps(-INFINITY);
        __m512i index_lanes = _mm512_setzero_si512();
        for (; v + 16 <= n; v += 16) {
            __m512 values = _mm512_loadu_ps(x + v);
            if (_mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q)) /* a NaN: the first one is the answer */
                for (int64_t j = 0; j < v + 16; j++)
                    if (x[j] != x[j]) return j;
            update_lanes(values, v, &best_lanes, &index_lanes);
        }
        best_index = first_of_lanes(best_lanes, index_lanes, &best);
    }
#endif
    for (; v < n; v++) {
        if (x[v] != x[v]) return v; /* NaN */
        if (x[v] > best || (v == 0 && best_index == 0)) best = x[v], best_index = v;
    }
    return best_index;
}

/* out[r] for rows r of x (row stride in elements, each row's n values contiguous). Returns 0. */
int specdec_argmax_rows(const float *x, int64_t x_stride, int64_t num_rows, int64_t n, int64_t *out,
                        int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) out[r] = argmax_row(x + r * x_stride, n);
    return 0;
}
