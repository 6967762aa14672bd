/* gpt2mha's bf16 products for decode-sized inputs (inference/dense.py wraps them; cached_forward.cpp
 * calls them for bf16 models): the operators torch.ops.gpt2mha.conv1d_bf16 and linear_bf16.
 *
 *   conv1d_bf16:  y[m, n] = bf16(bias[n] + sum_k x[m, k] w[k, n]), then bf16(gelu(y)) if gelu   w [K, N]
 *   linear_bf16:  y[m, n] = bias[n] + sum_k x[m, k] w[n, k] (float32 out: the head's logits)    w [N, K]
 *
 * w bfloat16 as the model holds it; x float32 holding bf16 values (a bf16 model's activations: rounded
 * to bf16 here, which changes nothing for them); every product of two bf16 values is exact in float32
 * and the sums are float32: a bf16 model's own arithmetic (its GEMMs round once, at the output), in an
 * order of our own.
 *
 * The order, per output lane, is that of AVX-512 BF16's vdpbf16ps over pairs of inputs (measured: the
 * instruction adds the odd product, then the even one, each rounded as a float32 add): acc = bias (or 0),
 * then for k = 0, 2, 4, ...: acc = (acc + x[k+1] w[k+1]) + x[k] w[k]. CPUs without AVX-512 BF16 take
 * the same adds on 8 float32 lanes (the same bits, but where the instruction flushes a subnormal input
 * or sum to zero). conv1d_bf16's lanes are output columns (no horizontal sum): the two rows k, k+1 of w
 * are interleaved in registers (vpunpck{l,h}wd) into the pairs vdpbf16ps multiplies, so the weights
 * are read as the model lays them out, no copy. linear_bf16's 16 lanes each take the pairs at k = 32j +
 * 2l, then (l, l + 8), (l, l + 4), (l, l + 2), (0, 1) are added (float_products.cpp's tree), + bias.
 *
 * Why (benchmarks/RESULTS.md, "bf16 at memory speed"): a bf16 124M step reads 249 MB, half of float32's,
 * yet the decode view's bf16 products (torch's, from Python) ran slower than float32's. */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

#include "kernels.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

static const int64_t KB = 16, CHUNK_COLS = 512, PARALLEL_MACS = 1 << 18, HEAD_CHUNK_BYTES = 1 << 16;
/* from PROMPT_ROWS rows, blocks of PROMPT_KB weight rows (512 rows: ~1.3x; oneDNN's bf16 GEMM, ~3x ours
 * there, multiplies a bf16 model's prompts: cached_forward.cpp) */
static const int64_t PROMPT_ROWS = 64, PROMPT_KB = 128;

static inline int64_t chunk_of(int64_t units, int64_t per) {
    const int64_t T = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1, chunks = T * ((units + T * per - 1) / (T * per));
    return std::max<int64_t>(1, (units + chunks - 1) / chunks);
}

/* whether the products take vdpbf16ps: the CPU has AVX-512 BF16 and the AVX-512 paths are on */
static bool bf16_dot() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has && avx512_paths();
}

/* ---- rounding to bf16 ---- */

/* float32 -> the nearest bf16 (ties to even) as its 16 bits; NaN stays a (quiet) NaN */
static inline uint16_t bits1(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256i bits8(__m256 f) {              /* 8 lanes of bits1, in the low halves of 32-bit lanes */
    const __m256i u = _mm256_castps_si256(f);
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
}

static inline __m256 round8(__m256 f) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits8(f), 16)); }

void round_bf16(float *p, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, round8(_mm256_loadu_ps(p + i)));
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)bits1(p[i]) << 16;
        std::memcpy(p + i, &u, 4);
    }
}

/* rows of x [M, K] as bf16 bits [M, Kp] (Kp = K rounded up to 32, zeros past K) */
static std::unique_ptr<uint16_t[]> x_bits(const float *x, int64_t M, int64_t K, int64_t Kp) {
    std::unique_ptr<uint16_t[]> b(new uint16_t[M * Kp]());
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) b[m * Kp + k] = bits1(x[m * K + k]);
    return b;
}

