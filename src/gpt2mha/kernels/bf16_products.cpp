/* gpt2mha's bf16 products, decode steps and prompts (inference/dense.py wraps them; cached_forward.cpp
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
 * instruction takes the odd product, then the even one, each a fused multiply-add): acc = bias (or 0),
 * then for k = 0, 2, 4, ...: acc = fma(x[k], w[k], fma(x[k+1], w[k+1], acc)). (A product of two bf16
 * values is exact in float32, so fused or not differs only where a product overflows or falls below
 * float32's normal range: the instruction is fused there too, so the other path fuses as well, never
 * rounding the product first.) CPUs without AVX-512 BF16 take the same fmas on 8 float32 lanes (the
 * same bits, but where the instruction flushes a subnormal input or sum to zero). conv1d_bf16's lanes
 * are output columns (no horizontal sum): the two rows k, k+1 of w are interleaved in registers
 * (vpunpck{l,h}wd) into the pairs vdpbf16ps multiplies, so the weights are read as the model lays them
 * out, no copy; a prompt (PROMPT_ROWS rows or more) packs each 32-column
 * strip so interleaved once per call and runs every row on it. Rows go in tiles of 8, 4, 1: the sums
 * of a row are the same whichever tile holds it. linear_bf16's 16 lanes each take the pairs at k = 32j +
 * 2l, then (l, l + 8), (l, l + 4), (l, l + 2), (0, 1) are added (float_products.cpp's tree), + bias.
 *
 * Why: a bf16 124M step reads 249 MB, half of float32's, yet torch's bf16 products called from Python
 * run slower than float32's. The tiles' loops keep their accumulators in registers (a loop that stores
 * them at every step runs at half the speed: docs/reference/kernels.md says how to check); the
 * products against oneDNN's at 1, 8 and 512 rows are on docs/performance.md. */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>

#include "dispatch.h"
#include "kernels.h"
#include "walk.h"

static const int64_t PARALLEL_MACS = 1 << 18, HEAD_CHUNK_BYTES = 1 << 16;
/* from PROMPT_ROWS rows: prompt_bf16 (packed strips) with AVX-512 BF16; walk.h's walk on 8 lanes without
 * it (cached_forward.cpp then multiplies prompts by oneDNN's GEMM) */
static const int64_t PROMPT_ROWS = 64;

static inline int64_t chunk_of(int64_t units, int64_t per) {
    const int64_t T = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1, chunks = T * ((units + T * per - 1) / (T * per));
    return std::max<int64_t>(1, (units + chunks - 1) / chunks);
}

/* ---- rounding to bf16 ---- */

/* float32 -> the nearest bf16 (ties to even) as its 16 bits; NaN stays a (quiet) NaN */
static inline uint16_t bits1(float f) {                /* without a branch: GCC vectorizes its loops */
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? q : r);
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

/* round8 on 16 lanes (AVX-512 CPUs; the same bits) */
TARGET_AVX512 static inline __m512 round16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i b = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

/* gelu_round on 16 lanes (a 512-row prompt's GELUs: ~12 ms of its ~180 on 8 lanes) */
TARGET_AVX512 static void gelu_round16(float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, round16(gelu16(_mm512_loadu_ps(y + i))));
    for (int64_t r = i; r < n; r++) y[r] = gelu1(y[r]);
    round_bf16(y + i, n - i);
}

/* y[0 .. n) (bf16 values as float32) -> bf16(gelu(y)), on 16 or 8 lanes then one by one (gelu16 = gelu8 =
 * gelu1) */
