/* moe-rl's CPU kernels for the routing hot path (and the rotary embedding and the experts' SwiGLU), loaded with
   ctypes by moe_rl/kernels/native.py.

   Each one computes exactly what the torch code it replaces computes (it compares, counts, copies, adds in the order
   torch adds, multiplies and adds element by element with torch's roundings, hands the arithmetic to MKL's own
   GEMM, or chains the products in MKL's order where grouped_gemm.py has checked that this gives MKL's bits): routing decisions, traces and every number downstream stay those of torch. They exist because at the
   paper's routing shape (128 experts, top-8, a few thousand tokens per call) torch's general kernels spend most of
   their time on set-up, branches and temporary buffers, once per layer and call.

   One kernel is the exception, and says so: decode_attention (the sampler's one-query attention over the KV cache,
   fp32 only) agrees with torch's to fp32 rounding, as two torch attention kernels agree with each other, not bit for
   bit. It never runs in the trainer's forwards or under the bf16 sampler. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The elementwise loops (row sums, the rotary embedding) are compiled for AVX-512, AVX2 and the baseline, and the
   loader picks the widest the CPU has (GCC/clang function multi-versioning; Linux on x86-64 only; native.py builds
   without it, -DMOE_RL_ONE_VERSION, where a toolchain refuses it). With -ffp-contract=off no version fuses a
   multiply and an add, so all of them round each product and each sum once: the same numbers at every width. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MOE_RL_ONE_VERSION)
#define WIDEST_VECTORS __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST_VECTORS
#endif

/* Kernels written with AVX-512 intrinsics (the top-k's wide rows, the grouped products in MKL's order) are built on
   x86-64 with GCC or clang and run where the CPU has AVX-512F (checked at run time); elsewhere their callers take
   the portable code. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MOE_RL_ONE_VERSION)
#include <immintrin.h>
#define AVX512_KERNELS 1
#define AVX512_HELPER static inline __attribute__((always_inline, target("avx512f")))
#endif

/* The grouped products in MKL's order also have an AVX2 version (with FMA, checked at run time), for the CPUs
   without AVX-512. It is built in every multi-version build and in the MOE_RL_ISA=avx2 build, not in the baseline
   one, so that the caps leave exactly the code an older CPU would run. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    (!defined(MOE_RL_ONE_VERSION) || (defined(__AVX2__) && defined(__FMA__)))
#include <immintrin.h>
#define AVX2_KERNELS 1
#define AVX2_HELPER static inline __attribute__((always_inline, target("avx2,fma")))
#endif

/* ---------------------------------------------------------------------------------------------------------------
   top-k of each row

   Indices of the k largest values of each row of a contiguous float32 (rows, n) matrix, in descending order of
   value, into out (rows, k). A row whose k + 1 largest values ("keep") are not all distinct, or that holds a NaN, is
   "unclear" (torch's order among equal values is its own): its first index is set to -1 for the caller to redo it
   with torch.topk. Returns the number of unclear rows, or -1 if out of memory. Without ties the k largest are unique
   and in a unique order, so any exact method returns torch.topk's indices.

   Narrow rows hold the keep largest in a small sorted buffer by insertion. Wide rows (n >= 2 * GROUPS, keep <=
   GROUPS) avoid its branches, which mispredict on every new row of near-uniform router scores:
   1. a threshold no value of the keep largest is below: the maximum of each of GROUPS interleaved groups (group g
      holds columns j with j % GROUPS == g) gives GROUPS distinct values, so at least keep values of the row are >=
      the keep-th largest of those maxima (found, like everything below, by stable ranks: count the larger values
      and the equal ones to the left);
   2. the values at or above it (a dozen or two of 128 at the paper's shape) gathered, in column order, without
      branches;
   3. each of those written to the place its stable rank among them gives it: the keep largest in descending order,
      equal values in column order, so the tie check sees exactly the keep largest.
   Rows of a multiple of 16 columns (up to 256) take the same steps 16 columns per instruction where the CPU has
   AVX-512 (top_of_row_avx512: 86 us against 193 us for the scalar steps and 873 us for torch.topk at 704 rows of 128
   router scores, top-8; one thread, medians). */

#define MAX_KEEP 65
#define GROUPS 16

static int64_t insert(float *value, int64_t *index, int64_t held, int64_t keep, float candidate, int64_t j)
{
    int64_t slot = held < keep ? held++ : keep - 1;
    while (slot > 0 && value[slot - 1] < candidate) {
        value[slot] = value[slot - 1];
        index[slot] = index[slot - 1];
        --slot;
    }
    value[slot] = candidate;
    index[slot] = j;
    return held;
}

/* Stable descending rank of v[i] among v[0..n): how many values are larger, plus how many equal ones come before. */
static int64_t stable_rank(const float *v, int64_t n, int64_t i)
{
    int64_t rank = 0;
    float vi = v[i];
    for (int64_t j = 0; j < i; ++j) rank += v[j] >= vi;
    for (int64_t j = i + 1; j < n; ++j) rank += v[j] > vi;
    return rank;
}

/* The keep-th largest of the row's GROUPS interleaved group maxima; *nan set when the row holds a NaN. */
static float group_threshold(const float *row, int64_t n, int64_t keep, int *nan)
{
    float group_max[GROUPS];
    int seen_nan = 0;
    for (int g = 0; g < GROUPS; ++g) {
        group_max[g] = row[g];
        seen_nan |= row[g] != row[g];
    }
    int64_t j = GROUPS;
    for (; j + GROUPS <= n; j += GROUPS) {
        for (int g = 0; g < GROUPS; ++g) {
            float v = row[j + g];
            group_max[g] = v > group_max[g] ? v : group_max[g];
            seen_nan |= v != v;
        }
    }
    for (int g = 0; j < n; ++j, ++g) {
        float v = row[j];
        group_max[g] = v > group_max[g] ? v : group_max[g];
        seen_nan |= v != v;
    }
    *nan = seen_nan;
    float threshold = group_max[0];
    for (int g = 0; g < GROUPS; ++g)
        threshold = stable_rank(group_max, GROUPS, g) == keep - 1 ? group_max[g] : threshold;
    return threshold;
}

/* The keep largest values of a row (at least keep of them are >= threshold) in descending order, equal values in
   column order: the values >= threshold are gathered without branches, then each is written to the place its stable
   rank gives it (value and index hold keep + 1 places; the last catches the values ranked lower). */
static void top_from(const float *row, int64_t n, float threshold, int64_t keep, float *found_value,
                     int64_t *found_index, float *value, int64_t *index)
{
    int64_t found = 0;
    for (int64_t j = 0; j < n; ++j) {
        found_value[found] = row[j];
        found_index[found] = j;
        found += row[j] >= threshold;
    }
    for (int64_t i = 0; i < found; ++i) {
        int64_t rank = stable_rank(found_value, found, i);
        int64_t place = rank < keep ? rank : keep;
        value[place] = found_value[i];
        index[place] = found_index[i];
    }
}

#ifdef AVX512_KERNELS
#define MAX_VECTOR_ROW 256  /* widest row the vector version takes: 16 vectors */

/* The wide-row method above, 16 columns per instruction, for rows of a multiple of 16 columns (at most 256): the
   same group maxima, threshold, candidates (gathered in column order) and stable ranks, so the same indices; it only
   compares and copies. Returns 1 if the row holds a NaN (nothing written), else 0. */