/* y[0 .. n) (bf16 values as float32) -> bf16(gelu(y)), on 8 lanes then one by one (gelu8 = gelu1) */
static void gelu_round(float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, round8(gelu8(_mm256_loadu_ps(y + i))));
    for (; i < n; i++) y[i] = gelu1(y[i]);
    round_bf16(y + (n / 8) * 8, n % 8);
}

/* ---- conv1d_bf16, AVX-512 BF16 ---- */

/* columns [j, j + 32) as two accumulators in the order vpunpck{l,h}wd leaves them: lo holds columns
 * 8q + (0..3), hi 8q + (4..7), q = 0..3 the 128-bit lane. TO_LO/TO_HI gather natural order into that
 * order (from two 16-column vectors a = columns 0-15, b = 16-31); NAT0/NAT1 the reverse. */
alignas(64) static const int32_t TO_LO[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) static const int32_t TO_HI[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
alignas(64) static const int32_t NAT0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) static const int32_t NAT1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

/* MR rows of x (bits xb, row stride Kp) over w's rows [k0, k1) (k0 even) at columns j .. j + 32 NB
 * (cols of them real); acc kept in y (stride N) between blocks in natural order */
template <int MR, int NB>
BF16_TARGET static void tile_bf16(const uint16_t *xb, int64_t Kp, const uint16_t *w, int64_t K, int64_t N,
                                  int64_t k0, int64_t k1, int64_t j, int64_t cols, const float *bias, bool first,
                                  float *y) {
    __m512 lo[MR][NB], hi[MR][NB];
    __mmask16 m16[2 * NB];
    __mmask32 m32[NB];
    for (int q = 0; q < 2 * NB; q++) {
        const int64_t c = std::clamp<int64_t>(cols - 16 * q, 0, 16);
        m16[q] = (__mmask16)((1u << c) - 1);
    }
    for (int q = 0; q < NB; q++) {
        const int64_t c = std::clamp<int64_t>(cols - 32 * q, 0, 32);
        m32[q] = c == 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << c) - 1);
    }
    const __m512i tl = _mm512_load_si512(TO_LO), th = _mm512_load_si512(TO_HI);
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < NB; q++) {
            const float *src = first ? bias : y + m * N;
            const __m512 a = first && !bias ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m16[2 * q], src + j + 32 * q);
            const __m512 b = first && !bias ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m16[2 * q + 1], src + j + 32 * q + 16);
            lo[m][q] = _mm512_permutex2var_ps(a, tl, b);
            hi[m][q] = _mm512_permutex2var_ps(a, th, b);
        }
    for (int64_t k = k0; k < k1; k += 2) {
        __m512i il[NB], ih[NB];
        for (int q = 0; q < NB; q++) {
            const uint16_t *wk = w + k * N + j + 32 * q;
            const __m512i r0 = _mm512_maskz_loadu_epi16(m32[q], wk);
            const __m512i r1 = k + 1 < K ? _mm512_maskz_loadu_epi16(m32[q], wk + N) : _mm512_setzero_si512();
            /* this tile's lines KB rows on (1 row: 6 against 14 ms over 141 MB of 768 x 3072; 8 rows: ~1.3x
             * faster than the next tile's lines) */
            _mm_prefetch((const char *)(wk + KB * N), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + (KB + 1) * N), _MM_HINT_T0);
            il[q] = _mm512_unpacklo_epi16(r0, r1);
            ih[q] = _mm512_unpackhi_epi16(r0, r1);
        }
        for (int m = 0; m < MR; m++) {
            uint32_t pair;
            std::memcpy(&pair, xb + m * Kp + k, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int q = 0; q < NB; q++) {
                lo[m][q] = _mm512_dpbf16_ps(lo[m][q], xv, (__m512bh)il[q]);
                hi[m][q] = _mm512_dpbf16_ps(hi[m][q], xv, (__m512bh)ih[q]);
            }
        }
    }
    const __m512i n0 = _mm512_load_si512(NAT0), n1 = _mm512_load_si512(NAT1);
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < NB; q++) {
            float *dst = y + m * N + j + 32 * q;
            _mm512_mask_storeu_ps(dst, m16[2 * q], _mm512_permutex2var_ps(lo[m][q], n0, hi[m][q]));
            _mm512_mask_storeu_ps(dst + 16, m16[2 * q + 1], _mm512_permutex2var_ps(lo[m][q], n1, hi[m][q]));
        }
}