static void gelu_round(float *y, int64_t n) {
    if (dispatch::on(dispatch::GELU)) {
        gelu_round16(y, n);
        return;
    }
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

/* rows of x as the tiles read them: each tile's rows [m0, m0 + MR) (MR = tile_rows(M, m0): 8s, then
 * 4s, then 1s, as block_bf16 walks them) as [Kp/2][MR] pairs of bf16 bits (x[m][k] low, x[m][k+1] high,
 * zeros past K) at xp + m0 Kp/2, so that a tile reads its rows through one pointer. (With a pointer per
 * row, 8 rows left GCC 12 short of general registers: it kept the 16 accumulators on the stack and
 * stored every one at every step, ~2x slower.) For MR = 1 this is x_bits' layout. */
static inline int tile_rows(int64_t M, int64_t m0) { return M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : 1; }

/* 16 lanes of bits1 (in the low halves of 32-bit lanes), as 16 bf16: 8 pairs */
TARGET_AVX512_BF16 static inline __m256i bits16(__m512 f) { return _mm512_cvtepi32_epi16(bf16_lanes(f)); }

/* an 8-row group's pairs: 8 pairs of each row (16 inputs from k), transposed 8 x 8 so that each pair
 * index's 8 rows are one store */
TARGET_AVX512_BF16 static void pairs8(const float *x, int64_t K, int64_t Kp, uint32_t *t) {
    for (int64_t k = 0; k < Kp; k += 16, t += 64) {
        const __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : K > k ? (__mmask16)((1u << (K - k)) - 1) : 0;
        __m256i r[8], a[8], b[8];
        for (int m = 0; m < 8; m++) r[m] = bits16(_mm512_maskz_loadu_ps(mk, x + m * K + k));
        for (int m = 0; m < 8; m += 2) {
            a[m] = _mm256_unpacklo_epi32(r[m], r[m + 1]);
            a[m + 1] = _mm256_unpackhi_epi32(r[m], r[m + 1]);
        }
        for (int m = 0; m < 8; m += 4) {
            b[m] = _mm256_unpacklo_epi64(a[m], a[m + 2]);
            b[m + 1] = _mm256_unpackhi_epi64(a[m], a[m + 2]);
            b[m + 2] = _mm256_unpacklo_epi64(a[m + 1], a[m + 3]);
            b[m + 3] = _mm256_unpackhi_epi64(a[m + 1], a[m + 3]);
        }
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_si256((__m256i *)(t + 8 * c), _mm256_permute2x128_si256(b[c], b[c + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(t + 8 * (c + 4)), _mm256_permute2x128_si256(b[c], b[c + 4], 0x31));
        }
    }
}

/* x_pairs' layout; its 8-row groups (all but the last few rows) by pairs8 */
static std::unique_ptr<uint32_t[]> x_pairs(const float *x, int64_t M, int64_t K, int64_t Kp) {
    std::unique_ptr<uint32_t[]> p(new uint32_t[M * Kp / 2]);   /* every entry written below: no zero fill */
    const int64_t M8 = M / 8 * 8, M4 = M - M8 >= 4 ? M8 + 4 : M8;
    #pragma omp parallel if (M * K >= PARALLEL_MACS / 4)
    {
        #pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < M8; g += 8) pairs8(x + g * K, K, Kp, p.get() + g * Kp / 2);
        std::unique_ptr<uint16_t[]> bits(new uint16_t[Kp]());
        #pragma omp for schedule(static)
        for (int64_t m = M8; m < M; m++) {            /* row m's group: [g0, g0 + MR), as tile_rows makes them */
            const int64_t g0 = m < M4 ? M8 : m;
            const int MR = m < M4 ? 4 : 1;
            for (int64_t k = 0; k < K; k++) bits[k] = bits1(x[m * K + k]);
            uint32_t *t = p.get() + g0 * Kp / 2 + (m - g0);
            for (int64_t q = 0; q < Kp / 2; q++) {
                uint32_t pair;
                std::memcpy(&pair, bits.get() + 2 * q, 4);
                t[q * MR] = pair;
            }
        }
    }
    return p;
}

/* one step of a tile: w's rows k, k + 1 (second: row k + 1 exists, else zeros) at the tile's 32 NB
 * columns into MR rows' accumulators. A part tile (not FULL) loads its columns masked; a full one
 * does not: GCC 12 treats a masked load as reading any memory and then stored every accumulator
 * before each one. */
template <int MR, int NB, bool FULL>
TARGET_AVX512_BF16 __attribute__((always_inline)) static inline void pair_step(__m512 (&lo)[MR][NB], __m512 (&hi)[MR][NB],
                                                                       const uint16_t *wk, int64_t N, bool second,
                                                                       const __mmask32 *m32, const uint32_t *xk,
                                                                       int64_t pfo) {
    __m512i il[NB], ih[NB];
    for (int q = 0; q < NB; q++) {
        const __m512i r0 = FULL ? _mm512_loadu_si512(wk + 32 * q) : _mm512_maskz_loadu_epi16(m32[q], wk + 32 * q);
        const __m512i r1 = !second ? _mm512_setzero_si512()
                           : FULL  ? _mm512_loadu_si512(wk + N + 32 * q) : _mm512_maskz_loadu_epi16(m32[q], wk + N + 32 * q);
        if (pfo) {                                     /* walk.h's tile ahead, into L2 */
            _mm_prefetch((const char *)(wk + pfo + 32 * q), _MM_HINT_T1);
            _mm_prefetch((const char *)(wk + pfo + N + 32 * q), _MM_HINT_T1);
        }
        il[q] = _mm512_unpacklo_epi16(r0, r1);
        ih[q] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int m = 0; m < MR; m++) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xk[m]);
        for (int q = 0; q < NB; q++) {
            lo[m][q] = _mm512_dpbf16_ps(lo[m][q], xv, (__m512bh)il[q]);
            hi[m][q] = _mm512_dpbf16_ps(hi[m][q], xv, (__m512bh)ih[q]);
        }
    }
}