__attribute__((target("avx512f")))
static int top_of_row_avx512(const float *row, int64_t n, int64_t keep, float *value, int64_t *index)
{
    const int64_t vectors = n / 16;
    __m512 group_max = _mm512_loadu_ps(row);
    __mmask16 nan = _mm512_cmp_ps_mask(group_max, group_max, _CMP_UNORD_Q);
    for (int64_t i = 1; i < vectors; ++i) {
        __m512 v = _mm512_loadu_ps(row + 16 * i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        group_max = _mm512_max_ps(v, group_max);
    }
    if (nan) return 1;
    /* the keep-th largest group maximum: the lane whose stable rank among the 16 is keep - 1 */
    float maxima[16];
    _mm512_storeu_ps(maxima, group_max);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i rank = _mm512_setzero_si512();
    for (int j = 0; j < 16; ++j) {
        __m512 mj = _mm512_set1_ps(maxima[j]);
        __mmask16 ahead = _mm512_cmp_ps_mask(mj, group_max, _CMP_GT_OQ) |
                          (_mm512_cmp_ps_mask(mj, group_max, _CMP_EQ_OQ) &
                           _mm512_cmp_epi32_mask(_mm512_set1_epi32(j), lane, _MM_CMPINT_LT));
        rank = _mm512_mask_add_epi32(rank, ahead, rank, _mm512_set1_epi32(1));
    }
    float threshold = maxima[__builtin_ctz(_mm512_cmpeq_epi32_mask(rank, _mm512_set1_epi32((int)keep - 1)))];
    /* the values at or above it, in column order */
    float found_value[MAX_VECTOR_ROW + 16];
    int32_t found_index[MAX_VECTOR_ROW + 16];
    int found = 0;
    const __m512 bound = _mm512_set1_ps(threshold);
    for (int64_t i = 0; i < vectors; ++i) {
        __m512 v = _mm512_loadu_ps(row + 16 * i);
        __mmask16 at_least = _mm512_cmp_ps_mask(v, bound, _CMP_GE_OQ);
        /* compressed in a register, then stored whole (the lanes past the found ones are overwritten later or never
           read): a compressing store to memory is microcoded and far slower on some CPUs (AMD Zen 4) */
        _mm512_storeu_ps(found_value + found, _mm512_maskz_compress_ps(at_least, v));
        _mm512_storeu_si512(found_index + found, _mm512_maskz_compress_epi32(
                                                     at_least, _mm512_add_epi32(lane, _mm512_set1_epi32((int)(16 * i)))));
        found += __builtin_popcount(at_least);
    }
    /* each to the place its stable rank among them gives it (place keep catches the lower ones) */
    for (int c = 0; c < found; ++c) {
        const __m512 vc = _mm512_set1_ps(found_value[c]);
        int ahead = 0;
        for (int c0 = 0; c0 < found; c0 += 16) {
            __mmask16 valid = found - c0 >= 16 ? 0xFFFF : (__mmask16)((1u << (found - c0)) - 1);
            __m512 chunk = _mm512_maskz_loadu_ps(valid, found_value + c0);
            __mmask16 before = c - c0 >= 16 ? 0xFFFF : c - c0 <= 0 ? 0 : (__mmask16)((1u << (c - c0)) - 1);
            ahead += __builtin_popcount(_mm512_mask_cmp_ps_mask(valid, chunk, vc, _CMP_GT_OQ) |
                                        _mm512_mask_cmp_ps_mask(before, chunk, vc, _CMP_EQ_OQ));
        }
        int64_t place = ahead < keep ? ahead : keep;
        value[place] = found_value[c];
        index[place] = found_index[c];
    }
    return 0;
}
#endif

int64_t topk_rows(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *out)
{
    float value[MAX_KEEP + 1];
    int64_t index[MAX_KEEP + 1];
    int64_t keep = k < n ? k + 1 : n;
    int use_threshold = keep <= GROUPS && n >= 2 * GROUPS;
    int use_vectors = 0;
#ifdef AVX512_KERNELS
    use_vectors = use_threshold && n % 16 == 0 && n <= MAX_VECTOR_ROW && __builtin_cpu_supports("avx512f");
#endif
    float *found_value = use_threshold ? malloc(n * sizeof(float)) : NULL;
    int64_t *found_index = use_threshold ? malloc(n * sizeof(int64_t)) : NULL;
    if (use_threshold && (found_value == NULL || found_index == NULL)) {
        free(found_value);
        free(found_index);
        return -1;
    }
    int64_t unclear_rows = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        int64_t held = keep;
        int nan = 0;
        if (use_vectors) {
#ifdef AVX512_KERNELS
            nan = top_of_row_avx512(row, n, keep, value, index);
#endif
        } else if (use_threshold) {
            float threshold = group_threshold(row, n, keep, &nan);
            if (!nan) top_from(row, n, threshold, keep, found_value, found_index, value, index);
        } else {
            held = 0;
            for (int64_t j = 0; j < n; ++j) {
                float candidate = row[j];
                if (candidate != candidate) { nan = 1; break; }
                if (held == keep && !(candidate > value[keep - 1])) continue;
                held = insert(value, index, held, keep, candidate, j);
            }
        }
        int unclear = nan;
        for (int64_t i = 0; i + 1 < held && !unclear; ++i) unclear = value[i] == value[i + 1];
        unclear_rows += unclear;
        if (nan) { out[r * k] = -1; continue; }
        for (int64_t i = 0; i < k; ++i) out[r * k + i] = index[i];
        if (unclear) out[r * k] = -1;
    }
    free(found_value);
    free(found_index);
    return unclear_rows;
}

/* ---------------------------------------------------------------------------------------------------------------
   token-slots sorted by expert

   A stable counting sort of n expert ids (slot s = token * k + choice): order[p] is the slot at sorted position p,
   sorted_ids[p] its expert, token[p] its token (order[p] / k), counts[e] the slots of expert e. A stable sort has one
   answer, so this is exactly torch's stable argsort. Returns 0, or -1 (nothing written but counts) if an id lies
   outside [0, experts). */

