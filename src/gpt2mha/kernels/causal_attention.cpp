/* Causal self-attention for prefills on the CPU: the operator torch.ops.gpt2mha.causal_attention
 * (in the library build.py compiles; called by gpt2mha.inference.fast.PrefillAttention).
 *
 *   o[i] = sum_{j <= i + S - T} softmax_j(q[i] . k[j] / sqrt(D)) v[j]
 *
 * q [B, h, T, D], k and v [B, h, S, D] float32 (any strides but the last, 1), OpenAI's
 * bottom-right causal mask (query i sees keys 0 .. i + S - T); o float32 [B, h, T, D], laid out
 * [B, T, h, D] (the heads merge with a free reshape).
 *
 * Why: PyTorch's CPU flash kernel skips masked keys only in
 * blocks of 512, so up to 512 tokens it computes every score of the square and drops half;
 * split into blocks of queries, each SDPA call costs more than its share. Here each query row
 * computes only the scores it keeps. Each head's keys are first copied transposed (kt [D, S]
 * zero-padded to 16 keys); then work is shared out as blocks of ROWS query rows of one head:
 *   scores: up to 6 rows x 16 keys per pass, FMAs over d in order (one fixed sum per score),
 *   softmax: per row, max, exp((s - max) * scale) (simd.h), sum in 8 lanes then a fixed
 *     reduction; a NaN score or a non-finite max gives a NaN row (as SDPA),
 *   o: 4 rows x 16 dims per pass, FMAs over each row's own keys in order, divided by its sum.
 * Every value a row gets is computed the same way whatever the other rows, heads, batch and
 * threads are (batch invariance). On AVX-512 CPUs (dispatch.h's ATTENTION) the same sums run on
 * 16 lanes: 8 rows x 32 keys per scores pass, 4 rows x 64 dims per o pass, exp on 16 lanes; each
 * lane's operations are those of the AVX2 path, so both give the same bits. A 512-bit FMA does
 * twice a 256-bit one's work on Zen 5 (one 256-bit FMA's on Zen 4), where the 16-lane path takes
 * between about half and three quarters of the 8-lane path's time over 124M's 12 layers of prefill
 * attention.
 *
 * causal_attention_bf16 (the operator of that name; cached_forward.cpp runs it for a bf16 model's prompts
 * where the CPU has AVX-512 BF16): the same tasks for q, k, v holding bf16 values (rounded to bf16 first),
 * scores and p v by vdpbf16ps over pairs (two multiply-adds an instruction where an FMA does one):
 *   scores: 8 rows x 32 keys per pass over each key's (d, d + 1) pairs in order, the odd product added
 *     first in each pair (bf16_products.cpp's order; a subnormal input or sum is flushed to zero),
 *   softmax: softmax_row16's, then the row's exps rounded to bf16 (as SDPA's flash kernel rounds them
 *     for bf16, and the decode step's attend), their sum taken before rounding,
 *   o: 4 rows x 64 dims per pass over pairs of keys (2m, 2m + 1) in order, odd key first; a row whose
 *     last pair has one of its keys zeroes the other's weight and value (a later value cannot reach it).
 * A row's result is the same in any batch, tile or block (the native forward's last block computes the
 * last query alone). Why: on float32 lanes a bf16 prompt's attention is a large share of what its
 * prefill spends beyond the products (docs/performance.md, where the float steps' time goes).
 */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "dispatch.h"
#include "kernels.h"

namespace {

constexpr int64_t ROWS = 32;            /* query rows per task */
constexpr int PV_ROWS = 4, PV_DT = 2;   /* o = p v: rows x 8 PV_DT dims per pass */

struct Head {
    const float *q, *v;
    int64_t qs, vs;                     /* row strides (elements) */
    float *o;
    int64_t os;
};

/* scores s[r][j] = q[r] . kt[:, j] for MT rows and 16 keys from j0 (kt: D rows of n16 keys) */
template <int MT>
static inline void scores_tile(const float *const *qr, const float *kt, int64_t n16, int64_t D, int64_t j0,
                               float *const *sr) {
    __m256 acc[MT][2];
    for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * n16 + j0), k1 = _mm256_loadu_ps(kt + d * n16 + j0 + 8);
        for (int r = 0; r < MT; r++) {
            const __m256 qb = _mm256_broadcast_ss(qr[r] + d);
            acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < MT; r++) {
        _mm256_storeu_ps(sr[r] + j0, acc[r][0]);
        _mm256_storeu_ps(sr[r] + j0 + 8, acc[r][1]);
    }
}

}  // namespace