/* MR rows of x (their pairs xp, tile_rows' layout) over w's rows [k0, k1) (k0 even) at columns
 * j .. j + 32 NB (cols of them real; FULL: cols = 32 NB); acc kept in y (stride N) between blocks in
 * natural order; pfo (not 0): walk.h's prefetch */
template <int MR, int NB, bool FULL>
TARGET_AVX512_BF16 static void tile_bf16(const uint32_t *xp, const uint16_t *w, int64_t K, int64_t N, int64_t k0,
                                  int64_t k1, int64_t j, int64_t cols, const float *bias, bool first, float *y,
                                  int64_t pfo) {
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
    /* the pairs whose two weight rows exist, then an odd K's last row, its partner zero */
    const int64_t pairs_end = k1 == K && K % 2 ? k1 - 1 : k1;
    const uint16_t *wk = w + k0 * N + j;
    const uint32_t *xk = xp + (k0 / 2) * MR;
    for (int64_t k = k0; k < pairs_end; k += 2, wk += 2 * N, xk += MR) pair_step<MR, NB, FULL>(lo, hi, wk, N, true, m32, xk, pfo);
    if (pairs_end < k1) pair_step<MR, NB, FULL>(lo, hi, wk, N, false, m32, xk, pfo);
    const __m512i n0 = _mm512_load_si512(NAT0), n1 = _mm512_load_si512(NAT1);
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < NB; q++) {
            float *dst = y + m * N + j + 32 * q;
            _mm512_mask_storeu_ps(dst, m16[2 * q], _mm512_permutex2var_ps(lo[m][q], n0, hi[m][q]));
            _mm512_mask_storeu_ps(dst + 16, m16[2 * q + 1], _mm512_permutex2var_ps(lo[m][q], n1, hi[m][q]));
        }
}

/* every row of x over w's rows [k0, k1) at columns j .. j + 32 (fewer at N), in tiles of 8, 4, 1 rows;
 * the first prefetches (pfo: walk.h's) */