template <int NB>
BF16_TARGET static void block_bf16(const uint16_t *xb, int64_t Kp, int64_t M, const uint16_t *w, int64_t K,
                                   int64_t N, int64_t k0, int64_t k1, int64_t c0, int64_t c1, const float *bias,
                                   float *y) {
    const bool first = k0 == 0;
    for (int64_t j = c0; j < c1; j += 32 * NB) {
        const int64_t cols = std::min<int64_t>(32 * NB, c1 - j);
        if constexpr (NB > 1) {                        /* one row */
            tile_bf16<1, NB>(xb, Kp, w, K, N, k0, k1, j, cols, bias, first, y);
            continue;
        }
        int64_t m = 0;
        for (; m + 8 <= M; m += 8) tile_bf16<8, NB>(xb + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, first, y + m * N);
        for (; m + 4 <= M; m += 4) tile_bf16<4, NB>(xb + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, first, y + m * N);
        for (; m < M; m++) tile_bf16<1, NB>(xb + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, first, y + m * N);
    }
}

/* ---- conv1d_bf16 without AVX-512 BF16: the same adds on 8 lanes ---- */

static inline __m256 widen8(const uint16_t *p) {      /* 8 bf16 -> float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float widen1(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

/* MR rows over w's rows [k0, k1) at columns [j, j + cols), cols <= 24 */
template <int MR>
static void tile8(const uint16_t *xb, int64_t Kp, const uint16_t *w, int64_t K, int64_t N, int64_t k0, int64_t k1,
                  int64_t j, int64_t cols, const float *bias, bool first, float *y) {
    if (cols < 24) {                                   /* an edge: one column at a time, the same adds */
        for (int64_t c = j; c < j + cols; c++)
            for (int m = 0; m < MR; m++) {
                float acc = first ? (bias ? bias[c] : 0.0f) : y[m * N + c];
                for (int64_t k = k0; k < k1; k += 2) {
                    const float x1 = widen1(xb[m * Kp + k + 1]), w1 = k + 1 < K ? widen1(w[(k + 1) * N + c]) : 0.0f;
                    acc = (acc + x1 * w1) + widen1(xb[m * Kp + k]) * widen1(w[k * N + c]);
                }
                y[m * N + c] = acc;
            }
        return;
    }
    __m256 acc[MR][3];
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < 3; q++)
            acc[m][q] = first ? (bias ? _mm256_loadu_ps(bias + j + 8 * q) : _mm256_setzero_ps()) : _mm256_loadu_ps(y + m * N + j + 8 * q);
    for (int64_t k = k0; k < k1; k += 2) {
        __m256 w0[3], w1[3];
        for (int q = 0; q < 3; q++) {
            w0[q] = widen8(w + k * N + j + 8 * q);
            w1[q] = k + 1 < K ? widen8(w + (k + 1) * N + j + 8 * q) : _mm256_setzero_ps();
        }
        for (int m = 0; m < MR; m++) {
            const __m256 x0 = _mm256_set1_ps(widen1(xb[m * Kp + k])), x1 = _mm256_set1_ps(widen1(xb[m * Kp + k + 1]));
            for (int q = 0; q < 3; q++)
                acc[m][q] = _mm256_add_ps(_mm256_add_ps(acc[m][q], _mm256_mul_ps(x1, w1[q])), _mm256_mul_ps(x0, w0[q]));
        }
    }
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < 3; q++) _mm256_storeu_ps(y + m * N + j + 8 * q, acc[m][q]);
}