/* the largest of s[0 .. n) into m; false when a score is NaN or the largest is not finite */
static bool row_max(const float *s, int64_t n, float &m) {
    __m256 mx = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(s + j);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mx);
    m = m8[0];
    for (int i = 1; i < 8; i++) m = std::fmax(m, m8[i]);
    bool nan = _mm256_movemask_ps(bad) != 0;
    for (int64_t t = j; t < n; t++) {
        nan |= std::isnan(s[t]);
        m = std::fmax(m, s[t]);
    }
    return !nan && std::isfinite(m);
}

/* softmax_row from score j on (j a multiple of 8), the 8-lane sum of the exps before j in sum:
 * 8 at a time into sum, its fixed reduction, then one by one; returns the total */
static float exp_rest(float *s, int64_t j, int64_t n, float m, float scale, __m256 sum) {
    const __m256 sc = _mm256_set1_ps(scale), mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv), sc));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float s8[8];
    _mm256_store_ps(s8, sum);
    float total = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
    for (; j < n; j++) {
        s[j] = exp1((s[j] - m) * scale);
        total += s[j];
    }
    return total;
}

/* row s[0 .. n) -> exp(scale * (s - max)) in place; returns their sum, or NaN when a score is
 * NaN or the largest is not finite (as SDPA's NaN row); (s - max) first: exact for the largest
 * scores (Sterbenz), so huge scores keep their gaps; kernels.h */
float softmax_row(float *s, int64_t n, float scale) {
    float m;
    if (!row_max(s, n, m))
        return NAN;
    return exp_rest(s, 0, n, m, scale, _mm256_setzero_ps());
}

/* softmax_row's operations with the exps on 16 lanes: the same bits (each 16 added to the 8-lane
 * sum as its two halves, in order) */
TARGET_AVX512 static float softmax_row16(float *s, int64_t n, float scale) {
    float m;
    if (!row_max(s, n, m))
        return NAN;
    const __m512 sc = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv), sc));
        _mm512_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e, 1));
    }
    return exp_rest(s, j, n, m, scale, sum);
}