int64_t sort_slots(const int64_t *ids, int64_t n, int64_t k, int64_t experts, int64_t *order, int64_t *sorted_ids,
                   int64_t *token, int64_t *counts)
{
    memset(counts, 0, experts * sizeof(int64_t));
    for (int64_t s = 0; s < n; ++s) {
        int64_t e = ids[s];
        if (e < 0 || e >= experts) return -1;
        counts[e]++;
    }
    int64_t *next = malloc(experts * sizeof(int64_t));
    if (next == NULL) return -2;
    int64_t start = 0;
    for (int64_t e = 0; e < experts; ++e) {
        next[e] = start;
        start += counts[e];
    }
    for (int64_t s = 0; s < n; ++s) {
        int64_t p = next[ids[s]]++;
        order[p] = s;
        sorted_ids[p] = ids[s];
        token[p] = s / k;
    }
    free(next);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   the experts' input rows and the combined output, without autograd

   The buffer the expert products read holds one block of rows per expert, in expert order: expert e's block has
   block_rows[e] >= counts[e] rows, its first counts[e] rows its sorted slots in order, the rest padding (block_rows
   NULL: blocks of exactly counts[e] rows, no padding). For each buffer row, expert_rows writes the input row x[t] of
   its slot's token t (zeros for padding), the token (`tokens` for padding) and the slot's gate weight
   weights[order[p]] (0 for padding): the copies torch's index_copy, gather and cat make, in one pass. Returns the
   number of rows, or -1 if the counts do not add up to the `slots` sorted slots, a block is shorter than its group,
   or a token lies outside [0, tokens); order[p] must lie in [0, tokens * k) (weights is (tokens, k)). */

int64_t expert_rows(const float *x, int64_t tokens, int64_t d, const int64_t *token, const int64_t *order,
                    int64_t slots, const float *weights, const int64_t *counts, const int64_t *block_rows,
                    int64_t experts, float *x_rows, int64_t *row_token, float *row_weight)
{
    int64_t total = 0;
    for (int64_t e = 0; e < experts; ++e) total += counts[e];
    if (total != slots) return -1;
    int64_t slot = 0, row = 0;
    for (int64_t e = 0; e < experts; ++e) {
        int64_t block = block_rows != NULL ? block_rows[e] : counts[e];
        if (block < counts[e]) return -1;
        for (int64_t i = 0; i < counts[e]; ++i, ++slot, ++row) {
            int64_t t = token[slot];
            if (t < 0 || t >= tokens) return -1;
            memcpy(x_rows + row * d, x + t * d, d * sizeof(float));
            row_token[row] = t;
            row_weight[row] = weights[order[slot]];
        }
        for (int64_t i = counts[e]; i < block; ++i, ++row) {
            memset(x_rows + row * d, 0, d * sizeof(float));
            row_token[row] = tokens;
            row_weight[row] = 0.0f;
        }
    }
    return row;
}

/* out (tokens, d) = the sum of the buffer rows y of each token, added in row order to a zero row; rows of token
   `tokens` (padding) are left out. With a weight per row (weight != NULL), each row is first multiplied by its
   weight, one rounded product per element, as torch's `y * weight[:, None]` before the index_add. Each element sees
   the additions torch's index_add makes, in the same order, so the sums are its sums bit for bit. Returns 0, or -1 if
   a row's token lies outside [0, tokens]. */

WIDEST_VECTORS
int64_t add_rows(const float *y, const float *weight, int64_t rows, int64_t d, const int64_t *row_token,
                 int64_t tokens, float *out)
{
    memset(out, 0, tokens * d * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
        int64_t t = row_token[r];
        if (t < 0 || t > tokens) return -1;
        if (t == tokens) continue;
        float *sum = out + t * d;
        const float *add = y + r * d;
        if (weight == NULL) {
            for (int64_t j = 0; j < d; ++j) sum[j] += add[j];
        } else {
            float w = weight[r];
            for (int64_t j = 0; j < d; ++j) sum[j] += add[j] * w;
        }
    }
    return 0;
}

/* The backward of add_rows with weights, for the gradient `grad` (tokens, d) of its output: each buffer row's token's
   gradient row g (zeros for padding rows) times the row's weight into grad_y, and times the row itself into
   grad_times_y, whose row sums are the weights' gradients (the caller sums them with torch, so the sum is torch's).
   These are the products torch's autograd makes for `index_add(y * weight[:, None])`: the index_add's backward
   gathers g (index_select of the gradient with a zero row appended), the product's backward multiplies it by the
   other factor, one rounded product per element. Returns 0, or -1 if a row's token lies outside [0, tokens]. */

WIDEST_VECTORS
int64_t add_rows_backward(const float *grad, int64_t tokens, int64_t d, const int64_t *row_token, const float *weight,
                          const float *y, int64_t rows, float *grad_y, float *grad_times_y)
{
    for (int64_t r = 0; r < rows; ++r) {
        int64_t t = row_token[r];
        if (t < 0 || t > tokens) return -1;
        float w = weight[r];
        const float *yr = y + r * d;
        float *gy = grad_y + r * d, *gyy = grad_times_y + r * d;
        if (t == tokens) {  /* a padding row's gradient: the appended zero row, multiplied like any other */
            for (int64_t j = 0; j < d; ++j) {
                gy[j] = 0.0f * w;
                gyy[j] = 0.0f * yr[j];
            }
            continue;
        }
        const float *g = grad + t * d;
        for (int64_t j = 0; j < d; ++j) {
            gy[j] = g[j] * w;
            gyy[j] = g[j] * yr[j];
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   rotary position embedding, rotate-half layout

   x (rows, heads, dh), its rows row_stride floats apart and each row's heads contiguous; cos and signed_sin (rows,
   dh), one row per row of x, broadcast over its heads; out (rows, heads, dh) contiguous. half = dh / 2 and
   j' = (j + half) % dh, the partner of column j. Forward: out[j] = x[j] * cos[j] + x[j'] * signed_sin[j], torch's
   x * cos + roll(x, half) * signed_sin. Backward (of that, for the gradient g of out): out[j] = g[j] * cos[j] +
   g[j'] * signed_sin[j'], torch's g * cos + roll(g * signed_sin, -half), the two terms autograd adds for the two
   uses of x. Two products and one sum per element, each rounded once (no fused multiply-add), as torch's three
   elementwise ops round them. Returns 0, or -1 for an odd dh. */

WIDEST_VECTORS
int64_t rotate_half(const float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dh, const float *cos,
                    const float *signed_sin, int64_t backward, float *out)
{
    if (dh % 2 != 0) return -1;
    int64_t half = dh / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * dh, *s = signed_sin + r * dh;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + r * row_stride + h * dh;
            float *oh = out + (r * heads + h) * dh;
            for (int64_t j = 0; j < half; ++j) {  /* partner j + half */
                float direct = xh[j] * c[j];
                float partner = backward ? xh[j + half] * s[j + half] : xh[j + half] * s[j];
                oh[j] = direct + partner;
            }
            for (int64_t j = half; j < dh; ++j) {  /* partner j - half */
                float direct = xh[j] * c[j];
                float partner = backward ? xh[j - half] * s[j - half] : xh[j - half] * s[j];
                oh[j] = direct + partner;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   RMS norm's elementwise passes, torch's composite rms_norm with autograd

   x (rows, d) contiguous; rstd (rows), each row's 1 / sqrt(mean(x^2) + eps) as torch computed it; weight (d). Every
   value is one rounded product or sum of the torch op it stands for (the reductions stay torch's, in the caller):
     mode 0 (forward):         out = (x * rstd) * weight                       result.mul(weight) of x.mul(rstd)
     mode 1 (backward, part 1): out = g * (x * rstd) (skipped where out is NULL), out2 = (g * weight) * x
                               the products whose sums are weight's gradient (over rows) and rstd's (over columns)
     mode 2 (backward, part 2): out = (g * weight) * rstd, out2 = c * (x * 2), c = ((grad_rstd * -0.5) * rstd^3) / d
                               x's gradient through x.mul(rstd) and through x.pow(2), apart: autograd adds each to
                               what x's other uses gave, in that order, and float sums depend on the order.
                               grad_rstd (rows) is the row sum of mode 1's out2 (the caller's torch sum), carried
                               back through rsqrt (-0.5 * grad * rstd.pow(3), the cube as (s * s) * s), add
                               (unchanged) and mean (/ d)
   Returns 0, or -1 for an unknown mode. */

WIDEST_VECTORS
int64_t rms_norm_rows(int64_t mode, const float *x, const float *rstd, const float *weight, const float *grad,
                      const float *grad_rstd, int64_t rows, int64_t d, float *out, float *out2)
{
    if (mode < 0 || mode > 2) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * d;
        const float *gr = grad != NULL ? grad + r * d : NULL;
        float *o = out != NULL ? out + r * d : NULL;
        float s = rstd[r];
        if (mode == 0) {
            for (int64_t j = 0; j < d; ++j) o[j] = (xr[j] * s) * weight[j];
        } else if (mode == 1) {
            float *o2 = out2 + r * d;
            if (o != NULL)
                for (int64_t j = 0; j < d; ++j) o[j] = gr[j] * (xr[j] * s);
            for (int64_t j = 0; j < d; ++j) o2[j] = (gr[j] * weight[j]) * xr[j];
        } else {
            float c = ((grad_rstd[r] * -0.5f) * ((s * s) * s)) / (float)d;
            float *o2 = out2 + r * d;
            for (int64_t j = 0; j < d; ++j) {
                o[j] = (gr[j] * weight[j]) * s;
                o2[j] = c * (xr[j] * 2.0f);
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   grouped products through MKL's batched GEMM

   One cblas_sgemm_batch call (each expert its own group of one product; row-major, alpha 1, beta 0) for the three
   products of an expert layer over token-slots sorted by expert, E experts, rows of expert e starting at the sum of
   the counts before it:
     mode 0 (forward):     c rows of e (n_e x F) = a rows of e (n_e x D) @ b[e] (D x F)
     mode 1 (input grad):  c rows of e (n_e x D) = a rows of e (n_e x F) @ b[e]^T; experts with exactly one row are
                           skipped (m = 0) and left to the caller, whose torch does a matrix-vector product there
     mode 2 (weight grad): c[e] (D x F) = (a rows of e (n_e x D))^T @ b rows of e (n_e x F); an idle expert gets
                           zeros (k = 0, beta 0)
   Experts with skip_min_rows <= n_e <= skip_max_rows are skipped (m = 0; exact_products below computes them; an
   empty range, min > max, skips none).
   sgemm_batch is MKL's function (from the torch library that links it), so the products are torch's own sgemm.
   Returns 0; -1 if a count is negative or the counts do not add up to `rows`; -2 if out of memory; nothing is
   computed unless it returns 0. */

typedef void (*sgemm_batch_fn)(int layout, const int *transa, const int *transb, const int *m, const int *n,
                               const int *k, const float *alpha, const float **a, const int *lda, const float **b,
                               const int *ldb, const float *beta, float **c, const int *ldc, int groups,
                               const int *group_size);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

int64_t expert_sgemm(void *sgemm_batch, int64_t mode, int64_t experts, const int64_t *counts, int64_t rows,
                     int64_t d, int64_t f, const float *a, const float *b, float *c, int64_t skip_min_rows,
                     int64_t skip_max_rows)
{
    int64_t total = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (counts[e] < 0) return -1;
        total += counts[e];
    }
    if (total != rows) return -1;
    int *ints = malloc(experts * 9 * sizeof(int));
    float *scalars = malloc(experts * 2 * sizeof(float));
    const float **pointers = malloc(experts * 3 * sizeof(float *));
    if (ints == NULL || scalars == NULL || pointers == NULL) {
        free(ints); free(scalars); free(pointers);
        return -2;
    }
    int *transa = ints, *transb = ints + experts, *m = ints + 2 * experts, *n = ints + 3 * experts;
    int *kk = ints + 4 * experts, *lda = ints + 5 * experts, *ldb = ints + 6 * experts, *ldc = ints + 7 * experts;
    int *group_size = ints + 8 * experts;  /* E groups of one product each */
    float *alpha = scalars, *beta = scalars + experts;
    const float **pa = pointers, **pb = pointers + experts;
    float **pc = (float **)(pointers + 2 * experts);
    int64_t start = 0;
    for (int64_t e = 0; e < experts; ++e) {
        int64_t rows_e = counts[e];
        int skipped = skip_min_rows <= rows_e && rows_e <= skip_max_rows;  /* computed by exact_products */
        group_size[e] = 1;
        alpha[e] = 1.0f;
        beta[e] = 0.0f;
        if (mode == 0) {
            transa[e] = NO_TRANS; transb[e] = NO_TRANS;
            m[e] = skipped ? 0 : (int)rows_e; n[e] = (int)f; kk[e] = (int)d;
            pa[e] = a + start * d; lda[e] = (int)d;
            pb[e] = b + e * d * f; ldb[e] = (int)f;
            pc[e] = c + start * f; ldc[e] = (int)f;
        } else if (mode == 1) {
            transa[e] = NO_TRANS; transb[e] = TRANS;
            m[e] = rows_e == 1 || skipped ? 0 : (int)rows_e; n[e] = (int)d; kk[e] = (int)f;
            pa[e] = a + start * f; lda[e] = (int)f;
            pb[e] = b + e * d * f; ldb[e] = (int)f;
            pc[e] = c + start * d; ldc[e] = (int)d;
        } else {
            transa[e] = TRANS; transb[e] = NO_TRANS;
            m[e] = skipped ? 0 : (int)d; n[e] = (int)f; kk[e] = (int)rows_e;
            pa[e] = a + start * d; lda[e] = (int)d;
            pb[e] = b + start * f; ldb[e] = (int)f;
            pc[e] = c + e * d * f; ldc[e] = (int)f;
        }
        start += rows_e;
    }
    ((sgemm_batch_fn)sgemm_batch)(ROW_MAJOR, transa, transb, m, n, kk, alpha, pa, lda, pb, ldb, beta, pc, ldc,
                                  (int)experts, group_size);
    free(ints); free(scalars); free(pointers);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   grouped products in MKL's own order (AVX-512, and AVX2 with FMA)

   The three products of expert_sgemm, computed here with the roundings MKL's sgemm makes at the widths of the
   paper-shaped models, where a C loop is faster than MKL's batch call (MKL spends much of a small product packing
   its operands). Each output element is a chain over k in order from a zero accumulator: a fused multiply-add per
   step for experts with at least `fused_from` rows, a product then a sum (each rounded) for fewer. That is what MKL
   does (measured: one thread, its AVX-512 kernels and its AVX2 ones, depth up to 192; a one- to three-row product
   goes through a path without fused multiply-adds), but nothing guarantees it, so grouped_gemm.py compares this kernel with MKL at each
   shape before it lets it serve, and uses it only for the group sizes where they agreed.

   Only experts with min_rows <= n_e <= max_rows are computed (their outputs only; the others are left untouched
   for the MKL call). The widths the vectors run along (F for modes 0 and 2, D for mode 1) must be multiples of 16
   for the AVX-512 version, of 8 for the AVX2 one. Returns the number of experts left for MKL (rows outside the range:
   n_e > 0 in modes 0 and 1, any in mode 2), -1 if a count is negative or the counts do not add up to `rows`, -2 if
   out of memory, -3 where it cannot run (neither AVX-512 nor AVX2 with FMA on this CPU or in this build, or widths
   that are not whole vectors). */

/* The next expert's weight block (modes 0 and 1), or the weight gradient it will write (mode 2): brought towards the
   cache while this expert computes, a few lines per tile, one per step of a tile's chain. In a model's pass every
   layer's expert weights come from memory (the paper shape's 48 layers hold 144 MB of them), and the next block is
   not where the hardware prefetcher looks. benchmarks/bench_prefetch.py builds the kernels with and without it
   (-DMOE_RL_NO_PREFETCH) and times both in one process, over 48 layers' operands and over one layer's (in cache);
   the two builds differ by up to 10% even where their code paths are the same (layout), so what counts is the
   48-layer ratio against the in-cache one. The AVX2 loop prefetches in every mode: on a 2-core AVX2 AMD EPYC the loop
   ran at 40-70% of its in-cache speed over 48 layers and this made the products 1.0-1.6x faster (0.9-1.1x in cache);
   on a Zen 4 capped to AVX2, 1.2-1.9x in the forward and the input gradient (results/bench/amd_avx512_capped_avx2/
   prefetch.md). The AVX-512 loop prefetches in mode 1 only: on that Zen 4, uncapped, with every mode prefetched
   (2026-12-04 15:11 UTC; the committed results/bench/amd_avx512/prefetch.md is the run of this choice), the input
   gradient over 48 layers gained 1.3-1.4x (1.0-1.1x in cache), while the forward and the weight gradient at
   decode-step group sizes lost (0.77-0.84x over 48 layers against 0.93-1.01x in cache); in both runs the RL step
   moved by less than its noise. Spread out, not all at once: a burst of 256 prefetches at an expert's start changed
   nothing, the lines past the core's miss buffers being dropped. A hint only: no number changes. */
struct next_block {
    const char *start;
    int64_t lines;  /* 64-byte lines; 0: nothing to bring */
    int write;
};

static inline __attribute__((always_inline)) void prefetch_line(const char *line, const int write)
{
#ifndef MOE_RL_NO_PREFETCH
    if (write) __builtin_prefetch(line, 1, 3);
    else __builtin_prefetch(line, 0, 3);
#else
    (void)line;
    (void)write;
#endif
}

#define PRODUCT_ROWS 4   /* output rows per tile: 4 rows x 4 vectors = 16 accumulators */
#define PRODUCT_VECTORS 4

#ifdef AVX512_KERNELS

/* One step of an output element's chain over the depth: acc + x * y, in one rounding (fused) or with the product
   rounded before the sum. `fused` is a constant wherever this is inlined (TILE_CASE), so no branch is left. */
AVX512_HELPER __m512 chain_step(__m512 x, __m512 y, __m512 acc, const int fused)
{
    return fused ? _mm512_fmadd_ps(x, y, acc) : _mm512_add_ps(acc, _mm512_mul_ps(x, y));
}

/* c[r][j] = sum over k of a[r * ar + k * ak] * b[k * ldb + j], for r < rows_used and j < 16 * vectors: inlined at
   each call with constant rows_used and vectors, so the accumulators stay in registers. */
AVX512_HELPER void product_tile(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t depth,
                                float *c, int64_t ldc, const int rows_used, const int vectors, const int fused,
                                const char *ahead, int64_t ahead_lines, const int ahead_write)
{
    __m512 acc[PRODUCT_ROWS][PRODUCT_VECTORS];
#pragma GCC unroll 4
    for (int r = 0; r < rows_used; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < vectors; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; ++k) {
        if (k < ahead_lines) prefetch_line(ahead + 64 * k, ahead_write);
        __m512 bk[PRODUCT_VECTORS];
#pragma GCC unroll 4
        for (int v = 0; v < vectors; ++v) bk[v] = _mm512_loadu_ps(b + k * ldb + 16 * v);
#pragma GCC unroll 4
        for (int r = 0; r < rows_used; ++r) {
            __m512 ark = _mm512_set1_ps(a[r * ar + k * ak]);
#pragma GCC unroll 4
            for (int v = 0; v < vectors; ++v) acc[r][v] = chain_step(ark, bk[v], acc[r][v], fused);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows_used; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < vectors; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

/* One tile of rows_used rows with the columns' vectors and `fused` in constants, so product_tile unrolls and keeps
   one kind of step. */
#define TILE_CASE(R, V)                                                                                    \
    (fused ? product_tile(a, ar, ak, b, ldb, depth, c, ldc, R, V, 1, ahead, ahead_lines, ahead_write)     \
           : product_tile(a, ar, ak, b, ldb, depth, c, ldc, R, V, 0, ahead, ahead_lines, ahead_write))
AVX512_HELPER void tile_of(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t depth,
                           float *c, int64_t ldc, int rows_used, int vectors, int fused, const char *ahead,
                           int64_t ahead_lines, int ahead_write)
{
    switch (rows_used * 8 + vectors) {
    case 1 * 8 + 1: TILE_CASE(1, 1); break;
    case 1 * 8 + 2: TILE_CASE(1, 2); break;
    case 1 * 8 + 3: TILE_CASE(1, 3); break;
    case 1 * 8 + 4: TILE_CASE(1, 4); break;
    case 2 * 8 + 1: TILE_CASE(2, 1); break;
    case 2 * 8 + 2: TILE_CASE(2, 2); break;
    case 2 * 8 + 3: TILE_CASE(2, 3); break;
    case 2 * 8 + 4: TILE_CASE(2, 4); break;
    case 3 * 8 + 1: TILE_CASE(3, 1); break;
    case 3 * 8 + 2: TILE_CASE(3, 2); break;
    case 3 * 8 + 3: TILE_CASE(3, 3); break;
    case 3 * 8 + 4: TILE_CASE(3, 4); break;
    case 4 * 8 + 1: TILE_CASE(4, 1); break;
    case 4 * 8 + 2: TILE_CASE(4, 2); break;
    case 4 * 8 + 3: TILE_CASE(4, 3); break;
    case 4 * 8 + 4: TILE_CASE(4, 4); break;
    }
}
#undef TILE_CASE

/* t (16 x 16, rows ldt apart) = the transpose of w (16 x 16, rows ldw apart), in registers */
AVX512_HELPER void transpose16(const float *w, int64_t ldw, float *t, int64_t ldt)
{
    __m512 r[16], s[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(w + i * ldw);
    for (int i = 0; i < 16; i += 2) {  /* interleave pairs of rows */
        s[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        s[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* then pairs of pairs */
        r[i] = _mm512_shuffle_ps(s[i], s[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(s[i], s[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(s[i + 1], s[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(s[i + 1], s[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {  /* then 128-bit lanes, twice */
        s[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        s[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        s[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        s[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_f32x4(s[i], s[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(s[i], s[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(s[i + 4], s[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(s[i + 4], s[i + 12], 0xDD);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(t + i * ldt, r[i]);
}

/* t (f x d) = w^T for w (d x f): 16 x 16 blocks in registers where both are multiples of 16 (4x faster at 64 x 64
   than the element loop, which the copy of an expert's weights for mode 1 would otherwise spend most of its time in) */
__attribute__((target("avx512f")))
static void transpose_avx512(const float *w, int64_t d, int64_t f, float *t)
{
    if (d % 16 == 0 && f % 16 == 0) {
        for (int64_t i = 0; i < d; i += 16)
            for (int64_t j = 0; j < f; j += 16) transpose16(w + i * f + j, f, t + j * d + i, d);
        return;
    }
    for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < f; ++j) t[j * d + i] = w[i * f + j];
}

/* c (rows x width) = A (rows x depth, element (r, k) at a[r * ar + k * ak]) @ b (depth x width, rows ldb apart) */
__attribute__((target("avx512f")))
static void chained_product_avx512(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t rows,
                            int64_t depth, int64_t width, float *c, int64_t ldc, int fused,
                            const struct next_block *next)
{
    int64_t tiles = ((width + 16 * PRODUCT_VECTORS - 1) / (16 * PRODUCT_VECTORS)) *
                    ((rows + PRODUCT_ROWS - 1) / PRODUCT_ROWS);
    int64_t lines_left = next->lines, per_tile = tiles > 0 ? (lines_left + tiles - 1) / tiles : 0;
    const char *ahead = next->start;
    for (int64_t j0 = 0; j0 < width; j0 += 16 * PRODUCT_VECTORS) {
        int vectors = (int)((width - j0) / 16 < PRODUCT_VECTORS ? (width - j0) / 16 : PRODUCT_VECTORS);
        for (int64_t r0 = 0; r0 < rows; r0 += PRODUCT_ROWS) {
            int rows_used = (int)(rows - r0 < PRODUCT_ROWS ? rows - r0 : PRODUCT_ROWS);
            int64_t lines = per_tile < lines_left ? per_tile : lines_left;
            tile_of(a + r0 * ar, ar, ak, b + j0, ldb, depth, c + r0 * ldc + j0, ldc, rows_used, vectors, fused, ahead,
                    lines, next->write);
            ahead += 64 * lines;
            lines_left -= lines;
        }
    }
}
#endif

#ifdef AVX2_KERNELS
/* The same chains with 8-lane vectors. Tiles of 6 rows x 2 vectors: 12 accumulators, 2 rows of b and a broadcast
   fill 15 of AVX2's 16 registers (BLIS's Haswell microkernel has the same shape, 6 x 16). */
#define AVX2_ROWS 6
#define AVX2_VECTORS 2

AVX2_HELPER __m256 chain_step_avx2(__m256 x, __m256 y, __m256 acc, const int fused)
{
    return fused ? _mm256_fmadd_ps(x, y, acc) : _mm256_add_ps(acc, _mm256_mul_ps(x, y));
}

AVX2_HELPER void product_tile_avx2(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t depth,
                                   float *c, int64_t ldc, const int rows_used, const int vectors, const int fused,
                                   const char *ahead, int64_t ahead_lines, const int ahead_write)
{
    __m256 acc[AVX2_ROWS][AVX2_VECTORS];
#pragma GCC unroll 6
    for (int r = 0; r < rows_used; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < vectors; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < depth; ++k) {
        if (k < ahead_lines) prefetch_line(ahead + 64 * k, ahead_write);
        __m256 bk[AVX2_VECTORS];
#pragma GCC unroll 2
        for (int v = 0; v < vectors; ++v) bk[v] = _mm256_loadu_ps(b + k * ldb + 8 * v);
#pragma GCC unroll 6
        for (int r = 0; r < rows_used; ++r) {
            __m256 ark = _mm256_set1_ps(a[r * ar + k * ak]);
#pragma GCC unroll 2
            for (int v = 0; v < vectors; ++v) acc[r][v] = chain_step_avx2(ark, bk[v], acc[r][v], fused);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows_used; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < vectors; ++v) _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
}

#define TILE_CASE(R, V)                                                                          \
    (fused ? product_tile_avx2(a, ar, ak, b, ldb, depth, c, ldc, R, V, 1, ahead, ahead_lines, ahead_write)    \
           : product_tile_avx2(a, ar, ak, b, ldb, depth, c, ldc, R, V, 0, ahead, ahead_lines, ahead_write))
AVX2_HELPER void tile_of_avx2(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t depth,
                              float *c, int64_t ldc, int rows_used, int vectors, int fused, const char *ahead,
                              int64_t ahead_lines, int ahead_write)
{
    switch (rows_used * 8 + vectors) {
    case 1 * 8 + 1: TILE_CASE(1, 1); break;
    case 1 * 8 + 2: TILE_CASE(1, 2); break;
    case 2 * 8 + 1: TILE_CASE(2, 1); break;
    case 2 * 8 + 2: TILE_CASE(2, 2); break;
    case 3 * 8 + 1: TILE_CASE(3, 1); break;
    case 3 * 8 + 2: TILE_CASE(3, 2); break;
    case 4 * 8 + 1: TILE_CASE(4, 1); break;
    case 4 * 8 + 2: TILE_CASE(4, 2); break;
    case 5 * 8 + 1: TILE_CASE(5, 1); break;
    case 5 * 8 + 2: TILE_CASE(5, 2); break;
    case 6 * 8 + 1: TILE_CASE(6, 1); break;
    case 6 * 8 + 2: TILE_CASE(6, 2); break;
    }
}
#undef TILE_CASE

/* t (8 x 8, rows ldt apart) = the transpose of w (8 x 8, rows ldw apart), in registers */
AVX2_HELPER void transpose8(const float *w, int64_t ldw, float *t, int64_t ldt)
{
    __m256 r[8], s[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + i * ldw);
    for (int i = 0; i < 8; i += 2) {  /* interleave pairs of rows */
        s[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        s[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  /* then pairs of pairs */
        r[i] = _mm256_shuffle_ps(s[i], s[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(s[i], s[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(s[i + 1], s[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(s[i + 1], s[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {  /* then the 128-bit halves */
        s[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        s[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(t + i * ldt, s[i]);
}

__attribute__((target("avx2,fma")))
static void transpose_avx2(const float *w, int64_t d, int64_t f, float *t)
{
    if (d % 8 == 0 && f % 8 == 0) {
        for (int64_t i = 0; i < d; i += 8)
            for (int64_t j = 0; j < f; j += 8) transpose8(w + i * f + j, f, t + j * d + i, d);
        return;
    }
    for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < f; ++j) t[j * d + i] = w[i * f + j];
}

__attribute__((target("avx2,fma")))
static void chained_product_avx2(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t rows,
                                 int64_t depth, int64_t width, float *c, int64_t ldc, int fused,
                                 const struct next_block *next)
{
    int64_t tiles = ((width + 8 * AVX2_VECTORS - 1) / (8 * AVX2_VECTORS)) * ((rows + AVX2_ROWS - 1) / AVX2_ROWS);
    int64_t lines_left = next->lines, per_tile = tiles > 0 ? (lines_left + tiles - 1) / tiles : 0;
    const char *ahead = next->start;
    for (int64_t j0 = 0; j0 < width; j0 += 8 * AVX2_VECTORS) {
        int vectors = (int)((width - j0) / 8 < AVX2_VECTORS ? (width - j0) / 8 : AVX2_VECTORS);
        for (int64_t r0 = 0; r0 < rows; r0 += AVX2_ROWS) {
            int rows_used = (int)(rows - r0 < AVX2_ROWS ? rows - r0 : AVX2_ROWS);
            int64_t lines = per_tile < lines_left ? per_tile : lines_left;
            tile_of_avx2(a + r0 * ar, ar, ak, b + j0, ldb, depth, c + r0 * ldc + j0, ldc, rows_used, vectors, fused,
                         ahead, lines, next->write);
            ahead += 64 * lines;
            lines_left -= lines;
        }
    }
}
#endif

typedef void (*transpose_fn)(const float *w, int64_t d, int64_t f, float *t);
typedef void (*chained_product_fn)(const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t rows,
                                   int64_t depth, int64_t width, float *c, int64_t ldc, int fused,
                                   const struct next_block *next);

int64_t exact_products(int64_t mode, int64_t experts, const int64_t *counts, int64_t rows, int64_t d, int64_t f,
                       const float *a, const float *b, float *c, int64_t min_rows, int64_t max_rows,
                       int64_t fused_from)
{
    int64_t vector_width = mode == 1 ? d : f;  /* the widths the vectors run along */
    (void)vector_width;  /* unused in a build without vector kernels */
    transpose_fn transpose = NULL;
    chained_product_fn chained_product = NULL;
    int prefetched_modes = 0;  /* bit m: mode m brings in the next expert's block (next_block says where it pays) */
#ifdef AVX512_KERNELS
    if (vector_width % 16 == 0 && __builtin_cpu_supports("avx512f")) {
        transpose = transpose_avx512;
        chained_product = chained_product_avx512;
        prefetched_modes = 1 << 1;
    }
#endif
#ifdef AVX2_KERNELS
    if (chained_product == NULL && vector_width % 8 == 0 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma")) {
        transpose = transpose_avx2;
        chained_product = chained_product_avx2;
        prefetched_modes = 1 << 0 | 1 << 1 | 1 << 2;
    }
#endif
    if (chained_product == NULL) return -3;
    int64_t total = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (counts[e] < 0) return -1;
        total += counts[e];
    }
    if (total != rows) return -1;
    float *transposed = mode == 1 ? malloc(d * f * sizeof(float)) : NULL;  /* b[e]^T (F x D) for mode 1 */
    if (mode == 1 && transposed == NULL) return -2;
    int64_t left = 0, start = 0;
    for (int64_t e = 0; e < experts; start += counts[e], ++e) {
        int64_t n = counts[e];
        if (n < min_rows || n > max_rows) {
            left += n > 0 || mode == 2;
            continue;
        }
        int fused = n >= fused_from;
        struct next_block next = {NULL, 0, mode == 2};
        if (e + 1 < experts && (prefetched_modes >> mode & 1)) {
            next.start = (const char *)((mode == 2 ? c : b) + (e + 1) * d * f);
            next.lines = (int64_t)(d * f * sizeof(float) + 63) / 64;
        }
        if (mode == 0) {
            chained_product(a + start * d, d, 1, b + e * d * f, f, n, d, f, c + start * f, f, fused, &next);
        } else if (mode == 1) {
            transpose(b + e * d * f, d, f, transposed);
            chained_product(a + start * f, f, 1, transposed, d, n, f, d, c + start * d, d, fused, &next);
        } else {
            chained_product(a + start * d, 1, d, b + start * f, f, d, n, f, c + e * d * f, f, fused, &next);
        }
    }
    free(transposed);
    return left;
}

/* ---------------------------------------------------------------------------------------------------------------
   decode attention: one query per row and head against the KV cache (the sampler's decode step)

   q (batch, heads, dh) contiguous; query head h reads key/value head h / (heads / kv_heads) (grouped-query
   attention). Keys are stored transposed: the key of row b, kv head g, dimension d, position p is
   kt[b * k_row_stride + g * k_head_stride + d * k_dim_stride + p], so the scores of 16 positions are one vector of
   multiply-adds per dimension; k_dim_stride must cover the positions rounded up to 16 (KVCache pads its rows), since
   the last vector reads past the last position (those lanes are masked). Values v[b * v_row_stride + g *
   v_head_stride + p * dh + d]. mask (batch, positions) of bytes, nonzero = may attend, or NULL for all. out (batch,
   heads, dh) = softmax(scale * q . k + mask) @ v.

   Not torch's bits: the dot products add dimensions in order, the softmax sums in 16 lanes, exp is Cephes' expf
   polynomial (within 1 ulp on [-87, 88], measured), and the weighted values sum in 4 chains of positions; every float
   op is written as 16-lane vector arithmetic (GCC vector extensions; on AVX2 and the baseline as two 8-lane halves
   doing the same per lane), so every version rounds the same way. Returns 0, -1 for a shape it does not serve (dh not a multiple of 16, heads not a multiple of kv_heads, no
   positions, or rows of kt too short), -2 if out of memory. */

#define LANES 16
#define VALUE_CHAINS 4

typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec16 __attribute__((vector_size(64), aligned(4)));

/* Inlined into each versioned caller: at any width they are the same 16-lane operations. Passing 64-byte vectors
   between functions compiled for different widths would change the calling convention, which GCC warns about; these
   are always inlined, so nothing is passed. */
#pragma GCC diagnostic ignored "-Wpsabi"
#define VECTOR_HELPER static inline __attribute__((always_inline))

VECTOR_HELPER vec16 load16(const float *p)
{
    vec16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

VECTOR_HELPER void store16(float *p, vec16 x) { memcpy(p, &x, sizeof x); }

VECTOR_HELPER vec16 select16(ivec16 mask, vec16 yes, vec16 no)
{
    return (vec16)(((ivec16)yes & mask) | ((ivec16)no & ~mask));
}

/* exp(x) for x in [-87, 88] (Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n;
   within 1 ulp there, measured); outside it 2^n leaves the normal range, so callers clamp or select. */
VECTOR_HELPER vec16 exp_in_range(vec16 x)
{
    const float log2e = 1.44269504088896341f, round_to_int = 12582912.0f;  /* 1.5 * 2^23 */
    vec16 n = (x * log2e + round_to_int) - round_to_int;
    vec16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  /* ln2 in two parts */
    vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    ivec16 two_n_bits = (__builtin_convertvector(n, ivec16) + 127) << 23;
    return p * (vec16)two_n_bits;
}

/* exp(x) for x <= 0; 0 below -87 (and for x = -inf, the masked positions) */
VECTOR_HELPER vec16 exp_nonpositive(vec16 x)
{
    vec16 zero = {0};
    return select16(x < -87.0f, zero, exp_in_range(x));
}

VECTOR_HELPER float lane_sum(vec16 x)
{
    float lane[LANES];
    store16(lane, x);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    return lane[0];
}

/* s[p] = scale * q . k_p + bias[p] for the padded positions; returns their maximum */
VECTOR_HELPER float scores(const float *q, const float *kt, int64_t dh, int64_t k_dim_stride, int64_t padded,
                           float scale, const float *bias, float *s)
{
    vec16 top = {0};
    top -= __builtin_inff();
    for (int64_t p0 = 0; p0 < padded; p0 += LANES) {
        vec16 dot = q[0] * load16(kt + p0);
        for (int64_t d = 1; d < dh; ++d) dot += q[d] * load16(kt + d * k_dim_stride + p0);
        dot = dot * scale + load16(bias + p0);
        top = select16(dot > top, dot, top);
        store16(s + p0, dot);
    }
    float m = top[0];
    for (int j = 1; j < LANES; ++j) m = top[j] > m ? top[j] : m;
    return m;
}

/* s[p] <- exp(s[p] - top); returns their sum */
VECTOR_HELPER float exponentiate(float *s, int64_t padded, float top)
{
    vec16 sum = {0};
    for (int64_t p0 = 0; p0 < padded; p0 += LANES) {
        vec16 e = exp_nonpositive(load16(s + p0) - top);
        sum += e;
        store16(s + p0, e);
    }
    return lane_sum(sum);
}

/* out = (sum_p weight[p] v_p) * inv_total, 16 dimensions at a time, positions in VALUE_CHAINS interleaved chains */
VECTOR_HELPER void weighted_values(const float *weight, const float *v, int64_t positions, int64_t dh,
                                   float inv_total, float *out)
{
    for (int64_t d0 = 0; d0 < dh; d0 += LANES) {
        vec16 acc[VALUE_CHAINS] = {{0}};
        int64_t p = 0;
        for (; p + VALUE_CHAINS <= positions; p += VALUE_CHAINS)
            for (int c = 0; c < VALUE_CHAINS; ++c) acc[c] += weight[p + c] * load16(v + (p + c) * dh + d0);
        for (int c = 0; p + c < positions; ++c) acc[c] += weight[p + c] * load16(v + (p + c) * dh + d0);
        store16(out + d0, ((acc[0] + acc[1]) + (acc[2] + acc[3])) * inv_total);
    }
}

/* The same helpers in 8-float vectors, for AVX2 and the baseline. GCC keeps a 16-float vector that is wider than the
   CPU's registers in memory between loop steps, which made the AVX2 version of decode_attention 1.5-2x slower than
   torch's attention at decode shapes (2-core AMD EPYC, process time). These hold each 16-lane quantity as two
   halves, lanes 0-7 and 8-15, and do the same operation on every lane, in the same order, with the same 16-lane
   reduction at the end: so they give the 16-float versions' bits.
   Their natural 32-byte alignment is what lets GCC keep them in registers: declared aligned(4) (as they were until
   2026-12-04, like vec16 above), every 8-float value went through the stack (each load8 as two 16-byte stores and a
   32-byte reload, a store-forwarding stall, and the accumulators spilled). On a Zen 4 capped to AVX2 the AVX2 build
   of sampler_experts took 1.87-2.03 ms per decode-step layer (128 rows, 128 experts, top-8, d64, F32), 273-295 us
   naturally aligned (the AVX-512 version: 210-245 us); decode_attention (64 rows, 4 heads over 2, dh 16, 40
   positions) 414 us, then 48 us; the same bits (loads and stores only moved). */
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

VECTOR_HELPER vec8 load8(const float *p)
{
    vec8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

VECTOR_HELPER void store8(float *p, vec8 x) { memcpy(p, &x, sizeof x); }

VECTOR_HELPER vec8 select8(ivec8 mask, vec8 yes, vec8 no)
{
    return (vec8)(((ivec8)yes & mask) | ((ivec8)no & ~mask));
}

VECTOR_HELPER vec8 exp_in_range8(vec8 x)  /* exp_in_range, lane for lane */
{
    const float log2e = 1.44269504088896341f, round_to_int = 12582912.0f;
    vec8 n = (x * log2e + round_to_int) - round_to_int;
    vec8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vec8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    ivec8 two_n_bits = (__builtin_convertvector(n, ivec8) + 127) << 23;
    return p * (vec8)two_n_bits;
}

VECTOR_HELPER vec8 exp_nonpositive8(vec8 x)
{
    vec8 zero = {0};
    return select8(x < -87.0f, zero, exp_in_range8(x));
}

VECTOR_HELPER float scores_narrow(const float *q, const float *kt, int64_t dh, int64_t k_dim_stride, int64_t padded,
                                  float scale, const float *bias, float *s)
{
    vec8 top_lo = {0}, top_hi = {0};
    top_lo -= __builtin_inff();
    top_hi -= __builtin_inff();
    for (int64_t p0 = 0; p0 < padded; p0 += LANES) {
        vec8 lo = q[0] * load8(kt + p0), hi = q[0] * load8(kt + p0 + 8);
        for (int64_t d = 1; d < dh; ++d) {
            const float *row = kt + d * k_dim_stride + p0;
            lo += q[d] * load8(row);
            hi += q[d] * load8(row + 8);
        }
        lo = lo * scale + load8(bias + p0);
        hi = hi * scale + load8(bias + p0 + 8);
        top_lo = select8(lo > top_lo, lo, top_lo);
        top_hi = select8(hi > top_hi, hi, top_hi);
        store8(s + p0, lo);
        store8(s + p0 + 8, hi);
    }
    float m = top_lo[0];
    for (int j = 1; j < 8; ++j) m = top_lo[j] > m ? top_lo[j] : m;
    for (int j = 0; j < 8; ++j) m = top_hi[j] > m ? top_hi[j] : m;
    return m;
}

VECTOR_HELPER float exponentiate_narrow(float *s, int64_t padded, float top)
{
    vec8 sum_lo = {0}, sum_hi = {0};
    for (int64_t p0 = 0; p0 < padded; p0 += LANES) {
        vec8 lo = exp_nonpositive8(load8(s + p0) - top), hi = exp_nonpositive8(load8(s + p0 + 8) - top);
        sum_lo += lo;
        sum_hi += hi;
        store8(s + p0, lo);
        store8(s + p0 + 8, hi);
    }
    float lane[8];  /* lane_sum's tree: its first step adds lane j + 8 to lane j, the halves' sum */
    store8(lane, sum_lo + sum_hi);
    for (int width = 4; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    return lane[0];
}

VECTOR_HELPER void weighted_values_narrow(const float *weight, const float *v, int64_t positions, int64_t dh,
                                          float inv_total, float *out)
{
    for (int64_t d0 = 0; d0 < dh; d0 += 8) {
        vec8 acc[VALUE_CHAINS] = {{0}};
        int64_t p = 0;
        for (; p + VALUE_CHAINS <= positions; p += VALUE_CHAINS)
            for (int c = 0; c < VALUE_CHAINS; ++c) acc[c] += weight[p + c] * load8(v + (p + c) * dh + d0);
        for (int c = 0; p + c < positions; ++c) acc[c] += weight[p + c] * load8(v + (p + c) * dh + d0);
        store8(out + d0, ((acc[0] + acc[1]) + (acc[2] + acc[3])) * inv_total);
    }
}

/* The kernel's body, inlined into one function per instruction set (below); `narrow` picks the 8-float helpers */
VECTOR_HELPER int64_t decode_attention_body(const float *q, const float *kt, const float *v, int64_t batch,
                                            int64_t heads, int64_t kv_heads, int64_t positions, int64_t dh,
                                            int64_t k_row_stride, int64_t k_head_stride, int64_t k_dim_stride,
                                            int64_t v_row_stride, int64_t v_head_stride, const uint8_t *mask,
                                            float scale, float *out, const int narrow)
{
    const int64_t padded = (positions + LANES - 1) / LANES * LANES;
    if (dh % LANES != 0 || kv_heads < 1 || heads % kv_heads != 0 || positions < 1 || k_dim_stride < padded)
        return -1;
    float *s = malloc(2 * padded * sizeof(float));
    if (s == NULL) return -2;
    float *bias = s + padded;  /* 0 where the row may attend, -inf elsewhere (and past the last position) */
    const int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t p = 0; p < padded; ++p)
            bias[p] = p < positions && (mask == NULL || mask[b * positions + p]) ? 0.0f : -__builtin_inff();
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t g = h / group;
            const float *qh = q + (b * heads + h) * dh;
            const float *keys = kt + b * k_row_stride + g * k_head_stride;
            const float *values = v + b * v_row_stride + g * v_head_stride;
            float *row_out = out + (b * heads + h) * dh;
            if (narrow) {
                float top = scores_narrow(qh, keys, dh, k_dim_stride, padded, scale, bias, s);
                float total = exponentiate_narrow(s, padded, top);
                weighted_values_narrow(s, values, positions, dh, 1.0f / total, row_out);
            } else {
                float top = scores(qh, keys, dh, k_dim_stride, padded, scale, bias, s);
                float total = exponentiate(s, padded, top);
                weighted_values(s, values, positions, dh, 1.0f / total, row_out);
            }
        }
    }
    free(s);
    return 0;
}

/* -DMOE_RL_WIDE_TILES gives every version the 16-float code: a test build, which checks that the two round alike */
#ifdef MOE_RL_WIDE_TILES
#define NARROW_TILES 0
#else
#define NARROW_TILES 1
#endif

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MOE_RL_ONE_VERSION)
/* One version of `name` per instruction set, picked at each call (target_clones cannot give the versions different
   code): CALL(narrow) calls its body with the 16-float tiling (0) or the 8-float one; NAMES are ARGS' names */
#define PER_ISA_VERSIONS(name, ARGS, NAMES, CALL) \
    __attribute__((target("avx512f"))) static int64_t name##_avx512(ARGS) { return CALL(0); } \
    __attribute__((target("avx2"))) static int64_t name##_avx2(ARGS) { return CALL(NARROW_TILES); } \
    static int64_t name##_baseline(ARGS) { return CALL(NARROW_TILES); } \
    int64_t name(ARGS) \
    { \
        __builtin_cpu_init(); \
        if (__builtin_cpu_supports("avx512f")) return name##_avx512(NAMES); \
        if (__builtin_cpu_supports("avx2")) return name##_avx2(NAMES); \
        return name##_baseline(NAMES); \
    }
#elif defined(__AVX512F__)
#define PER_ISA_VERSIONS(name, ARGS, NAMES, CALL) int64_t name(ARGS) { return CALL(0); }
#else
#define PER_ISA_VERSIONS(name, ARGS, NAMES, CALL) int64_t name(ARGS) { return CALL(NARROW_TILES); }
#endif

#define DECODE_ATTENTION_ARGS const float *q, const float *kt, const float *v, int64_t batch, int64_t heads, \
    int64_t kv_heads, int64_t positions, int64_t dh, int64_t k_row_stride, int64_t k_head_stride, \
    int64_t k_dim_stride, int64_t v_row_stride, int64_t v_head_stride, const uint8_t *mask, float scale, float *out
#define DECODE_ATTENTION_NAMES q, kt, v, batch, heads, kv_heads, positions, dh, k_row_stride, k_head_stride, \
    k_dim_stride, v_row_stride, v_head_stride, mask, scale, out
#define DECODE_ATTENTION_CALL(narrow) decode_attention_body(DECODE_ATTENTION_NAMES, narrow)
PER_ISA_VERSIONS(decode_attention, DECODE_ATTENTION_ARGS, DECODE_ATTENTION_NAMES, DECODE_ATTENTION_CALL)

/* ---------------------------------------------------------------------------------------------------------------
   the sampler's experts: every expert's SwiGLU on its token-slots, gate-weighted and summed into each token's row

   x (tokens, d) contiguous; the token-slots sorted by expert (sort_slots): token_N[n] and order_N[n] (the slot t * k
   + j, which indexes weights (tokens * k)), counts[e] slots of expert e in turn. w_gate_up (experts, d, 2f) with the
   gate in its first f columns, w_down (experts, f, d). out (tokens, d) = sum over a token's slots, in sorted order, of
   weight * (silu(x W_gate) * (x W_up)) W_down, the weight applied to the f-wide hidden row.

   Like decode_attention, the sampler's alone (fp32 passes under inference mode) and not torch's bits: four slots of
   one expert at a time stream its weights once, each output vector summing its products in order of the reduced
   dimension, with exp from Cephes' polynomial; every operation a vector one (16 lanes, or 8 in the products' AVX2
   tiling below) in the same order, so every version rounds alike.
   Returns 0, -1 if d or f is not a multiple of 16, the counts do not add up to tokens * k or a slot names a
   token or slot outside them, -2 if out of memory. */

#define SLOT_BLOCK 4

/* silu(g) = g / (1 + exp(-g)), exp's argument clamped to its range (beyond it the quotient is g or 0 anyway) */
VECTOR_HELPER vec16 silu16(vec16 g)
{
    vec16 low = {0}, high = {0};
    low -= 87.0f;
    high += 88.0f;
    vec16 minus_g = -g;
    minus_g = select16(minus_g < low, low, minus_g);
    minus_g = select16(minus_g > high, high, minus_g);
    return g / (exp_in_range(minus_g) + 1.0f);
}

/* The next expert's weights, requested while this expert computes: at the paper's shape each decode step reads every
   layer's experts (3 MB at 128 experts) from memory, and the next expert's are not where the hardware prefetcher
   looks. Two 64-byte lines per step of the products' depth loop, so that one block of four slots asks for all of
   them (256 lines of gate/up weights over its 64 steps, 128 of down weights over 32), towards L2 (the current
   expert's 24 KB stay in L1). Spread out, because a burst of all 384 lines at the expert's start (this kernel's
   prefetching until 2026-12-04) overflowed the core's miss buffers: on a Zen 4 (AVX-512) the kernel over 48 layers'
   weights took 431-438 us per decode step's layer with the burst, 344-390 us without any prefetching, 278-296 us
   with two lines a step (1 a step: 338-356 us; 4: 309-328 us); in cache 210-255 us either way, the same bits
   (benchmarks/bench_prefetch.py times the builds with and without, -DMOE_RL_NO_PREFETCH). A hint: no number changes. */
#define SAMPLER_LINES_PER_STEP 2

struct lines_ahead {
    const char *next, *end;
};

VECTOR_HELPER void bring_ahead(struct lines_ahead *ahead)
{
#ifndef MOE_RL_NO_PREFETCH
    for (int i = 0; i < SAMPLER_LINES_PER_STEP && ahead->next < ahead->end; ++i, ahead->next += 64)
        __builtin_prefetch(ahead->next, 0, 2);
#else
    (void)ahead;
#endif
}

/* rows[i] (SLOT_BLOCK of them, each `width` floats) = sum_k in[i][k] * w[k], for k < depth; w rows `width` apart.
   Four vectors of columns at a time (16 accumulators), so each weight row is read in one sweep. */
VECTOR_HELPER void block_times(const float *const in[SLOT_BLOCK], const float *w, int64_t depth, int64_t width,
                               float *const rows[SLOT_BLOCK], struct lines_ahead *ahead)
{
    int64_t c0 = 0;
    for (; c0 + 4 * LANES <= width; c0 += 4 * LANES) {
        vec16 acc[SLOT_BLOCK][4] = {{{0}}};
        for (int64_t k = 0; k < depth; ++k) {
            bring_ahead(ahead);
            const float *wk = w + k * width + c0;
            vec16 w0 = load16(wk), w1 = load16(wk + LANES), w2 = load16(wk + 2 * LANES), w3 = load16(wk + 3 * LANES);
            for (int i = 0; i < SLOT_BLOCK; ++i) {
                const float a = in[i][k];
                acc[i][0] += a * w0;
                acc[i][1] += a * w1;
                acc[i][2] += a * w2;
                acc[i][3] += a * w3;
            }
        }
        for (int i = 0; i < SLOT_BLOCK; ++i)
            for (int v = 0; v < 4; ++v) store16(rows[i] + c0 + v * LANES, acc[i][v]);
    }
    for (; c0 < width; c0 += LANES) {
        vec16 acc[SLOT_BLOCK] = {{0}};
        for (int64_t k = 0; k < depth; ++k) {
            vec16 wk = load16(w + k * width + c0);
            for (int i = 0; i < SLOT_BLOCK; ++i) acc[i] += in[i][k] * wk;
        }
        for (int i = 0; i < SLOT_BLOCK; ++i) store16(rows[i] + c0, acc[i]);
    }
}

/* AVX2's 16 registers hold 8 floats each: the 16 accumulators of block_times (16 floats each) would take 32 of them
   and spill on every step of k, which made this kernel 3.7-5.3x slower than the grouped path on a 2-core AMD EPYC
   with AVX2 (process time at decode shapes, 128 experts top-8 and 8 top-2). This version keeps two 8-float vectors
   of columns per slot (8 accumulators and 2 weight vectors). Each output still adds its products over k in order,
   each product and sum rounded once, so both versions give the same bits; only the tiling differs. */
VECTOR_HELPER void block_times_narrow(const float *const in[SLOT_BLOCK], const float *w, int64_t depth,
                                      int64_t width, float *const rows[SLOT_BLOCK], struct lines_ahead *ahead)
{
    for (int64_t c0 = 0; c0 < width; c0 += 16) {  /* width is a multiple of 16 */
        vec8 acc[SLOT_BLOCK][2] = {{{0}}};
        for (int64_t k = 0; k < depth; ++k) {
            bring_ahead(ahead);
            vec8 w0 = load8(w + k * width + c0), w1 = load8(w + k * width + c0 + 8);
            for (int i = 0; i < SLOT_BLOCK; ++i) {
                const float a = in[i][k];
                acc[i][0] += a * w0;
                acc[i][1] += a * w1;
            }
        }
        for (int i = 0; i < SLOT_BLOCK; ++i) {
            store8(rows[i] + c0, acc[i][0]);
            store8(rows[i] + c0 + 8, acc[i][1]);
        }
    }
}

/* The kernel's body, inlined into one function per instruction set; `narrow` (a constant in each) picks the tiling
   that fits its registers. */
VECTOR_HELPER int64_t sampler_experts_body(const float *x, int64_t tokens, int64_t d, int64_t f, int64_t k,
                                           const int64_t *token_N, const int64_t *order_N, const float *weights,
                                           const int64_t *counts, int64_t experts, const float *w_gate_up,
                                           const float *w_down, float *out, const int narrow)
{
    if (d % LANES != 0 || f % LANES != 0) return -1;
    int64_t n = 0;
    for (int64_t e = 0; e < experts; ++e) n += counts[e];
    if (n != tokens * k) return -1;
    for (int64_t s = 0; s < n; ++s)
        if (token_N[s] < 0 || token_N[s] >= tokens || order_N[s] < 0 || order_N[s] >= n) return -1;
    float *scratch = malloc(SLOT_BLOCK * (3 * f + d) * sizeof(float));
    if (scratch == NULL) return -2;
    float *gate_up[SLOT_BLOCK], *hidden[SLOT_BLOCK], *y[SLOT_BLOCK];
    for (int i = 0; i < SLOT_BLOCK; ++i) {
        gate_up[i] = scratch + i * 2 * f;
        hidden[i] = scratch + SLOT_BLOCK * 2 * f + i * f;
        y[i] = scratch + SLOT_BLOCK * 3 * f + i * d;
    }
    memset(out, 0, tokens * d * sizeof(float));
    int64_t start = 0;
    for (int64_t e = 0; e < experts; start += counts[e], ++e) {
        const float *wgu = w_gate_up + e * d * 2 * f, *wd = w_down + e * f * d;
        const int64_t next = e + 1 < experts;  /* the last expert has none to bring: an empty range */
        struct lines_ahead gate_up_ahead = {(const char *)(wgu + d * 2 * f),
                                            (const char *)(wgu + (1 + next) * d * 2 * f)};
        struct lines_ahead down_ahead = {(const char *)(wd + f * d), (const char *)(wd + (1 + next) * f * d)};
        for (int64_t s0 = start; s0 < start + counts[e]; s0 += SLOT_BLOCK) {
            const int64_t used = start + counts[e] - s0 < SLOT_BLOCK ? start + counts[e] - s0 : SLOT_BLOCK;
            const float *in[SLOT_BLOCK];
            float gate_weight[SLOT_BLOCK];
            for (int i = 0; i < SLOT_BLOCK; ++i) {  /* unused rows repeat the first; their results are dropped */
                int64_t s = s0 + (i < used ? i : 0);
                in[i] = x + token_N[s] * d;
                gate_weight[i] = weights[order_N[s]];
            }
            if (narrow)
                block_times_narrow(in, wgu, d, 2 * f, gate_up, &gate_up_ahead);
            else
                block_times(in, wgu, d, 2 * f, gate_up, &gate_up_ahead);
            for (int i = 0; i < SLOT_BLOCK; ++i)
                for (int64_t j = 0; j < f; j += LANES)
                    store16(hidden[i] + j, silu16(load16(gate_up[i] + j)) * load16(gate_up[i] + f + j) *
                                               gate_weight[i]);
            if (narrow)
                block_times_narrow((const float *const *)hidden, wd, f, d, y, &down_ahead);
            else
                block_times((const float *const *)hidden, wd, f, d, y, &down_ahead);
            for (int i = 0; i < used; ++i) {
                float *row = out + token_N[s0 + i] * d;
                for (int64_t c = 0; c < d; c += LANES) store16(row + c, load16(row + c) + load16(y[i] + c));
            }
        }
    }
    free(scratch);
    return 0;
}

#define SAMPLER_EXPERTS_ARGS const float *x, int64_t tokens, int64_t d, int64_t f, int64_t k, const int64_t *token_N, \
    const int64_t *order_N, const float *weights, const int64_t *counts, int64_t experts, const float *w_gate_up, \
    const float *w_down, float *out
#define SAMPLER_EXPERTS_NAMES x, tokens, d, f, k, token_N, order_N, weights, counts, experts, w_gate_up, w_down, out
#define SAMPLER_EXPERTS_CALL(narrow) sampler_experts_body(SAMPLER_EXPERTS_NAMES, narrow)
PER_ISA_VERSIONS(sampler_experts, SAMPLER_EXPERTS_ARGS, SAMPLER_EXPERTS_NAMES, SAMPLER_EXPERTS_CALL)

/* ---------------------------------------------------------------------------------------------------------------
   SwiGLU of the experts' hidden rows, forward and backward, each row optionally times its gate weight

   gate_up (rows, 2f), contiguous, holds each row's gate in its first f columns and its up in the other f.
   Forward (grad NULL): out (rows, f) = h = silu(gate) * up, with silu(x) = x / (1 + exp(-x)); with weight (rows)
   given, h * weight[r] (torch's `swiglu(gate_up) * weight[:, None]`).
   Backward, for the gradient `grad` (rows, f) of that output: dh = grad (grad * weight[r] with a weight); out
   (rows, 2f) = the gate's gradient silu_backward(dh * up, gate) = (dy * s) * (1 + x * (1 - s)),
   s = 1 / (1 + exp(-x)), beside the up's, dh * silu(gate); with a weight and out2 given, out2 (rows, f) =
   grad * h, whose row sums (the caller's torch sum) are the weights' gradient.
   These are the operations, in the order of torch's CPU kernels for silu, silu_backward and mul, each rounded once,
   with torch's own exp: the caller (activation.py) passes the Sleef function torch's vectors call (16 lanes on
   AVX-512, 8 on AVX2) or, for the scalar version (lanes 1), the C library's expf that torch's baseline code calls.
   `fused` says whether 1 + x * (1 - s) is one fused multiply-add (with vectors only), as the compiler that built
   torch's vector kernels may have made it. None of this promises torch's bits on a given torch build, so
   activation.py compares each way with torch once per width and process and uses the kernel only where one agreed.
   torch's loops take two vectors per step and compute what is left of a row with scalar code, so the vector
   versions take only widths that leave nothing (f a multiple of 2 * lanes).
   Returns 0, -1 for a width the version does not take, -3 if the build or the CPU lacks its vectors. */

typedef float (*exp1_fn)(float);

#define SWIGLU_ARGS const float *gate_up, const float *grad, const float *weight, int64_t rows, int64_t f, float *out, \
    float *out2

static void swiglu_scalar(exp1_fn exp1, SWIGLU_ARGS)
{
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * f, *up = gate + f;
        for (int64_t j = 0; j < f; ++j) {
            float x = gate[j], e = exp1(-x);
            float silu = x / (1.0f + e);
            if (grad == NULL) {
                float h = silu * up[j];
                out[r * f + j] = weight != NULL ? h * weight[r] : h;
                continue;
            }
            float dh = grad[r * f + j];
            if (weight != NULL) {
                if (out2 != NULL) out2[r * f + j] = dh * (silu * up[j]);
                dh = dh * weight[r];
            }
            float s = 1.0f / (1.0f + e);
            float dy = dh * up[j];
            out[r * 2 * f + j] = dy * s * (1.0f + x * (1.0f - s));
            out[r * 2 * f + f + j] = dh * silu;
        }
    }
}

#ifdef AVX512_KERNELS
typedef __m512 (*exp16_fn)(__m512);

__attribute__((target("avx512f")))
static void swiglu_avx512(exp16_fn exp16, int fused, SWIGLU_ARGS)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * f, *up = gate + f;
        const __m512 w = _mm512_set1_ps(weight != NULL ? weight[r] : 1.0f);
        for (int64_t j = 0; j < f; j += 16) {
            __m512 x = _mm512_loadu_ps(gate + j);
            __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            __m512 silu = _mm512_div_ps(x, denominator);
            if (grad == NULL) {
                __m512 h = _mm512_mul_ps(silu, _mm512_loadu_ps(up + j));
                _mm512_storeu_ps(out + r * f + j, weight != NULL ? _mm512_mul_ps(h, w) : h);
                continue;
            }
            __m512 dh = _mm512_loadu_ps(grad + r * f + j), s = _mm512_div_ps(one, denominator);
            if (weight != NULL) {
                if (out2 != NULL)
                    _mm512_storeu_ps(out2 + r * f + j, _mm512_mul_ps(dh, _mm512_mul_ps(silu, _mm512_loadu_ps(up + j))));
                dh = _mm512_mul_ps(dh, w);
            }
            __m512 dy = _mm512_mul_ps(dh, _mm512_loadu_ps(up + j));
            __m512 one_minus_s = _mm512_sub_ps(one, s);
            __m512 slope = fused ? _mm512_fmadd_ps(x, one_minus_s, one)
                                 : _mm512_add_ps(one, _mm512_mul_ps(x, one_minus_s));
            _mm512_storeu_ps(out + r * 2 * f + j, _mm512_mul_ps(_mm512_mul_ps(dy, s), slope));
            _mm512_storeu_ps(out + r * 2 * f + f + j, _mm512_mul_ps(dh, silu));
        }
    }
}
#endif

#ifdef AVX2_KERNELS
typedef __m256 (*exp8_fn)(__m256);

__attribute__((target("avx2,fma")))
static void swiglu_avx2(exp8_fn exp8, int fused, SWIGLU_ARGS)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * f, *up = gate + f;
        const __m256 w = _mm256_set1_ps(weight != NULL ? weight[r] : 1.0f);
        for (int64_t j = 0; j < f; j += 8) {
            __m256 x = _mm256_loadu_ps(gate + j);
            __m256 denominator = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
            __m256 silu = _mm256_div_ps(x, denominator);
            if (grad == NULL) {
                __m256 h = _mm256_mul_ps(silu, _mm256_loadu_ps(up + j));
                _mm256_storeu_ps(out + r * f + j, weight != NULL ? _mm256_mul_ps(h, w) : h);
                continue;
            }
            __m256 dh = _mm256_loadu_ps(grad + r * f + j), s = _mm256_div_ps(one, denominator);
            if (weight != NULL) {
                if (out2 != NULL)
                    _mm256_storeu_ps(out2 + r * f + j, _mm256_mul_ps(dh, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j))));
                dh = _mm256_mul_ps(dh, w);
            }
            __m256 dy = _mm256_mul_ps(dh, _mm256_loadu_ps(up + j));
            __m256 one_minus_s = _mm256_sub_ps(one, s);
            __m256 slope = fused ? _mm256_fmadd_ps(x, one_minus_s, one)
                                 : _mm256_add_ps(one, _mm256_mul_ps(x, one_minus_s));
            _mm256_storeu_ps(out + r * 2 * f + j, _mm256_mul_ps(_mm256_mul_ps(dy, s), slope));
            _mm256_storeu_ps(out + r * 2 * f + f + j, _mm256_mul_ps(dh, silu));
        }
    }
}
#endif

int64_t swiglu(int64_t lanes, const void *exp, int64_t fused, SWIGLU_ARGS)
{
    if (lanes == 1) {
        if (fused) return -1;
        swiglu_scalar((exp1_fn)exp, gate_up, grad, weight, rows, f, out, out2);
        return 0;
    }
    if (f % (2 * lanes) != 0) return -1;
#ifdef AVX512_KERNELS
    if (lanes == 16 && __builtin_cpu_supports("avx512f")) {
        swiglu_avx512((exp16_fn)exp, (int)fused, gate_up, grad, weight, rows, f, out, out2);
        return 0;
    }
#endif
#ifdef AVX2_KERNELS
    if (lanes == 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        swiglu_avx2((exp8_fn)exp, (int)fused, gate_up, grad, weight, rows, f, out, out2);
        return 0;
    }
#endif
    return -3;
}
