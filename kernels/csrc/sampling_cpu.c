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
 *
 * specdec_keyed_noise_rows: keyed_random.py's uniforms, or its Exp(1) noise -log u (the log our own polynomial).
 * specdec_softmax_rows: a softmax with our own exp and a fixed order of summation.
 * specdec_keyed_race_rows: a sampled token per row in one pass (the softmax's weights or a given distribution,
 * the noise and the race). specdec_top_k_top_p_rows: top-k and top-p without sorting a row.
 * Each is the same bits on every build (scalar, AVX2, AVX-512; tests/kernels/test_sampling_cpu.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"
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

/* -log(u) for u in (0, 1) (the keyed uniforms: 2^-24 <= u <= 1 - 2^-24), our own polynomial, so every build
 * gives the same bits, and with no division: u = 2^e m with m in [sqrt(1/2), sqrt(2)), t = m - 1 (exact), and
 * log m = t - t^2/2 + t^3 P(t), P a least-squares fit of degree 7 (relative error < 1e-7 over the interval; near
 * u = 1, m = u, so tiny -log u keep their relative precision). */
static inline float neg_log_unit(float u) {
    uint32_t bits;
    memcpy(&bits, &u, sizeof bits);
    int32_t e = (int32_t)(bits >> 23) - 127;
    uint32_t mantissa_bits = (bits & 0x007FFFFFu) | 0x3F800000u; /* m in [1, 2) */
    float m;
    memcpy(&m, &mantissa_bits, sizeof m);
    int is_high = m > 1.41421354f;
    m = is_high ? m * 0.5f : m;
    e = is_high ? e + 1 : e;
    float t = m - 1.0f;
    float p = -0.07362867891788483f;
    p = fmaf(p, t, 0.1262032687664032f);
    p = fmaf(p, t, -0.13202103972434998f);
    p = fmaf(p, t, 0.14227114617824554f);
    p = fmaf(p, t, -0.16621370613574982f);
    p = fmaf(p, t, 0.19999825954437256f);
    p = fmaf(p, t, -0.2500085234642029f);
    p = fmaf(p, t, 0.3333335518836975f);
    float log_m = fmaf(t * t, fmaf(t, p, -0.5f), t);
    float fe = (float)e;
    return -fmaf(fe, 0.693145752f, fmaf(fe, 1.42860677e-6f, log_m)); /* ln 2 in two parts: fe * high is exact */
}

/* out[i] = -log u[i] by neg_log_unit (its tests call this). Returns 0. */
int specdec_neg_log_unit(const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = neg_log_unit(u[i]);
    return 0;
}

/* keyed_random.py's uniform of (row key, column hash): u(bits) = ((bits as int32 >> 9) + 2^22 + 0.5) * 2^-23
 * (its uniform_from_bits) of bits = fmix32(key ^ column_hash): integer hashing and float operations that are
 * exact, so the values are bitwise those of its torch passes. */
static inline float keyed_uniform(uint32_t key, uint32_t column_hash) {
    int32_t top = (int32_t)fmix32(key ^ column_hash) >> 9; /* arithmetic: -2^22 .. 2^22 - 1 */
    return ((float)top + 4194304.5f) * 0x1p-23f;
}

/* The keyed Exp(1) noise of (row key, column hash): -log of its uniform, the log our polynomial. */
static inline float keyed_exponential(uint32_t key, uint32_t column_hash) {
    return neg_log_unit(keyed_uniform(key, column_hash));
}

/* specdec_keyed_noise_rows: out[r, c] = keyed_uniform(row_keys[r], column_hashes[c]) for c < num_cols, or with
 * `exponential` keyed_exponential, in one pass; out's rows are out_stride floats apart. Returns 0. */
int specdec_keyed_noise_rows(const uint32_t *row_keys, int64_t num_rows, const uint32_t *column_hashes,
                             int64_t num_cols, int exponential, float *out, int64_t out_stride, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) {
        uint32_t key = row_keys[r];
        float *row = out + r * out_stride;
        if (exponential)
            for (int64_t c = 0; c < num_cols; c++) row[c] = keyed_exponential(key, column_hashes[c]);
        else
            for (int64_t c = 0; c < num_cols; c++) row[c] = keyed_uniform(key, column_hashes[c]);
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

/* specdec_top_k_top_p_rows: per row of temperature-scaled logits x (fp32), sampling.py's top-k then top-p
 * distribution: the tokens in the order (logit descending, index ascending); the first top_k of them (0: all);
 * their softmax p; a token kept while the mass of the kept tokens above it is below top_p (top_p >= 1 keeps
 * all; the first token is always kept); the kept p renormalised, every other token 0.
 *
 * Without sorting the vocabulary: the top_k set is found by radix selection of its k-th largest value (counts
 * over the values' bits, nth_largest_radix) and only its k tokens are sorted; top-p alone finds its crossing
 * token by radix selection weighted by the tokens' mass (top_p_radix). torch's sort of 49,152 values took
 * 2.6 ms a row.
 * Only the row's values decide its probabilities: batch invariant. exp is our polynomial (exp_poly.h) and the
 * row's mass a sum in a fixed order, so every build gives the same bits. */
typedef struct {
    float value;
    int32_t index;
} ranked;

/* The order of the tokens: logit descending, then index ascending. */
static int ranked_before(const ranked *a, const ranked *b) {
    return a->value > b->value || (a->value == b->value && a->index < b->index);
}

static int compare_ranked(const void *a, const void *b) {
    return ranked_before(a, b) ? -1 : ranked_before(b, a) ? 1 : 0;
}

/* The n-th largest of values[0..count) (n < count), values reordered (quickselect, Hoare's partition). */
static float nth_largest(float *values, int64_t count, int64_t n) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        float pivot = values[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (values[i] > pivot) i++;
            while (values[j] < pivot) j--;
            if (i <= j) {
                float t = values[i];
                values[i] = values[j], values[j] = t;
                i++, j--;
            }
        }
        if (n <= j) hi = j;
        else if (n >= i) lo = i;
        else return values[n];
    }
    return values[n];
}