namespace {

/* o[r][d0 .. d0 + 8 DT) = sum_{j < n0 + r} p[r][j] v[j][d0 ..] / total[r] for MT consecutive
 * rows (row r sees n0 + r keys): all rows over keys 0 .. n0, then each row over its own last
 * keys; every row's sum runs over its keys in order, whatever rows share the pass */
template <int MT, int DT>
static inline void out_tile(const float *const *pr, const float *v, int64_t vs, int64_t n0, int64_t d0,
                            const float *inv, float *const *orow) {
    __m256 acc[MT][DT];
    for (int r = 0; r < MT; r++)
        for (int t = 0; t < DT; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n0; j++) {
        __m256 vj[DT];
        for (int t = 0; t < DT; t++) vj[t] = _mm256_loadu_ps(v + j * vs + d0 + 8 * t);
        for (int r = 0; r < MT; r++) {
            const __m256 p = _mm256_broadcast_ss(pr[r] + j);
            for (int t = 0; t < DT; t++) acc[r][t] = _mm256_fmadd_ps(p, vj[t], acc[r][t]);
        }
    }
    for (int e = 0; e + 1 < MT; e++) {
        const int64_t j = n0 + e;
        __m256 vj[DT];
        for (int t = 0; t < DT; t++) vj[t] = _mm256_loadu_ps(v + j * vs + d0 + 8 * t);
        for (int r = e + 1; r < MT; r++) {
            const __m256 p = _mm256_broadcast_ss(pr[r] + j);
            for (int t = 0; t < DT; t++) acc[r][t] = _mm256_fmadd_ps(p, vj[t], acc[r][t]);
        }
    }
    for (int r = 0; r < MT; r++) {
        const __m256 iv = _mm256_set1_ps(inv[r]);
        for (int t = 0; t < DT; t++) _mm256_storeu_ps(orow[r] + d0 + 8 * t, _mm256_mul_ps(acc[r][t], iv));
    }
}

/* 8 x 8 floats: dst[c * dstride + r] = src[r * sstride + c] */
static inline void transpose8(const float *src, int64_t sstride, float *dst, int64_t dstride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * sstride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * dstride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * dstride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* kt [D, n16] = keys 0 .. S of one head transposed, zero past S */
static void transpose_keys(const float *k, int64_t ks, int64_t S, int64_t D, int64_t n16, float *kt) {
    int64_t j0 = 0;
    for (; j0 + 8 <= S; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) transpose8(k + j0 * ks + d0, ks, kt + d0 * n16 + j0, n16);
    for (int64_t d = 0; d < D; d++) {
        for (int64_t j = j0; j < S; j++) kt[d * n16 + j] = k[j * ks + d];
        for (int64_t j = S; j < n16; j++) kt[d * n16 + j] = 0.0f;
    }
}

/* rows i0 .. i1 whose softmax gave NaN (inv) written as NaN, one value whatever the path (the
 * product of NaNs keeps one operand's sign, which the two paths' instructions pick differently) */
static void nan_rows(const Head &H, const float *inv, int64_t i0, int64_t i1, int64_t D) {
    for (int64_t i = i0; i < i1; i++)
        if (std::isnan(inv[i - i0]))
            for (int64_t d = 0; d < D; d++) H.o[i * H.os + d] = NAN;
}

/* rows i0 .. i1 of one head, its keys transposed in kt [D, n16]; off = S - T */
static void block(const Head &H, const float *kt, int64_t n16, int64_t i0, int64_t i1, int64_t off, int64_t D,
                  float scale, std::vector<float> &sc) {
    sc.resize(ROWS * n16);
    const float *qr[6];
    float *sr[6];
    for (int64_t r0 = i0; r0 < i1; r0 += 6) {
        const int mt = (int)std::min<int64_t>(6, i1 - r0);
        for (int r = 0; r < mt; r++) {
            qr[r] = H.q + (r0 + r) * H.qs;
            sr[r] = sc.data() + (r0 + r - i0) * n16;
        }
        const int64_t need = r0 + mt - 1 + off + 1;      /* keys the last row of the pass sees */
        for (int64_t j0 = 0; j0 < need; j0 += 16) {
            switch (mt) {
                case 6: scores_tile<6>(qr, kt, n16, D, j0, sr); break;
                case 5: scores_tile<5>(qr, kt, n16, D, j0, sr); break;
                case 4: scores_tile<4>(qr, kt, n16, D, j0, sr); break;
                case 3: scores_tile<3>(qr, kt, n16, D, j0, sr); break;
                case 2: scores_tile<2>(qr, kt, n16, D, j0, sr); break;
                default: scores_tile<1>(qr, kt, n16, D, j0, sr); break;
            }
        }
    }
    float inv[ROWS];
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n = i + off + 1;
        inv[i - i0] = 1.0f / softmax_row(sc.data() + (i - i0) * n16, n, scale);
    }
    const float *pr[PV_ROWS];
    float *orow[PV_ROWS];
    for (int64_t r0 = i0; r0 < i1; r0 += PV_ROWS) {
        const int mt = (int)std::min<int64_t>(PV_ROWS, i1 - r0);
        for (int r = 0; r < mt; r++) {
            pr[r] = sc.data() + (r0 + r - i0) * n16;
            orow[r] = H.o + (r0 + r) * H.os;
        }
        const int64_t n = r0 + off + 1;                   /* the first row's keys; row r sees n + r */
        const float *iv = inv + (r0 - i0);
        for (int64_t d0 = 0; d0 < D; d0 += 8 * PV_DT) {
            if (d0 + 8 * PV_DT <= D) {
                switch (mt) {
                    case 6: out_tile<6, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                    case 5: out_tile<5, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                    case 4: out_tile<4, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                    case 3: out_tile<3, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                    case 2: out_tile<2, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                    default: out_tile<1, PV_DT>(pr, H.v, H.vs, n, d0, iv, orow); break;
                }
            } else {
                for (int64_t d = d0; d < D; d += 8)
                    for (int r = 0; r < mt; r++) out_tile<1, 1>(pr + r, H.v, H.vs, n + r, d, iv + r, orow + r);
            }
        }
    }
    nan_rows(H, inv, i0, i1, D);
}

/* The same on 16 lanes (AVX-512): scores of MT rows x 16 KT keys from j0 (kt: D rows of nk keys),
 * each lane's FMAs over d in order as scores_tile's */
template <int MT, int KT>
TARGET_AVX512 static inline void scores_tile16(const float *const *qr, const float *kt, int64_t nk, int64_t D,
                                               int64_t j0, float *const *sr) {
    __m512 acc[MT][KT];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < KT; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 kv[KT];
        for (int c = 0; c < KT; c++) kv[c] = _mm512_loadu_ps(kt + d * nk + j0 + 16 * c);
        for (int r = 0; r < MT; r++) {
            const __m512 qb = _mm512_set1_ps(qr[r][d]);
            for (int c = 0; c < KT; c++) acc[r][c] = _mm512_fmadd_ps(qb, kv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < KT; c++) _mm512_storeu_ps(sr[r] + j0 + 16 * c, acc[r][c]);
}

/* out_tile on 16 lanes: o[r][d0 .. d0 + 16 DT) for MT rows, each lane's sum over the row's keys in order */
template <int MT, int DT>
TARGET_AVX512 static inline void out_tile16(const float *const *pr, const float *v, int64_t vs, int64_t n0, int64_t d0,
                                            const float *inv, float *const *orow) {
    __m512 acc[MT][DT];
    for (int r = 0; r < MT; r++)
        for (int t = 0; t < DT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n0; j++) {
        __m512 vj[DT];
        for (int t = 0; t < DT; t++) vj[t] = _mm512_loadu_ps(v + j * vs + d0 + 16 * t);
        for (int r = 0; r < MT; r++) {
            const __m512 p = _mm512_set1_ps(pr[r][j]);
            for (int t = 0; t < DT; t++) acc[r][t] = _mm512_fmadd_ps(p, vj[t], acc[r][t]);
        }
    }
    for (int e = 0; e + 1 < MT; e++) {
        const int64_t j = n0 + e;
        __m512 vj[DT];
        for (int t = 0; t < DT; t++) vj[t] = _mm512_loadu_ps(v + j * vs + d0 + 16 * t);
        for (int r = e + 1; r < MT; r++) {
            const __m512 p = _mm512_set1_ps(pr[r][j]);
            for (int t = 0; t < DT; t++) acc[r][t] = _mm512_fmadd_ps(p, vj[t], acc[r][t]);
        }
    }
    for (int r = 0; r < MT; r++) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int t = 0; t < DT; t++) _mm512_storeu_ps(orow[r] + d0 + 16 * t, _mm512_mul_ps(acc[r][t], iv));
    }
}

