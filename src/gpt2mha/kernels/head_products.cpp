/* gpt2mha's float32 products over the LM head's weights (wte [N, K], F.linear's layout): linear_f32 and
 * linear_f16 (float_products.cpp registers their operators; cached_forward.cpp calls them for float32
 * and fp16 models).
 *
 *   linear_f32:  y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]
 *
 * Each output in one fixed order whatever M, the threads or the instruction set (batch invariance; the
 * AVX2 and AVX-512 paths give the same bits): 16 float32 lanes, lane l summing x[k] w[n, k] over
 * k = l mod 16 in order (fma), then lanes (l, l + 8) added, then (l, l + 4), (l, l + 2), (0, 1)
 * (cached_forward.cpp's hsum8 after one add of halves), then + bias. The threads share out chunks of
 * weight rows (each a sequential run of ~128 KiB). fp16 weights (linear_f16): each converted exactly
 * as it is loaded (simd.h's ld16/ld8), so the same sums as over w.float(). Compiled with
 * -ffp-contract=off: nothing is fused that this file does not say. */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dispatch.h"
#include "kernels.h"

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one 16-block of k (the lanes of mask mk) of dots16 */
template <int MR, int R, bool FULL, typename W>
TARGET_AVX512 static inline void dot_step(const float *x, int64_t K, const W *wn, int64_t k, __mmask16 mk, __m512 (&acc)[MR][R]) {
    __m512 xv[MR];
    for (int m = 0; m < MR; m++) xv[m] = ld16<FULL>(mk, x + m * K + k);
    for (int r = 0; r < R; r++) {
        if constexpr (R > 1)                           /* the next R rows' line into L2 (one row: its own stream) */
            _mm_prefetch((const char *)(wn + (r + R) * K + k), _MM_HINT_T1);
        const __m512 wv = ld16<FULL>(mk, wn + r * K + k);
        for (int m = 0; m < MR; m++) acc[m][r] = _mm512_fmadd_ps(xv[m], wv, acc[m][r]);
    }
}

/* R rows of w (from wn, stride K) times MR rows of x (stride K): out[m * R + r] */
template <int MR, int R, typename W>
TARGET_AVX512 static void dots16(const float *x, int64_t K, const W *wn, float *out) {
    __m512 acc[MR][R];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) dot_step<MR, R, true, W>(x, K, wn, k, 0xFFFF, acc);
    if (k < K) dot_step<MR, R, false, W>(x, K, wn, k, (__mmask16)((1u << (K - k)) - 1), acc);
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++)
            out[m * R + r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[m][r]), _mm512_extractf32x8_ps(acc[m][r], 1)));
}

/* the same lanes as two 8-lane halves (lanes 0-7: k mod 16 < 8; 8-15: the rest), every 16-block done
 * on both halves (masked: zeros past K) so each lane sees the same operations as on AVX-512 */