TARGET_AVX512_BF16 static void rows_bf16(const uint32_t *xp, int64_t Kp, int64_t M, const uint16_t *w, int64_t K, int64_t N,
                                  int64_t k0, int64_t k1, int64_t j, int64_t pfo, const float *bias, float *y) {
    const int64_t cols = std::min<int64_t>(32, N - j);
    const bool full = cols == 32, first = k0 == 0;
    for (int64_t m = 0; m < M; pfo = 0) {
        const int MR = tile_rows(M, m);
        const uint32_t *t = xp + m * Kp / 2;
        if (MR == 8)
            (full ? tile_bf16<8, 1, true> : tile_bf16<8, 1, false>)(t, w, K, N, k0, k1, j, cols, bias, first, y + m * N, pfo);
        else if (MR == 4)
            (full ? tile_bf16<4, 1, true> : tile_bf16<4, 1, false>)(t, w, K, N, k0, k1, j, cols, bias, first, y + m * N, pfo);
        else
            (full ? tile_bf16<1, 1, true> : tile_bf16<1, 1, false>)(t, w, K, N, k0, k1, j, cols, bias, first, y + m * N, pfo);
        m += MR;
    }
}

/* ---- many rows (a prompt): each 32-column strip of w packed, then every row group down the whole of K ---- */

/* w's columns [j, j + cols) (cols <= 32) as tile_bf16's steps hold them after vpunpck{l,h}wd: per pair
 * of rows p, 64 bf16 (the lo register, then the hi one), zeros past K and past cols; [ceil(K/2)][64] */
TARGET_AVX512_BF16 static void pack_strip(const uint16_t *w, int64_t K, int64_t N, int64_t j, int64_t cols, uint16_t *out) {
    const __mmask32 mk = cols == 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << cols) - 1);
    for (int64_t k = 0; k < K; k += 2, out += 64) {
        const __m512i r0 = _mm512_maskz_loadu_epi16(mk, w + k * N + j);
        const __m512i r1 = k + 1 < K ? _mm512_maskz_loadu_epi16(mk, w + (k + 1) * N + j) : _mm512_setzero_si512();
        _mm512_storeu_si512(out, _mm512_unpacklo_epi16(r0, r1));
        _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi16(r0, r1));
    }
}

/* MR rows (their pairs xp) times a packed strip over all of K: y[., j .. j + cols) = bf16(bias + the sums),
 * in tile_bf16's order (the same instructions on the same lanes), then bf16(GELU) if gelu: each output
 * rounded as it leaves its register (gelu_round's bits; a pass over y after cost ~10% of a c_fc) */
template <int MR>
TARGET_AVX512_BF16 static void tile_packed(const uint32_t *xp, const uint16_t *strip, int64_t pairs, int64_t N, int64_t j,
                                    int64_t cols, const float *bias, bool gelu, float *y) {
    const __mmask16 ma = (__mmask16)((1u << std::min<int64_t>(cols, 16)) - 1);
    const __mmask16 mb = (__mmask16)((1u << std::clamp<int64_t>(cols - 16, 0, 16)) - 1);
    const __m512 a = bias ? _mm512_maskz_loadu_ps(ma, bias + j) : _mm512_setzero_ps();
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mb, bias + j + 16) : _mm512_setzero_ps();
    const __m512 lo0 = _mm512_permutex2var_ps(a, _mm512_load_si512(TO_LO), b);
    const __m512 hi0 = _mm512_permutex2var_ps(a, _mm512_load_si512(TO_HI), b);
    __m512 lo[MR], hi[MR];
    for (int m = 0; m < MR; m++) lo[m] = lo0, hi[m] = hi0;
    for (int64_t p = 0; p < pairs; p++, strip += 64, xp += MR) {
        const __m512bh il = (__m512bh)_mm512_loadu_si512(strip), ih = (__m512bh)_mm512_loadu_si512(strip + 32);
        for (int m = 0; m < MR; m++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m]);
            lo[m] = _mm512_dpbf16_ps(lo[m], xv, il);
            hi[m] = _mm512_dpbf16_ps(hi[m], xv, ih);
        }
    }
    const __m512i n0 = _mm512_load_si512(NAT0), n1 = _mm512_load_si512(NAT1);
    for (int m = 0; m < MR; m++) {
        __m512 v0 = round16(_mm512_permutex2var_ps(lo[m], n0, hi[m])), v1 = round16(_mm512_permutex2var_ps(lo[m], n1, hi[m]));
        if (gelu) v0 = round16(gelu16(v0)), v1 = round16(gelu16(v1));
        _mm512_mask_storeu_ps(y + m * N + j, ma, v0);
        _mm512_mask_storeu_ps(y + m * N + j + 16, mb, v1);
    }
}