/* A float's bits as an unsigned number in the float's order (-inf lowest): radix selection's digits. */
static inline uint32_t ordered_bits(float value) {
    uint32_t u;
    memcpy(&u, &value, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

#define RADIX_BITS 12
#define RADIX_BUCKETS (1 << RADIX_BITS)

/* The bucket (of RADIX_BITS bits at `shift`) that holds the n-th largest of values[0..count), by counting them;
 * *above: how many values lie in the buckets above it. */
static uint32_t radix_bucket(const float *values, int64_t count, int shift, int64_t n, int64_t *above) {
    int32_t counts[RADIX_BUCKETS];
    memset(counts, 0, sizeof counts);
    for (int64_t v = 0; v < count; v++) counts[(ordered_bits(values[v]) >> shift) & (RADIX_BUCKETS - 1)]++;
    int bucket = RADIX_BUCKETS - 1;
    while (bucket > 0 && *above + counts[bucket] <= n) *above += counts[bucket--];
    return (uint32_t)bucket;
}

/* The n-th largest value of x (0-based, n < vocab) by radix selection over the values' bits: the bucket of their
 * top 12 bits that holds it (a counting pass), that bucket's values copied out (a second pass), the bucket of
 * their next 12 bits, then a quickselect among the few values left. A quickselect of the whole row moved it
 * about several times. scratch: vocab floats. */
static float nth_largest_radix(const float *x, int64_t vocab, int64_t n, float *scratch) {
    int64_t above = 0; /* values ranked above the bucket in hand */
    uint32_t high = radix_bucket(x, vocab, 32 - RADIX_BITS, n, &above);
    int64_t count = 0;
    for (int64_t v = 0; v < vocab; v++)
        if (ordered_bits(x[v]) >> (32 - RADIX_BITS) == high) scratch[count++] = x[v];
    uint32_t prefix = high << RADIX_BITS | radix_bucket(scratch, count, 32 - 2 * RADIX_BITS, n, &above);
    int64_t left = 0;
    for (int64_t i = 0; i < count; i++)
        if (ordered_bits(scratch[i]) >> (32 - 2 * RADIX_BITS) == prefix) scratch[left++] = scratch[i];
    return nth_largest(scratch, left, n - above);
}

/* The first `limit` (< vocab) tokens of x in rank order (all those above the limit-th largest value, then as
 * many of its ties as fit, lowest indices first), sorted, into out; returns how many. scratch: vocab floats. */
static int64_t top_ranked(const float *x, int64_t vocab, int64_t limit, float *scratch, ranked *out) {
    float threshold = nth_largest_radix(x, vocab, limit - 1, scratch);
    int64_t count = 0;
    for (int64_t v = 0; v < vocab; v++)
        if (x[v] > threshold) out[count].value = x[v], out[count++].index = (int32_t)v;
    for (int64_t v = 0; v < vocab && count < limit; v++) /* ties at the threshold, lowest index first */
        if (x[v] == threshold) out[count].value = x[v], out[count++].index = (int32_t)v;
    qsort(out, (size_t)count, sizeof *out, compare_ranked);
    return count;
}


/* Top-p over a whole row without sorting it: the token where the mass of the tokens ranked above it first
 * reaches `target` (top_p times the row's mass), found by the mass per bucket of the values' top 12 bits,
 * then of the next 12 among the crossing bucket's tokens (copied out), then exactly among the few left (sorted).
 * Writes e / (mass kept) for the kept tokens (out is zero elsewhere). e: the row's exps. */
static void top_p_radix(const float *x, const float *e, int64_t vocab, double target, float *out, ranked *order) {
    double mass[RADIX_BUCKETS]; /* on the stack: a thread-local array cost a TLS lookup per access */
    double above = 0.0; /* mass of the tokens in the buckets above the crossing one */
    memset(mass, 0, sizeof mass); /* by the top 12 bits of every token */
    for (int64_t v = 0; v < vocab; v++) mass[ordered_bits(x[v]) >> (32 - RADIX_BITS)] += e[v];
    int high = RADIX_BUCKETS - 1;
    while (high > 0 && above + mass[high] < target) above += mass[high--];
    int64_t count = 0; /* the crossing bucket's tokens, in vocabulary order */
    for (int64_t v = 0; v < vocab; v++)
        if (ordered_bits(x[v]) >> (32 - RADIX_BITS) == (uint32_t)high)
            order[count].value = x[v], order[count++].index = (int32_t)v;
    memset(mass, 0, sizeof mass); /* by their next 12 bits, summed in the same order as over the whole row */
    for (int64_t i = 0; i < count; i++)
        mass[(ordered_bits(order[i].value) >> (32 - 2 * RADIX_BITS)) & (RADIX_BUCKETS - 1)] += e[order[i].index];
    int low = RADIX_BUCKETS - 1;
    while (low > 0 && above + mass[low] < target) above += mass[low--];
    uint32_t prefix = (uint32_t)high << RADIX_BITS | (uint32_t)low;
    int64_t left = 0; /* the tokens of the crossing bucket of 24 bits, ranked */
    for (int64_t i = 0; i < count; i++)
        if (ordered_bits(order[i].value) >> (32 - 2 * RADIX_BITS) == prefix) order[left++] = order[i];
    count = left;
    qsort(order, (size_t)count, sizeof *order, compare_ranked);
    int64_t last = 0; /* the last kept token of the bucket: kept while the mass above it is short of target */
    double kept = above;
    for (int64_t r = 0; r < count; r++) {
        if (r > 0 && kept >= target) break;
        kept += e[order[r].index];
        last = r;
    }
    float kept_mass = (float)kept;
    if (!count) { /* (no token left: cannot happen with target below the row's mass) every token kept */
        for (int64_t v = 0; v < vocab; v++) out[v] = e[v] / kept_mass;
        return;
    }
    float crossing_value = order[last].value; /* kept: ranked at or above the crossing token */
    int64_t crossing_index = order[last].index;
    for (int64_t v = 0; v < vocab; v++) {
        float p = e[v] / kept_mass;
        int is_kept = x[v] > crossing_value || (x[v] == crossing_value && v <= crossing_index);
        out[v] = is_kept ? p : 0.0f;
    }
}

/* The sum of x[0..n) in double, in a fixed order whatever the build: 16 running sums (element v into sum
 * v mod 16), then those added in order. */
static double ordered_sum(const float *x, int64_t n) {
    double lanes[16] = {0};
    int64_t v = 0;
    for (; v + 16 <= n; v += 16)
        for (int lane = 0; lane < 16; lane++) lanes[lane] += (double)x[v + lane];
    for (; v < n; v++) lanes[v % 16] += (double)x[v];
    double total = 0.0;
    for (int lane = 0; lane < 16; lane++) total += lanes[lane];
    return total;
}

static void top_k_top_p_row(const float *x, int64_t vocab, int64_t top_k, float top_p, float *out, float *scratch,
                            ranked *order) {
    int64_t k = top_k > 0 && top_k < vocab ? top_k : vocab;
    float most = x[argmax_row(x, vocab)];
    if (k == vocab) { /* top-p alone: the row's exps, then the crossing token by radix selection */
        for (int64_t v = 0; v < vocab; v++) scratch[v] = exp_nonpositive(x[v] - most);
        double total = ordered_sum(scratch, vocab);
        if (top_p >= 1.0f) {
            float denominator = (float)total;
            for (int64_t v = 0; v < vocab; v++) out[v] = scratch[v] / denominator;
            return;
        }
        top_p_radix(x, scratch, vocab, (double)top_p * total, out, order);
        return;
    }
    /* top-k: its k tokens ranked (selection, then a sort of k), their softmax, then top-p along them */
    int64_t num_ranked = top_ranked(x, vocab, k, scratch, order);
    double total = 0.0;
    for (int64_t r = 0; r < num_ranked; r++) total += exp_nonpositive(order[r].value - most);
    float denominator = (float)total;
    memset(out, 0, (size_t)vocab * sizeof(float));
    double mass = 0.0; /* of the kept tokens: in double, as torch's CPU cumsum accumulates floats */
    int64_t kept = 0;
    for (int64_t r = 0; r < num_ranked; r++) {
        if (r > 0 && top_p < 1.0f && (float)mass >= top_p) break;
        float p = exp_nonpositive(order[r].value - most) / denominator;
        out[order[r].index] = p;
        mass += p;
        kept = r + 1;
    }
    float kept_mass = (float)mass;
    for (int64_t r = 0; r < kept; r++) out[order[r].index] /= kept_mass;
}

/* out rows (out_stride apart) for rows of x (x_stride apart): top_k[r] (0: off) and top_p[r] (1: off) each.
 * Returns 0, or 1 when scratch memory cannot be had. */
int specdec_top_k_top_p_rows(const float *x, int64_t x_stride, int64_t num_rows, int64_t vocab,
                             const int64_t *top_k, const float *top_p, float *out, int64_t out_stride,
                             int num_threads) {
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (num_rows > 1)
    {
        float *scratch = malloc((size_t)vocab * sizeof(float));
        ranked *order = malloc((size_t)vocab * sizeof(ranked));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++) {
            if (scratch && order) {
                top_k_top_p_row(x + r * x_stride, vocab, top_k[r], top_p[r], out + r * out_stride, scratch, order);
            } else {
                #pragma omp atomic write
                failed = 1;
            }
        }
        free(scratch);
        free(order);
    }
    return failed;
}

/* A row's softmax weights at a temperature t > 0: w[v] = exp(x[v] / t - max_u x[u] / t), the exp our polynomial
 * (exp_poly.h: 0 below e^-87). (The max of x / t is max(x) / t: a correctly rounded division is monotone; t = 1
 * divides by nothing.) */
static void softmax_weights(const float *x, int64_t vocab, float temperature, float *w) {
    float most = x[argmax_row(x, vocab)];
    if (temperature == 1.0f) {
        for (int64_t v = 0; v < vocab; v++) w[v] = exp_nonpositive(x[v] - most);
    } else {
        most = most / temperature;
        for (int64_t v = 0; v < vocab; v++) w[v] = exp_nonpositive(x[v] / temperature - most);
    }
}

/* specdec_softmax_rows: out[r] = softmax(x[r]): softmax_weights over their sum (ordered_sum), the same bits on
 * every build; each row's values depend on that row alone. Returns 0. */
int specdec_softmax_rows(const float *x, int64_t x_stride, int64_t num_rows, int64_t vocab, float *out,
                         int64_t out_stride, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) {
        float *row = out + r * out_stride;
        softmax_weights(x + r * x_stride, vocab, 1.0f, row);
        float scale = 1.0f / (float)ordered_sum(row, vocab);
        for (int64_t v = 0; v < vocab; v++) row[v] = row[v] * scale;
    }
    return 0;
}