void conv1d_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, bool gelu,
                 float *y) {
    const int64_t Kp = (K + 31) / 32 * 32;
    const auto xb = x_bits(x, M, K, Kp);
    const bool dot = bf16_dot();
    const int64_t width = dot ? (M == 1 ? 128 : 32) : 24, tiles = (N + width - 1) / width;
    const int64_t chunk = width * chunk_of(tiles, std::max<int64_t>(1, CHUNK_COLS / width));
    #pragma omp parallel for schedule(dynamic, 1) if (M * K * N >= PARALLEL_MACS)
    for (int64_t c0 = 0; c0 < N; c0 += chunk) {
        const int64_t c1 = std::min(N, c0 + chunk);
        const int64_t kb = M >= PROMPT_ROWS ? PROMPT_KB : KB;     /* many rows: their sums permuted an 8th as often */
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t k1 = std::min(K, k0 + kb);
            if (dot && M == 1) {
                block_bf16<4>(xb.get(), Kp, M, w, K, N, k0, k1, c0, c1, bias, y);
            } else if (dot) {
                block_bf16<1>(xb.get(), Kp, M, w, K, N, k0, k1, c0, c1, bias, y);
            } else {
                for (int64_t j = c0; j < c1; j += width) {
                    const int64_t cols = std::min(width, c1 - j);
                    int64_t m = 0;
                    for (; m + 4 <= M; m += 4) tile8<4>(xb.get() + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, k0 == 0, y + m * N);
                    for (; m < M; m++) tile8<1>(xb.get() + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, k0 == 0, y + m * N);
                }
            }
        }
        for (int64_t m = 0; m < M; m++) {              /* the chunk's outputs, whole: bf16, GELU */
            round_bf16(y + m * N + c0, c1 - c0);
            if (gelu) gelu_round(y + m * N + c0, c1 - c0);
        }
    }
}

/* ---- linear_bf16: dot products over rows of w [N, K] ---- */

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* MR rows of x (bits, stride Kp) times R rows of w from wn (stride K): out[m * R + r] */
template <int MR, int R>
BF16_TARGET static void dots_bf16(const uint16_t *xb, int64_t Kp, const uint16_t *wn, int64_t K, float *out) {
    __m512 acc[MR][R];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mk = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh xv[MR];
        for (int m = 0; m < MR; m++) xv[m] = (__m512bh)_mm512_loadu_si512(xb + m * Kp + k);
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(wn + (r + R) * K + k), _MM_HINT_T0);   /* the next R rows: ~2x */
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, wn + r * K + k);
            for (int m = 0; m < MR; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++)
            out[m * R + r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[m][r]), _mm512_extractf32x8_ps(acc[m][r], 1)));
}

/* one output without AVX-512 BF16: lane l (0..15) takes the pairs at k = 32 j + 2 l, as dots_bf16 */
static float dot8(const uint16_t *xb, const uint16_t *wn, int64_t K) {
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k += 32) {
        alignas(32) uint16_t wb[32] = {};
        std::memcpy(wb, wn + k, std::min<int64_t>(32, K - k) * 2);
        for (int half = 0; half < 2; half++) {
            const __m256i xp = _mm256_loadu_si256((const __m256i *)(xb + k + 16 * half));
            const __m256i wp = _mm256_loadu_si256((const __m256i *)(wb + 16 * half));
            const __m256 x0 = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16)), x1 = _mm256_castsi256_ps(_mm256_and_si256(xp, odd));
            const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wp, 16)), w1 = _mm256_castsi256_ps(_mm256_and_si256(wp, odd));
            __m256 &a = half ? hi : lo;
            a = _mm256_add_ps(_mm256_add_ps(a, _mm256_mul_ps(x1, w1)), _mm256_mul_ps(x0, w0));
        }
    }
    return hsum8(_mm256_add_ps(lo, hi));
}