/* The strips over the threads, each a contiguous run of them; each packs its strip (once a strip, in L1/L2
 * for all the row groups after; read from w in place, a strip's lines 2 N bytes apart fall in few cache
 * sets: 768 x 3072 ran at ~2/3 of 768 x 2304's speed), then runs every row group on it, each group
 * prefetching into L2 its share of the next strip's rows (the packing's reads were cold, strided). */
TARGET_AVX512_BF16 static void prompt_bf16(const uint32_t *xp, int64_t Kp, int64_t M, const uint16_t *w, int64_t K,
                                    int64_t N, const float *bias, bool gelu, float *y) {
    const int64_t pairs = (K + 1) / 2, strips = (N + 31) / 32;
    const int64_t groups = M / 8 + (M % 8 >= 4) + M % 4, per_group = (K + groups - 1) / groups;
    #pragma omp parallel
    {
        std::unique_ptr<uint16_t[]> strip(new uint16_t[pairs * 64]);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t s0 = strips * id / nt, s1 = strips * (id + 1) / nt;
        for (int64_t s = s0; s < s1; s++) {
            const int64_t j = 32 * s, cols = std::min<int64_t>(32, N - j);
            pack_strip(w, K, N, j, cols, strip.get());
            const uint16_t *next = s + 1 < s1 ? w + j + 32 : nullptr;
            for (int64_t m = 0, k = 0; m < M; k += per_group) {
                if (next)
                    for (int64_t r = k; r < std::min(K, k + per_group); r++) _mm_prefetch((const char *)(next + r * N), _MM_HINT_T1);
                const int MR = tile_rows(M, m);
                const uint32_t *t = xp + m * Kp / 2;
                if (MR == 8) tile_packed<8>(t, strip.get(), pairs, N, j, cols, bias, gelu, y + m * N);
                else if (MR == 4) tile_packed<4>(t, strip.get(), pairs, N, j, cols, bias, gelu, y + m * N);
                else tile_packed<1>(t, strip.get(), pairs, N, j, cols, bias, gelu, y + m * N);
                m += MR;
            }
        }
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

/* rows of x [M, K] rounded to bf16, as float32 [M, Kp] (zeros past K): what tile8 broadcasts from memory */
static std::unique_ptr<float[]> x_rounded(const float *x, int64_t M, int64_t K, int64_t Kp) {
    std::unique_ptr<float[]> r(new float[M * Kp]());
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) r[m * Kp + k] = widen1(bits1(x[m * K + k]));
    return r;
}

/* MR rows over w's rows [k0, k1) at columns [j, j + 8 NQ); xr: x_rounded's rows (stride Kp); pfo (not 0):
 * walk.h's prefetch. Each x value is broadcast from memory (one load, where widening it from its bits took
 * four instructions a value). The odd row's products go into every accumulator, then the even row's: each
 * accumulator's order is the pair's (odd, then even), and 12 accumulators, 3 weight vectors and an input
 * fit the 16 registers (both rows' 6 weight vectors at once spilled). */
template <int MR, int NQ>
static void tile8q(const float *xr, int64_t Kp, const uint16_t *w, int64_t K, int64_t N, int64_t k0, int64_t k1,
                   int64_t j, const float *bias, bool first, float *y, int64_t pfo) {
    __m256 acc[MR][NQ];
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < NQ; q++)
            acc[m][q] = first ? (bias ? _mm256_loadu_ps(bias + j + 8 * q) : _mm256_setzero_ps()) : _mm256_loadu_ps(y + m * N + j + 8 * q);
    for (int64_t k = k0; k < k1; k += 2) {
        if (pfo) {
            _mm_prefetch((const char *)(w + k * N + j + pfo), _MM_HINT_T1);
            _mm_prefetch((const char *)(w + (k + 1) * N + j + pfo), _MM_HINT_T1);
        }
        __m256 wv[NQ];
        if (k + 1 < K) {
            for (int q = 0; q < NQ; q++) wv[q] = widen8(w + (k + 1) * N + j + 8 * q);
        } else {                                       /* past K: x and w are 0 there, the add of +0 kept */
            for (int q = 0; q < NQ; q++) wv[q] = _mm256_setzero_ps();
        }
        for (int m = 0; m < MR; m++) {
            const __m256 x1 = _mm256_broadcast_ss(xr + m * Kp + k + 1);
            for (int q = 0; q < NQ; q++) acc[m][q] = _mm256_fmadd_ps(x1, wv[q], acc[m][q]);
        }
        for (int q = 0; q < NQ; q++) wv[q] = widen8(w + k * N + j + 8 * q);
        for (int m = 0; m < MR; m++) {
            const __m256 x0 = _mm256_broadcast_ss(xr + m * Kp + k);
            for (int q = 0; q < NQ; q++) acc[m][q] = _mm256_fmadd_ps(x0, wv[q], acc[m][q]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < NQ; q++) _mm256_storeu_ps(y + m * N + j + 8 * q, acc[m][q]);
}

/* MR rows over w's rows [k0, k1) at columns [j, j + cols), cols <= 24: whole vectors of 8 columns by
 * tile8q, the last cols % 8 one at a time (the same adds) */
template <int MR>
static void tile8(const float *xr, int64_t Kp, const uint16_t *w, int64_t K, int64_t N, int64_t k0, int64_t k1,
                  int64_t j, int64_t cols, const float *bias, bool first, float *y, int64_t pfo) {
    const int64_t vec = cols / 8 * 8;
    if (vec == 24)
        tile8q<MR, 3>(xr, Kp, w, K, N, k0, k1, j, bias, first, y, pfo);
    else if (vec == 16)
        tile8q<MR, 2>(xr, Kp, w, K, N, k0, k1, j, bias, first, y, pfo);
    else if (vec == 8)
        tile8q<MR, 1>(xr, Kp, w, K, N, k0, k1, j, bias, first, y, pfo);
    for (int64_t c = j + vec; c < j + cols; c++)
        for (int m = 0; m < MR; m++) {
            float acc = first ? (bias ? bias[c] : 0.0f) : y[m * N + c];
            for (int64_t k = k0; k < k1; k += 2) {
                const float x1 = xr[m * Kp + k + 1], w1 = k + 1 < K ? widen1(w[(k + 1) * N + c]) : 0.0f;
                acc = std::fmaf(xr[m * Kp + k], widen1(w[k * N + c]), std::fmaf(x1, w1, acc));
            }
            y[m * N + c] = acc;
        }
}

void conv1d_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, bool gelu,
                 float *y) {
    const int64_t Kp = (K + 31) / 32 * 32;
    const bool dot = dispatch::on(dispatch::BF16);
    const auto xr = dot ? nullptr : x_rounded(x, M, K, Kp);
    const auto xp = dot ? x_pairs(x, M, K, Kp) : nullptr;
    if (dot && M >= PROMPT_ROWS) {
        prompt_bf16(xp.get(), Kp, M, w, K, N, bias, gelu, y);
        return;
    }
    /* below a prompt, and every M without AVX-512 BF16: walk.h's walk, tiles of 32 columns (vdpbf16ps; one
     * row: 96, 192 bytes of each weight row as float32's 48 columns) or 24 (faster than 16-row blocks at 1
     * and 8 rows); each span's outputs, once whole: bf16, GELU */
    const bool one = dot && M == 1;
    walk(M, K, N, one ? 96 : dot ? 32 : 24, [&](int64_t k0, int64_t k1, int64_t j, int64_t pfo) {
        if (one) {
            const int64_t cols = std::min<int64_t>(96, N - j);
            return (cols == 96 ? tile_bf16<1, 3, true> : tile_bf16<1, 3, false>)(xp.get(), w, K, N, k0, k1, j, cols, bias,
                                                                                 k0 == 0, y, pfo);
        }
        if (dot)
            return rows_bf16(xp.get(), Kp, M, w, K, N, k0, k1, j, pfo, bias, y);
        const int64_t cols = std::min<int64_t>(24, N - j);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4, pfo = 0) tile8<4>(xr.get() + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, k0 == 0, y + m * N, pfo);
        for (; m < M; m++, pfo = 0) tile8<1>(xr.get() + m * Kp, Kp, w, K, N, k0, k1, j, cols, bias, k0 == 0, y + m * N, pfo);
    }, [&](int64_t c0, int64_t c1) {
        for (int64_t m = 0; m < M; m++) {
            round_bf16(y + m * N + c0, c1 - c0);
            if (gelu) gelu_round(y + m * N + c0, c1 - c0);
        }
    });
}