/* The first index of the largest score[v] = p[v] > 0 ? p[v] / E[v] : -1 over a row, E the keyed noise of
 * (key, column_hashes[v]): the race, chunk by chunk through a small buffer. */
#define RACE_CHUNK 1024
static int64_t keyed_race_row(const float *p, int64_t vocab, uint32_t key, const uint32_t *column_hashes) {
    float scores[RACE_CHUNK], best = -INFINITY;
    int64_t best_index = 0;
    for (int64_t c0 = 0; c0 < vocab; c0 += RACE_CHUNK) {
        int64_t n = vocab - c0 < RACE_CHUNK ? vocab - c0 : RACE_CHUNK;
        const float *q = p + c0;
        const uint32_t *hashes = column_hashes + c0;
        for (int64_t j = 0; j < n; j++) scores[j] = keyed_exponential(key, hashes[j]);
        for (int64_t j = 0; j < n; j++) { /* two loops: as one, GCC does not vectorise the selection */
            float score = q[j] / scores[j];
            scores[j] = q[j] > 0.0f ? score : -1.0f;
        }
        int64_t j = argmax_row(scores, n); /* scores are never NaN */
        if (scores[j] > best) best = scores[j], best_index = c0 + j;
    }
    return best_index;
}

/* specdec_keyed_race_rows: a sampled token per row, with no [rows, vocab] temporaries:
 *
 *   p = temperature[r] > 0 ? softmax_weights(values[r], temperature[r]) (the softmax before its normalisation,
 *                            which moves no argmax but for rounding)
 *                          : values[r] (a distribution, any scale)
 *   out[r] = the first v with the largest p[v] > 0 ? p[v] / E[v] : -1,   E[v] = the keyed Exp(1) noise of
 *            (row_keys[r], column_hashes[v]) as specdec_keyed_noise_rows computes it
 *
 * With temperature[r] = 0 that is bitwise race_rows(values, keyed exponentials). Returns 0, or 1 when scratch
 * memory cannot be had. */
int specdec_keyed_race_rows(const float *values, int64_t stride, int64_t num_rows, int64_t vocab,
                            const float *temperature, const uint32_t *row_keys, const uint32_t *column_hashes,
                            int64_t *out, int num_threads) {
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (num_rows > 1)
    {
        float *weights = malloc((size_t)vocab * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            const float *p = values + r * stride;
            if (temperature[r] > 0.0f) {
                if (!weights) {
                    #pragma omp atomic write
                    failed = 1;
                    continue;
                }
                softmax_weights(p, vocab, temperature[r], weights);
                p = weights;
            }
            out[r] = keyed_race_row(p, vocab, row_keys[r], column_hashes);
        }
        free(weights);
    }
    return failed;
}