/* block() on 16 lanes (kt padded to nk, a multiple of 32 keys): the same values */
constexpr int SC_ROWS16 = 8;
TARGET_AVX512 static void block16(const Head &H, const float *kt, int64_t nk, int64_t i0, int64_t i1, int64_t off,
                                  int64_t D, float scale, std::vector<float> &sc) {
    sc.resize(ROWS * nk);
    const float *qr[SC_ROWS16];
    float *sr[SC_ROWS16];
    for (int64_t r0 = i0; r0 < i1; r0 += SC_ROWS16) {
        const int mt = (int)std::min<int64_t>(SC_ROWS16, i1 - r0);
        for (int r = 0; r < mt; r++) {
            qr[r] = H.q + (r0 + r) * H.qs;
            sr[r] = sc.data() + (r0 + r - i0) * nk;
        }
        const int64_t need = r0 + mt - 1 + off + 1;      /* keys the last row of the pass sees */
        for (int64_t j0 = 0; j0 < need;) {
            const bool two = need - j0 > 16;             /* 32 keys, else 16 */
#define SCORES16(M) (two ? scores_tile16<M, 2>(qr, kt, nk, D, j0, sr) : scores_tile16<M, 1>(qr, kt, nk, D, j0, sr))
            switch (mt) {
                case 8: SCORES16(8); break;
                case 7: SCORES16(7); break;
                case 6: SCORES16(6); break;
                case 5: SCORES16(5); break;
                case 4: SCORES16(4); break;
                case 3: SCORES16(3); break;
                case 2: SCORES16(2); break;
                default: SCORES16(1); break;
            }
#undef SCORES16
            j0 += two ? 32 : 16;
        }
    }
    float inv[ROWS];
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n = i + off + 1;
        inv[i - i0] = 1.0f / softmax_row16(sc.data() + (i - i0) * nk, n, scale);
    }
    const float *pr[PV_ROWS];
    float *orow[PV_ROWS];
    for (int64_t r0 = i0; r0 < i1; r0 += PV_ROWS) {
        const int mt = (int)std::min<int64_t>(PV_ROWS, i1 - r0);
        for (int r = 0; r < mt; r++) {
            pr[r] = sc.data() + (r0 + r - i0) * nk;
            orow[r] = H.o + (r0 + r) * H.os;
        }
        const int64_t n = r0 + off + 1;                   /* the first row's keys; row r sees n + r */
        const float *iv = inv + (r0 - i0);
        int64_t d0 = 0;
#define OUT16(DT)                                                                               \
        switch (mt) {                                                                           \
            case 4: out_tile16<4, DT>(pr, H.v, H.vs, n, d0, iv, orow); break;                   \
            case 3: out_tile16<3, DT>(pr, H.v, H.vs, n, d0, iv, orow); break;                   \
            case 2: out_tile16<2, DT>(pr, H.v, H.vs, n, d0, iv, orow); break;                   \
            default: out_tile16<1, DT>(pr, H.v, H.vs, n, d0, iv, orow); break;                  \
        }
        for (; d0 + 64 <= D; d0 += 64) OUT16(4)
        for (; d0 + 16 <= D; d0 += 16) OUT16(1)
#undef OUT16
        for (; d0 < D; d0 += 8)                           /* the last 8 dims of a D = 16 k + 8 */
            for (int r = 0; r < mt; r++) out_tile<1, 1>(pr + r, H.v, H.vs, n + r, d0, iv + r, orow + r);
    }
    nan_rows(H, inv, i0, i1, D);
}