/* ---- linear_bf16: dot products over rows of w [N, K] ---- */

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one step of dots_bf16: 32 inputs from k (the first n of them: n < 32 loads masked; GCC 12 treats a
 * masked load as reading any memory and then stored every accumulator before each one) */
template <int MR, int R>
TARGET_AVX512_BF16 __attribute__((always_inline)) static inline void dots_step(__m512 (&acc)[MR][R], const uint16_t *xb,
                                                                       int64_t Kp, const uint16_t *wn, int64_t K,
                                                                       int64_t k, int64_t n) {
    const __mmask32 mk = n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1);
    __m512bh xv[MR];
    for (int m = 0; m < MR; m++) xv[m] = (__m512bh)_mm512_loadu_si512(xb + m * Kp + k);
    for (int r = 0; r < R; r++) {
        if constexpr (R > 1)                           /* the next R rows into L2 (one row: its own stream) */
            _mm_prefetch((const char *)(wn + (r + R) * K + k), _MM_HINT_T1);
        const __m512bh wv = (__m512bh)(n >= 32 ? _mm512_loadu_si512(wn + r * K + k) : _mm512_maskz_loadu_epi16(mk, wn + r * K + k));
        for (int m = 0; m < MR; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
    }
}

/* MR rows of x (bits, stride Kp) times R rows of w from wn (stride K): out[m * R + r] */
template <int MR, int R>
TARGET_AVX512_BF16 static void dots_bf16(const uint16_t *xb, int64_t Kp, const uint16_t *wn, int64_t K, float *out) {
    __m512 acc[MR][R];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) dots_step<MR, R>(acc, xb, Kp, wn, K, k, 32);
    if (k < K) dots_step<MR, R>(acc, xb, Kp, wn, K, k, K - k);
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++)
            out[m * R + r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[m][r]), _mm512_extractf32x8_ps(acc[m][r], 1)));
}

