/* Vector helpers shared by gpt2mha's C++ kernels (products.cpp, causal_attention.cpp,
 * cached_forward.cpp): exp and GPT-2's GELU on 8 float32 lanes (16 on AVX-512 CPUs) and on one
 * float, the same operations either way (the same bits). */
#pragma once

/* GCC 12 warns that the undefined vector some AVX-512 intrinsics start from "may be used
 * uninitialized" wherever they are inlined (GCC bug 105593, fixed in GCC 13): lines of
 * avx512fintrin.h, not ours. The pragmas cover that header's lines only, so each source includes
 * simd.h before anything else (torch's headers include immintrin.h too). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dispatch.h"

/* exp by Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial (about
 * 1 ulp); below -87.3 it gives exp(-87.3) (about 1e-38), past 88.4 inf. */
static const float EXP_HI = 88.8f, EXP_LO = -87.3f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                   LN2_LO = -2.12194440e-4f;
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* exp8's operations on 16 lanes (AVX-512 CPUs; the same bits per lane as exp8 and exp1) */
TARGET_AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline float exp1(float x) {
    x = std::fmin(std::fmax(x, EXP_LO), EXP_HI);
    const float n = std::nearbyint(x * LOG2E);
    float r = std::fmaf(-n, LN2_HI, x);
    r = std::fmaf(-n, LN2_LO, r);
    float p = EXP_P[0];
    for (int i = 1; i < 6; i++) p = std::fmaf(p, r, EXP_P[i]);
    p = std::fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, 4);
    return p * two_n;
}

/* a0 + a1 + a2 + a3 summed over their 8 lanes, in one fixed order (the int8 and int4 products'
 * reduction of their accumulators) */
static inline float sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 f = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* GPT-2's GELU (openai/gpt-2's gelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), written
 * as x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3) (the same function: 1 + tanh(u) =
 * 2 / (1 + exp(-2u)), with no cancellation near u = 0), exp8/exp1 above (inf past 88.4, so
 * that a large negative x gives -0, as the true GELU rounds). Within a few float32 ulps of
 * torch's F.gelu(approximate="tanh") (and accurate where its 1 + tanh(u) cancels), about 3x
 * faster here. gelu8 and gelu1 are the same operations on 8 lanes and on one float. */
static const float GELU_K = 0.044715f, GELU_2C = -1.59576912160573073f; /* -2 sqrt(2/pi) */

static inline __m256 gelu8(__m256 x) {
    const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(GELU_K), _mm256_mul_ps(_mm256_mul_ps(x, x), x), x);
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_mul_ps(_mm256_set1_ps(GELU_2C), inner))));
}

/* gelu8's operations on 16 lanes (AVX-512 CPUs) */
TARGET_AVX512 static inline __m512 gelu16(__m512 x) {
    const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(GELU_K), _mm512_mul_ps(_mm512_mul_ps(x, x), x), x);
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_mul_ps(_mm512_set1_ps(GELU_2C), inner))));
}

static inline float gelu1(float x) {
    const float inner = std::fmaf(GELU_K, (x * x) * x, x);
    return x / (1.0f + exp1(GELU_2C * inner));
}

/* ---- rounding to bf16 on 16 lanes (bf16_products.cpp, causal_attention.cpp) ---- */

/* 16 floats -> the nearest bf16 (ties to even; a NaN stays a quiet NaN) as the low halves of 32-bit
 * lanes: integer arithmetic, so a subnormal input is rounded, not flushed (as vcvtneps2bf16 would) */
TARGET_AVX512 static inline __m512i bf16_lanes(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                         _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

/* ---- weight loads of the float products (float_products.cpp, head_products.cpp) ---- */

/* 16 floats at p, or those of mask mk (zeros elsewhere) */
template <bool FULL>
TARGET_AVX512 static inline __m512 ld16(__mmask16 mk, const float *p) {
    return FULL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mk, p);
}
/* 16 fp16 weights at p (their bits) as float32 (exact), or those of mask mk (zeros elsewhere) */
template <bool FULL>
TARGET_AVX512 static inline __m512 ld16(__mmask16 mk, const uint16_t *p) {
    return _mm512_cvtph_ps(FULL ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mk, p));
}

/* the same on 8 lanes (AVX2) */
static inline __m256i mask8(int64_t n) {            /* lanes [0, n) set, n in 0 .. 8 */
    static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)n), _mm256_loadu_si256((const __m256i *)ramp));
}

/* 8 weights at p as float32: lanes [0, n) (mask mk: those lanes set), zeros past them; fp16 bits
 * converted exactly (a whole 8 loaded at once, a tail through a zeroed copy: AVX2 has no 16-bit masked load) */
static inline __m256 ld8(const float *p, __m256i mk, int64_t) { return _mm256_maskload_ps(p, mk); }
static inline __m256 ld8(const uint16_t *p, __m256i, int64_t n) {
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) tail[i] = p[i];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
}

/* 8 weights at p, all of them (FULL tiles: a plain load the compiler folds into the FMA) */
static inline __m256 ld8_all(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8_all(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
