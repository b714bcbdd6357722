/* Structured outputs' token masks applied to rows of fp32 logits in place (kernels/token_bitmask.py).
 *
 * Mask i covers logits row rows[i]: bit t % 32 of word t / 32 set means token t is allowed; every other
 * token's logit becomes -inf, in one pass over the row's words (a word of all ones is skipped, a word of
 * zeros writes 32 logits). A mask that allows no token of the vocabulary (past the grammar's end) allows
 * the EOS ids instead, their logits left as they were. Exact: logits are only kept or set to -inf, so the
 * result is bitwise torch's masked_fill of the same mask (the reference in kernels/token_bitmask.py).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Returns 0, or 1 when the masks hold fewer than num_vocab bits. */
int specdec_apply_token_bitmask(float *logits, int64_t row_stride, int64_t num_vocab, const int64_t *rows,
                                int64_t num_masks, const int32_t *bitmask, int64_t num_words, const int64_t *eos,
                                int64_t num_eos) {
    if (num_words * 32 < num_vocab) return 1;
    int64_t full_words = num_vocab / 32, tail_bits = num_vocab % 32;
    uint32_t tail_mask = tail_bits ? (1u << tail_bits) - 1u : 0u;
    for (int64_t i = 0; i < num_masks; i++) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *words = (const uint32_t *)bitmask + i * num_words;
        int allows_any = 0;
        for (int64_t w = 0; w < full_words && !allows_any; w++) allows_any = words[w] != 0;
        if (!allows_any && tail_bits) allows_any = (words[full_words] & tail_mask) != 0;
        if (!allows_any) { /* past the grammar's end: the EOS ids only, their logits kept */
            for (int64_t t = 0; t < num_vocab; t++) {
                int is_eos = 0;
                for (int64_t e = 0; e < num_eos; e++) is_eos |= eos[e] == t;
                if (!is_eos) row[t] = -INFINITY;
            }
            continue;
        }
        for (int64_t w = 0; w * 32 < num_vocab; w++) {
            uint32_t word = words[w];
            if (word == 0xFFFFFFFFu) continue;
            float *out = row + w * 32;
            int64_t n = num_vocab - w * 32 < 32 ? num_vocab - w * 32 : 32;
            if (word == 0) {
                for (int64_t b = 0; b < n; b++) out[b] = -INFINITY;
                continue;
            }
#if defined(__AVX512F__)
            if (n == 32) { /* masked stores: the forbidden lanes only */
                const __m512 forbidden = _mm512_set1_ps(-INFINITY);
                _mm512_mask_storeu_ps(out, (__mmask16)(~word & 0xFFFFu), forbidden);
                _mm512_mask_storeu_ps(out + 16, (__mmask16)(~word >> 16), forbidden);
                continue;
            }
#endif
            for (int64_t b = 0; b < n; b++)
                if (!((word >> b) & 1u)) out[b] = -INFINITY;
        }
    }
    return 0;
}