/* ---- a bf16 model's prompt attention on AVX-512 BF16 (causal_attention_bf16) ---- */

/* x [0 .. n) as bf16 into out [0 .. n2) (n2 >= n, a multiple of 2), zeros from n: in memory the pairs
 * (x[2m], x[2m + 1]) vdpbf16ps multiplies, the even one in the low half */
TARGET_AVX512_BF16 static void bf16_row(const float *x, int64_t n, int64_t n2, uint16_t *out) {
    for (int64_t i = 0; i < n2; i += 16) {
        const int64_t left = std::min<int64_t>(16, n2 - i), have = std::clamp<int64_t>(n - i, 0, 16);
        const __m512 f = _mm512_maskz_loadu_ps((__mmask16)((1u << have) - 1), x + i);
        _mm256_mask_storeu_epi16(out + i, (__mmask16)((1u << left) - 1), _mm512_cvtepi32_epi16(bf16_lanes(f)));
    }
}

/* two rows a, b [0 .. n) (b NULL: zeros) as n pairs (a[i], b[i]) of bf16, a in the low half */
TARGET_AVX512_BF16 static void bf16_pairs(const float *a, const float *b, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = (__mmask16)((1u << std::min<int64_t>(16, n - i)) - 1);
        const __m512i lo = bf16_lanes(_mm512_maskz_loadu_ps(mk, a + i));
        const __m512i hi = b ? bf16_lanes(_mm512_maskz_loadu_ps(mk, b + i)) : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(out + i, mk, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* scores s[r][j0 .. j0 + 16 KT) = q[r] . k[j] for MT rows: qp[r] the row's D2 pairs (q[2m], q[2m + 1]), kp
 * [D2, nk] each key's pairs (k[j][2m], k[j][2m + 1]); per score acc = 0, then for m = 0, 1, ..: vdpbf16ps
 * adds the odd product, then the even one */
template <int MT, int KT>
TARGET_AVX512_BF16 static inline void scores_pairs(const uint32_t *const *qp, const uint32_t *kp, int64_t nk, int64_t D2,
                                            int64_t j0, float *const *sr) {
    __m512 acc[MT][KT];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < KT; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t m = 0; m < D2; m++) {
        __m512bh kv[KT];
        for (int c = 0; c < KT; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + m * nk + j0 + 16 * c);
        for (int r = 0; r < MT; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r][m]);
            for (int c = 0; c < KT; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < KT; c++) _mm512_storeu_ps(sr[r] + j0 + 16 * c, acc[r][c]);
}

/* o[r][d0 .. d0 + 16 DT) (not FULL: the last vector's first 8) = inv[r] * sum over row r's n0 + r keys
 * of p v, by vdpbf16ps over key pairs in order: pp[r] row r's p as bf16 pairs (zero past its keys), vp
 * [S2, D] the values of key pairs (v[2m][d], v[2m + 1][d]). All rows take the pairs whose keys every row
 * sees, then each row its own last pairs; a pair with only its even key seen has its odd value zeroed
 * too (0 x 0: a non-finite later value cannot reach the row). A row's chain is the same in any tile. */
template <int MT, int DT, bool FULL>
TARGET_AVX512_BF16 static inline void out_pairs(const uint32_t *const *pp, const uint32_t *vp, int64_t D, int64_t n0,
                                         int64_t d0, const float *inv, float *const *orow) {
    const __mmask16 last = FULL ? (__mmask16)0xFFFF : (__mmask16)0xFF;     /* a part tile: the last 8 dims */
    /* (whole tiles load unmasked: GCC 12 takes a masked load as reading any memory, then stores every
     * accumulator around it: bf16_products.cpp's pair_step) */
#define LOAD(a, t) (FULL || (t) + 1 < DT ? _mm512_loadu_si512(a) : _mm512_maskz_loadu_epi32(last, a))
    __m512 acc[MT][DT];
    for (int r = 0; r < MT; r++)
        for (int t = 0; t < DT; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t common = n0 / 2;
    for (int64_t m = 0; m < common; m++) {
        __m512bh vj[DT];
        for (int t = 0; t < DT; t++)
            vj[t] = (__m512bh)LOAD(vp + m * D + d0 + 16 * t, t);
        for (int r = 0; r < MT; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r][m]);
            for (int t = 0; t < DT; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], pb, vj[t]);
        }
    }
    for (int r = 0; r < MT; r++) {
        const int64_t n = n0 + r;
        for (int64_t m = common; 2 * m < n; m++) {
            const __m512i keep = _mm512_set1_epi32(2 * m + 1 < n ? -1 : 0xFFFF);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r][m]);
            for (int t = 0; t < DT; t++) {
                const __m512i v = LOAD(vp + m * D + d0 + 16 * t, t);
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], pb, (__m512bh)_mm512_and_si512(v, keep));
            }
        }
    }