/* MR rows of x times R rows of w from wn (stride K), without AVX-512 BF16: out[m * R + r]. Each output's
 * lane l (0..7) of its two accumulators (inputs k = 32 j .. 32 j + 15, then 32 j + 16 ..) takes the pairs at
 * k = 32 j + 2 l, as dots_bf16, then the two are added and summed across lanes (hsum8): an output's adds
 * are the same whatever MR and R, so a row's logits are its own in any batch. Several rows and weight rows
 * at once share each widened weight pair and keep 8 or more independent chains of multiply-adds in flight
 * (one output at a time read each weight row once for every row of x). */
template <int MR, int R>
static void dots8(const uint16_t *xb, int64_t Kp, const uint16_t *wn, int64_t K, float *out) {
    __m256 lo[MR][R], hi[MR][R];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) lo[m][r] = hi[m][r] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k += 32) {
        alignas(32) uint16_t wb[R][32];
        const uint16_t *wr[R];
        for (int r = 0; r < R; r++) {
            wr[r] = wn + r * K + k;
            if (K - k < 32) {                          /* the tail: zeros past K (x is zero there too) */
                std::memset(wb[r], 0, sizeof wb[r]);
                std::memcpy(wb[r], wr[r], (K - k) * 2);
                wr[r] = wb[r];
            }
        }
        for (int half = 0; half < 2; half++) {
            __m256 x0[MR], x1[MR];
            for (int m = 0; m < MR; m++) {
                const __m256i xp = _mm256_loadu_si256((const __m256i *)(xb + m * Kp + k + 16 * half));
                x0[m] = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
                x1[m] = _mm256_castsi256_ps(_mm256_and_si256(xp, odd));
            }
            for (int r = 0; r < R; r++) {
                const __m256i wp = _mm256_loadu_si256((const __m256i *)(wr[r] + 16 * half));
                const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wp, 16)), w1 = _mm256_castsi256_ps(_mm256_and_si256(wp, odd));
                for (int m = 0; m < MR; m++) {
                    __m256 &a = half ? hi[m][r] : lo[m][r];
                    a = _mm256_fmadd_ps(x0[m], w0, _mm256_fmadd_ps(x1[m], w1, a));
                }
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = hsum8(_mm256_add_ps(lo[m][r], hi[m][r]));
}