template <int MR, int R, typename W>
static void dots8(const float *x, int64_t K, const W *wn, float *out) {
    __m256 lo[MR][R], hi[MR][R];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) lo[m][r] = hi[m][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)                       /* whole 16-blocks: plain loads */
        for (int r = 0; r < R; r++) {
            if constexpr (R > 1)                       /* dots16's prefetch */
                _mm_prefetch((const char *)(wn + (r + R) * K + k), _MM_HINT_T1);
            const __m256 wl = ld8_all(wn + r * K + k), wh = ld8_all(wn + r * K + k + 8);
            for (int m = 0; m < MR; m++) {
                lo[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wl, lo[m][r]);
                hi[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), wh, hi[m][r]);
            }
        }
    if (k < K) {                                       /* the last, partial one: masked, zeros past K */
        const int64_t nl = std::clamp<int64_t>(K - k, 0, 8), nh = std::clamp<int64_t>(K - k - 8, 0, 8);
        const __m256i ml = mask8(nl), mh = mask8(nh);
        for (int r = 0; r < R; r++) {
            const __m256 wl = ld8(wn + r * K + k, ml, nl), wh = ld8(wn + r * K + k + 8, mh, nh);
            for (int m = 0; m < MR; m++) {
                lo[m][r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * K + k, ml), wl, lo[m][r]);
                hi[m][r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * K + k + 8, mh), wh, hi[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = hsum8(_mm256_add_ps(lo[m][r], hi[m][r]));
}

/* rows n .. n + R of y from the tile's out, + bias */
template <int MR, int R>
static inline void put(const float *out, int64_t n, int64_t N, const float *bias, float *y) {
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) y[m * N + n + r] = bias ? out[m * R + r] + bias[n + r] : out[m * R + r];
}

/* rows [n0, n1) of w for every row of x: tiles of R weight rows x up to MR rows of x, then one weight
 * row at a time */
template <int MR, int R, bool W512, typename W>
static void linear_rows(const float *x, int64_t M, int64_t K, const W *w, int64_t n0, int64_t n1, int64_t N,
                        const float *bias, float *y) {
    float out[MR * R];
    auto dots = [&](auto mr, auto rr, int64_t m, int64_t n) {
        constexpr int MT = decltype(mr)::value, RT = decltype(rr)::value;
        if constexpr (W512)
            dots16<MT, RT, W>(x + m * K, K, w + n * K, out);
        else
            dots8<MT, RT, W>(x + m * K, K, w + n * K, out);
        put<MT, RT>(out, n, N, bias, y + m * N);
    };
    using one = std::integral_constant<int, 1>;
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
        int64_t m = 0;
        for (; m + MR <= M; m += MR) dots(std::integral_constant<int, MR>{}, std::integral_constant<int, R>{}, m, n);
        for (; m < M; m++) dots(one{}, std::integral_constant<int, R>{}, m, n);
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) dots(one{}, one{}, m, n);
}

template <typename W>
TARGET_AVX512 static void linear16(const float *x, int64_t M, int64_t K, const W *w, int64_t N, const float *bias,
                          float *y, int64_t chunk) {
    #pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(M, K, N))
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n1 = std::min(N, n0 + chunk);
        if (M == 1)                                    /* one weight row at a time: see linear_any */
            linear_rows<1, 1, true, W>(x, M, K, w, n0, n1, N, bias, y);
        else if (M < 8)
            linear_rows<2, 8, true, W>(x, M, K, w, n0, n1, N, bias, y);
        else                                           /* 8+ rows: each weight tile read for 4 rows, not 2 */
            linear_rows<4, 4, true, W>(x, M, K, w, n0, n1, N, bias, y);
    }
}

/* One row of x (a decode step) walks the weight rows one at a time, each thread one sequential stream
 * through its chunk: its 1-2 chains per row are not the limit there (K / 16 fmas a row, ~4 cycles each),
 * the memory is: interleaving R rows (R chains in flight, R streams 2K or 4K bytes apart) read slower
 * cold on a Zen 4, on both paths. 2+ rows of x: tiles of R weight rows, each prefetching the next R rows
 * into L2 (into L1, slower). */
template <typename W>
static void linear_any(const float *x, int64_t M, int64_t K, const W *w, int64_t N, const float *bias, float *y) {
    const int64_t chunk = std::max<int64_t>(8, chunk_rows(K * (int64_t)sizeof(W), N) / 8 * 8);   /* ~128 KiB */
    if (dispatch::on(dispatch::LINEAR))
        return linear16(x, M, K, w, N, bias, y, chunk);
    #pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(M, K, N))
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        if (M == 1)
            linear_rows<1, 1, false, W>(x, M, K, w, n0, std::min(N, n0 + chunk), N, bias, y);
        else
            linear_rows<2, 3, false, W>(x, M, K, w, n0, std::min(N, n0 + chunk), N, bias, y);
    }
}

void linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
    linear_any(x, M, K, w, N, bias, y);
}

void linear_f16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, float *y) {
    linear_any(x, M, K, w, N, bias, y);
}