#undef LOAD
    for (int r = 0; r < MT; r++) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int t = 0; t < DT; t++)
            if (FULL || t + 1 < DT)
                _mm512_storeu_ps(orow[r] + d0 + 16 * t, _mm512_mul_ps(acc[r][t], iv));
            else
                _mm512_mask_storeu_ps(orow[r] + d0 + 16 * t, last, _mm512_mul_ps(acc[r][t], iv));
    }
}

/* block16 for a bf16 model: rows i0 .. i1 of one head; kp [D/2, nk] its keys' pairs, vp [S2, D] its
 * values' pairs; qb, pb scratch. Scores and p v by vdpbf16ps, the softmax on float32 (softmax_row16's),
 * each row's exps rounded to bf16 before p v (as SDPA's flash kernel and the decode step's attend do),
 * its sum taken before rounding. */
TARGET_AVX512_BF16 static void block_bf16(const Head &H, const uint32_t *kp, const uint32_t *vp, int64_t nk, int64_t i0,
                                   int64_t i1, int64_t off, int64_t D, float scale, std::vector<float> &sc,
                                   std::vector<uint16_t> &qb, std::vector<uint16_t> &pb) {
    const int64_t D2 = D / 2;
    sc.resize(ROWS * nk);
    qb.resize(ROWS * D);
    pb.resize(ROWS * nk);
    for (int64_t i = i0; i < i1; i++) bf16_row(H.q + i * H.qs, D, D, qb.data() + (i - i0) * D);
    const uint32_t *qr[SC_ROWS16];
    float *sr[SC_ROWS16];
    for (int64_t r0 = i0; r0 < i1; r0 += SC_ROWS16) {
        const int mt = (int)std::min<int64_t>(SC_ROWS16, i1 - r0);
        for (int r = 0; r < mt; r++) {
            qr[r] = reinterpret_cast<const uint32_t *>(qb.data() + (r0 + r - i0) * D);
            sr[r] = sc.data() + (r0 + r - i0) * nk;
        }
        const int64_t need = r0 + mt - 1 + off + 1;      /* keys the last row of the pass sees */
        for (int64_t j0 = 0; j0 < need;) {
            const bool two = need - j0 > 16;
#define SCORES(M) (two ? scores_pairs<M, 2>(qr, kp, nk, D2, j0, sr) : scores_pairs<M, 1>(qr, kp, nk, D2, j0, sr))
            switch (mt) {
                case 8: SCORES(8); break;
                case 7: SCORES(7); break;
                case 6: SCORES(6); break;
                case 5: SCORES(5); break;
                case 4: SCORES(4); break;
                case 3: SCORES(3); break;
                case 2: SCORES(2); break;
                default: SCORES(1); break;
            }
#undef SCORES
            j0 += two ? 32 : 16;
        }
    }
    float inv[ROWS];
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n = i + off + 1;
        float *s = sc.data() + (i - i0) * nk;
        inv[i - i0] = 1.0f / softmax_row16(s, n, scale);
        bf16_row(s, n, (n + 1) / 2 * 2, pb.data() + (i - i0) * nk);     /* out_pairs reads the row's pairs only */
    }
    const uint32_t *pr[PV_ROWS];
    float *orow[PV_ROWS];
    for (int64_t r0 = i0; r0 < i1; r0 += PV_ROWS) {
        const int mt = (int)std::min<int64_t>(PV_ROWS, i1 - r0);
        for (int r = 0; r < mt; r++) {
            pr[r] = reinterpret_cast<const uint32_t *>(pb.data() + (r0 + r - i0) * nk);
            orow[r] = H.o + (r0 + r) * H.os;
        }
        const int64_t n = r0 + off + 1;                   /* the first row's keys; row r sees n + r */
        const float *iv = inv + (r0 - i0);
        int64_t d0 = 0;
#define OUT(DT, FULL)                                                                           \
        switch (mt) {                                                                           \
            case 4: out_pairs<4, DT, FULL>(pr, vp, D, n, d0, iv, orow); break;                   \
            case 3: out_pairs<3, DT, FULL>(pr, vp, D, n, d0, iv, orow); break;                   \
            case 2: out_pairs<2, DT, FULL>(pr, vp, D, n, d0, iv, orow); break;                   \
            default: out_pairs<1, DT, FULL>(pr, vp, D, n, d0, iv, orow); break;                  \
        }
        for (; d0 + 64 <= D; d0 += 64) OUT(4, true)
        for (; d0 + 16 <= D; d0 += 16) OUT(1, true)
        if (d0 < D) OUT(1, false)                         /* the last 8 dims of a D = 16 k + 8 */
#undef OUT
    }
    nan_rows(H, inv, i0, i1, D);
}