/* outputs [n0, n1) of every row without AVX-512 BF16: one row, 4 weight rows a call; more rows, 4 rows a
 * call over each weight row */
static void linear_rows8(const uint16_t *xb, int64_t Kp, int64_t M, int64_t K, const uint16_t *w, int64_t n0,
                         int64_t n1, int64_t N, const float *bias, float *y) {
    float out[4];
    const auto put = [&](int64_t m, int64_t n, float s) { y[m * N + n] = bias ? s + bias[n] : s; };
    int64_t n = n0;
    if (M == 1)
        for (; n + 4 <= n1; n += 4) {
            dots8<1, 4>(xb, Kp, w + n * K, K, out);
            for (int r = 0; r < 4; r++) put(0, n + r, out[r]);
        }
    for (; n < n1; n++) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            dots8<4, 1>(xb + m * Kp, Kp, w + n * K, K, out);
            for (int i = 0; i < 4; i++) put(m + i, n, out[i]);
        }
        for (; m < M; m++) {
            dots8<1, 1>(xb + m * Kp, Kp, w + n * K, K, out);
            put(m, n, out[0]);
        }
    }
}

template <int MR, int R>
TARGET_AVX512_BF16 static void linear_rows(const uint16_t *xb, int64_t Kp, int64_t M, int64_t K, const uint16_t *w,
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
    const bool dot = dispatch::on(dispatch::BF16);
    const int64_t rows = std::max<int64_t>(8, HEAD_CHUNK_BYTES / std::max<int64_t>(1, K * 2));
    const int64_t chunk = std::max<int64_t>(8, chunk_of(N, rows) / 8 * 8);
    #pragma omp parallel for schedule(dynamic, 1) if (M * K * N >= PARALLEL_MACS)
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n1 = std::min(N, n0 + chunk);
        if (dot && M == 1)                             /* one weight row at a time (head_products.cpp's note) */
            linear_rows<1, 1>(xb.get(), Kp, M, K, w, n0, n1, N, bias, y);
        else if (dot)
            linear_rows<4, 4>(xb.get(), Kp, M, K, w, n0, n1, N, bias, y);
        else
            linear_rows8(xb.get(), Kp, M, K, w, n0, n1, N, bias, y);
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