template <int MR, int R>
BF16_TARGET static void linear_rows(const uint16_t *xb, int64_t Kp, int64_t M, int64_t K, const uint16_t *w,
                                    int64_t n0, int64_t n1, int64_t N, const float *bias, float *y) {
    float out[MR * R];
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
        int64_t m = 0;
        for (; m + MR <= M; m += MR) {
            dots_bf16<MR, R>(xb + m * Kp, Kp, w + n * K, K, out);
            for (int i = 0; i < MR; i++)
                for (int r = 0; r < R; r++) y[(m + i) * N + n + r] = bias ? out[i * R + r] + bias[n + r] : out[i * R + r];
        }
        for (; m < M; m++) {
            dots_bf16<1, R>(xb + m * Kp, Kp, w + n * K, K, out);
            for (int r = 0; r < R; r++) y[m * N + n + r] = bias ? out[r] + bias[n + r] : out[r];
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            dots_bf16<1, 1>(xb + m * Kp, Kp, w + n * K, K, out);
            y[m * N + n] = bias ? out[0] + bias[n] : out[0];
        }
}

void linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, float *y) {
    const int64_t Kp = (K + 31) / 32 * 32;
    const auto xb = x_bits(x, M, K, Kp);
    const bool dot = bf16_dot();
    const int64_t rows = std::max<int64_t>(8, HEAD_CHUNK_BYTES / std::max<int64_t>(1, K * 2));
    const int64_t chunk = std::max<int64_t>(8, chunk_of(N, rows) / 8 * 8);
    #pragma omp parallel for schedule(dynamic, 1) if (M * K * N >= PARALLEL_MACS)
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n1 = std::min(N, n0 + chunk);
        if (dot && M == 1)
            linear_rows<1, 8>(xb.get(), Kp, M, K, w, n0, n1, N, bias, y);
        else if (dot)
            linear_rows<2, 8>(xb.get(), Kp, M, K, w, n0, n1, N, bias, y);
        else
            for (int64_t n = n0; n < n1; n++)
                for (int64_t m = 0; m < M; m++) {
                    const float s = dot8(xb.get() + m * Kp, w + n * K, K);
                    y[m * N + n] = bias ? s + bias[n] : s;
                }
    }
}

/* ---- the operators ---- */

static const float *check(const char *name, const at::Tensor &x, const at::Tensor &w,
                          const std::optional<at::Tensor> &bias, bool conv, int64_t &N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.numel() > 0, name,
                ": x must be a non-empty float32 CPU tensor [M, K]; got ", x.scalar_type(), " ", x.sizes());
    const int64_t K = x.size(1);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.is_contiguous() &&
                    w.size(conv ? 0 : 1) == K && w.size(conv ? 1 : 0) >= 1, name,
                ": weight must be a contiguous bfloat16 CPU tensor ", conv ? "[K=" : "[N, K=", K, conv ? ", N]" : "]",
                "; got ", w.scalar_type(), " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
    N = w.size(conv ? 1 : 0);
    if (!bias.has_value())
        return nullptr;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->device().is_cpu() &&
                    bias->is_contiguous(), name, ": bias must be a contiguous float32 CPU tensor [N=", N, "]; got ",
                bias->scalar_type(), " ", bias->sizes());
    return bias->data_ptr<float>();
}

static at::Tensor conv1d_op(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                            bool gelu) {
    int64_t N = 0;
    const float *b = check("conv1d_bf16", x, weight, bias, true, N);
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    conv1d_bf16(xc.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t *>(weight.data_ptr<at::BFloat16>()),
                N, b, gelu, y.data_ptr<float>());
    return y;
}

static at::Tensor linear_op(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    int64_t N = 0;
    const float *b = check("linear_bf16", x, weight, bias, false, N);
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    linear_bf16(xc.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t *>(weight.data_ptr<at::BFloat16>()),
                N, b, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("conv1d_bf16(Tensor x, Tensor weight, Tensor? bias, bool gelu=False) -> Tensor");
    m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("conv1d_bf16", &conv1d_op);
    m.impl("linear_bf16", &linear_op);
}