static void check(const at::Tensor &t, const char *op, const char *name) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(3) == 1,
                op, ": ", name, " must be a float32 CPU tensor [B, h, T, D] whose last dimension "
                "is contiguous; got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

/* the operators' checks of q, k, v (op: the operator's name in the messages) */
static void check_all(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const char *op) {
    check(q, op, "q");
    check(k, op, "k");
    check(v, op, "v");
    const int64_t B = q.size(0), h = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
    TORCH_CHECK(k.size(0) == B && k.size(1) == h && k.size(3) == D && v.sizes() == k.sizes(),
                op, ": k and v must be [B=", B, ", h=", h, ", S, D=", D, "]; got k ", k.sizes(), ", v ", v.sizes());
    TORCH_CHECK(D % 8 == 0 && D > 0, op, ": head_dim=", D, " must be a positive multiple of 8");
    TORCH_CHECK(T >= 1 && S >= T, op, ": needs 1 <= T <= S (queries are the last T positions); got T=", T, ", S=", S);
}

}  // namespace

at::Tensor causal_attention_bf16(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    check_all(q, k, v, "causal_attention_bf16");
    TORCH_CHECK(dispatch::on(dispatch::ATTENTION_BF16), "causal_attention_bf16: needs a CPU with AVX-512 and AVX-512 "
                "BF16, both allowed (gpt2mha.kernels.dispatch.allow); causal_attention is the float32 kernel");
    const int64_t B = q.size(0), h = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
    at::Tensor o = at::empty({B, T, h, D}, q.options());
    const float scale = 1.0f / std::sqrt((float)D);
    const int64_t blocks = (T + ROWS - 1) / ROWS, tasks = B * h * blocks;
    const int64_t nk = (S + 31) / 32 * 32, S2 = (S + 1) / 2;          /* keys padded to whole tiles; key pairs */
    const float *qp = q.data_ptr<float>(), *kptr = k.data_ptr<float>(), *vptr = v.data_ptr<float>();
    float *op = o.data_ptr<float>();
    /* every entry written below: no zero fill */
    std::unique_ptr<uint32_t[]> kpairs(new uint32_t[B * h * (D / 2) * nk]), vpairs(new uint32_t[B * h * S2 * D]);
    const bool par = tasks > 1 && T * S * h * B >= (1 << 14);
    #pragma omp parallel if (par)
    {
        std::unique_ptr<float[]> kt(new float[D * nk]);            /* transpose_keys writes all of it */
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * h; bh++) {
            const float *kh = kptr + (bh / h) * k.stride(0) + (bh % h) * k.stride(1);
            const float *vh = vptr + (bh / h) * v.stride(0) + (bh % h) * v.stride(1);
            transpose_keys(kh, k.stride(2), S, D, nk, kt.get());
            uint32_t *kp = kpairs.get() + bh * (D / 2) * nk, *vp = vpairs.get() + bh * S2 * D;
            for (int64_t m = 0; m < D / 2; m++) bf16_pairs(kt.get() + 2 * m * nk, kt.get() + (2 * m + 1) * nk, nk, kp + m * nk);
            for (int64_t m = 0; m < S2; m++)
                bf16_pairs(vh + 2 * m * v.stride(2), 2 * m + 1 < S ? vh + (2 * m + 1) * v.stride(2) : nullptr, D, vp + m * D);
        }
        std::vector<float> sc;
        std::vector<uint16_t> qb, pb;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t bh = t % (B * h), blk = blocks - 1 - t / (B * h), b = bh / h, hh = bh % h;
            const Head H{qp + b * q.stride(0) + hh * q.stride(1), nullptr, q.stride(2), 0, op + (b * T * h + hh) * D, h * D};
            block_bf16(H, kpairs.get() + bh * (D / 2) * nk, vpairs.get() + bh * S2 * D, nk, blk * ROWS,
                       std::min(T, (blk + 1) * ROWS), S - T, D, scale, sc, qb, pb);
        }
    }
    return o.permute({0, 2, 1, 3});
}

at::Tensor causal_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    check_all(q, k, v, "causal_attention");
    const int64_t B = q.size(0), h = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
    at::Tensor o = at::empty({B, T, h, D}, q.options());
    const float scale = 1.0f / std::sqrt((float)D);
    const int64_t blocks = (T + ROWS - 1) / ROWS, tasks = B * h * blocks;
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    float *op = o.data_ptr<float>();
    const bool wide = dispatch::on(dispatch::ATTENTION);
    const int64_t n16 = wide ? (S + 31) / 32 * 32 : (S + 15) / 16 * 16;   /* keys padded to whole tiles */
    at::Tensor kt = at::empty({B * h, D, n16}, q.options());        /* each head's keys, transposed */
    float *ktp = kt.data_ptr<float>();
    const bool par = tasks > 1 && T * S * h * B >= (1 << 14);
    #pragma omp parallel if (par)                      /* one region: waking the threads twice cost ~0.03 ms */
    {
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * h; bh++)
            transpose_keys(kp + (bh / h) * k.stride(0) + (bh % h) * k.stride(1), k.stride(2), S, D, n16,
                           ktp + bh * D * n16);
        std::vector<float> sc;
        /* the longest blocks (the last rows) first: dynamic hand-out then evens the threads */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t bh = t % (B * h), blk = blocks - 1 - t / (B * h), b = bh / h, hh = bh % h;
            const Head H{qp + b * q.stride(0) + hh * q.stride(1), vp + b * v.stride(0) + hh * v.stride(1),
                         q.stride(2), v.stride(2), op + (b * T * h + hh) * D, h * D};
            if (wide)
                block16(H, ktp + bh * D * n16, n16, blk * ROWS, std::min(T, (blk + 1) * ROWS), S - T, D, scale, sc);
            else
                block(H, ktp + bh * D * n16, n16, blk * ROWS, std::min(T, (blk + 1) * ROWS), S - T, D, scale, sc);
        }
    }
    return o.permute({0, 2, 1, 3});
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
    m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("causal_attention", &causal_attention);
    m.impl("causal_attention_bf16", &causal_attention_bf16);
}
