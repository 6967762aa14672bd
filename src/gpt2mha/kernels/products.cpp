/* gpt2mha's int8 products (inference/quant/gemv.py wraps them): int8_gemv (float32 activations) and
 * int8_per_row (W7A8), each described where it is defined, the threads' note the other products
 * follow. The int4 operators are int4_products.cpp's,
 * the W4A8 kernel w4a8_products.cpp's. First, the int8 weight-only product for
 * decode-sized inputs on AVX2 CPUs, the operator torch.ops.gpt2mha.int8_gemv:
 *
 *   y[m, n] = (sum_k x[m, k] * w[n, k]) * scales[n] + bias[n]
 *
 * x float32 [M, K], w int8 [N, K] (one row per output channel, as QuantizedLinear stores it),
 * scales float32 [N], bias float32 [N] or NULL, y float32 [M, N]. The activations stay float32:
 * this is the float32 product with the dequantized weight, each int8 weight converted to float
 * in registers (no rounding of x, unlike the bf16 activations of inductor's template).
 *
 * Why it exists: at one to eight rows the product
 * is a read of the weights, and on an AVX2-only CPU no kernel torch ships streams them near the
 * memory's speed. Reading each weight row start to end, one row after the next, keeps the reads
 * one sequential stream the hardware prefetcher follows; the same loop over four interleaved rows
 * runs at half the speed.
 *
 * Every row of x is summed in the same order whatever M is (four 8-lane accumulators over
 * k mod 32, then a fixed reduction), so a row's result does not depend on the other rows
 * (batch invariance); threads share out the output channels, which changes no sum. Compiled with
 * -ffp-contract=off so the compiler fuses nothing this file does not say.
 */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "dispatch.h"
#include "kernels.h"

/* Threads: output channels are handed out in chunks as threads come free (a thread the OS holds
 * back on a busy machine leaves its share to the others instead of stalling the call), and only
 * for products of at least PARALLEL_MACS multiply-adds: below that an OpenMP region costs more
 * than it saves, and on a loaded machine much more (a waiting thread must be scheduled before
 * the call can end). A chunk holds about CHUNK_BYTES of weights, which keeps each thread's reads
 * one long sequential run the prefetcher follows (chunks of 32 rows, 24 KiB of the 768-wide
 * head, leave two threads no faster than one), and the number of
 * chunks is a multiple of the threads, so that on an idle machine they finish together (a
 * 768x2304 int4 matrix in 128 KiB chunks would be 6.75 of them: one thread doing 4, the other 3). Which
 * thread computes a channel changes no sum. */
static const int64_t CHUNK_BYTES = 1 << 17;
static const int64_t PARALLEL_MACS = 1 << 18;

int64_t chunk_rows(int64_t row_bytes, int64_t N) {
    const int64_t per = CHUNK_BYTES / (row_bytes > 0 ? row_bytes : 1), rows = per > 1 ? per : 1;
    const int64_t T = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
    const int64_t chunks = T * ((N + T * rows - 1) / (T * rows));        /* a multiple of T */
    return chunks > 0 ? (N + chunks - 1) / chunks : 1;
}

bool parallel_worth(int64_t M, int64_t K, int64_t N) { return M * K * N >= PARALLEL_MACS; }
/* inputs of at least this many values are rounded (round_rows) on the threads */
static const int64_t PARALLEL_ROUND = 1 << 16;

static inline __m256 w8(const int8_t *p) {          /* 8 int8 weights -> 8 float32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* sum_k x[k] * w[k] for one row of x */
static float dot1(const float *x, const int8_t *w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(w8(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(w8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(w8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(w8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    float s = sum4x8(a0, a1, a2, a3);
    for (; k < K; k++) s = std::fmaf(x[k], (float)w[k], s);
    return s;
}

/* the same for two rows of x over one weight row: each weight converted once, the same
 * arithmetic per row as dot1 */
static void dot2(const float *x0, const float *x1, const int8_t *w, int64_t K, float *s0, float *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 v0 = w8(w + k), v1 = w8(w + k + 8), v2 = w8(w + k + 16), v3 = w8(w + k + 24);
        a0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x0 + k), a0);
        b0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x1 + k), b0);
        a1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x0 + k + 8), a1);
        b1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x1 + k + 8), b1);
        a2 = _mm256_fmadd_ps(v2, _mm256_loadu_ps(x0 + k + 16), a2);
        b2 = _mm256_fmadd_ps(v2, _mm256_loadu_ps(x1 + k + 16), b2);
        a3 = _mm256_fmadd_ps(v3, _mm256_loadu_ps(x0 + k + 24), a3);
        b3 = _mm256_fmadd_ps(v3, _mm256_loadu_ps(x1 + k + 24), b3);
    }
    float s = sum4x8(a0, a1, a2, a3), t = sum4x8(b0, b1, b2, b3);
    for (; k < K; k++) {
        s = std::fmaf(x0[k], (float)w[k], s);
        t = std::fmaf(x1[k], (float)w[k], t);
    }
    *s0 = s;
    *s1 = t;
}

void gemv(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, const float *scales, const float *bias,
          float *y) {
    const int64_t chunk = chunk_rows(K, N);
    #pragma omp parallel for schedule(dynamic, chunk) if (parallel_worth(M, K, N))
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        float b = bias ? bias[n] : 0.0f, s0, s1;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            dot2(x + m * K, x + (m + 1) * K, wn, K, &s0, &s1);
            y[m * N + n] = std::fmaf(s0, scales[n], b);
            y[(m + 1) * N + n] = std::fmaf(s1, scales[n], b);
        }
        if (m < M)
            y[m * N + n] = std::fmaf(dot1(x + m * K, wn, K), scales[n], b);
    }
}

/* The per_row (W7A8) layer for decode sizes (the operator int8_per_row): x's rows rounded to
 * 8 bits with their own step and minimum (round_rows, below), u in 0..255, times 7-bit weights q
 * in [-63, 63] (weight_7bit; the caller's promise: wider weights would saturate vpmaddubsw's
 * int16 pairs silently), as FBGEMM does: (sum_k u[m, k] q[n, k] - 128 qsum[n]) in exact int32
 * sums (pairs of products never saturate int16: 2 * 255 * 63 < 2^15), qsum[n] = sum_k q[n, k],
 * times scales[n], then per_row's rescale (Rescale). The weights are laid out as VNNI
 * multiplies want them, as oneDNN and FBGEMM pack theirs: P [N/32, K/4, 32, 4] (both rounded
 * up, zero-padded; pack_rows in gemv.py), four consecutive inputs of 32 output channels per 128
 * bytes. Four bytes of a row of u, broadcast, times 128 bytes of P add into the int32 sums of 32
 * channels at once (two vpdpbusd, or four vpmaddubsw + vpmaddwd on AVX2): no horizontal sums (over
 * row-major weights they take about as long as the products at eight rows), and each 128-byte step
 * of P is read once for
 * up to eight rows of u. A tile of 32 channels is one sequential run of 32 K bytes. Exact integer
 * sums make the result independent of the order, hence of the other rows, the threads and the
 * instructions (the same sums as FBGEMM's and torch._int_mm's); the rounding and the rescale
 * are per row and per element. */
/* per_row's rescale of the integer product v = (sum u q - 128 qsum) * scales, as the layer
 * writes it (compiled.py's PerRowInt8Linear): v * a + (a * 128 + lo) * wsum + bias, a and lo the
 * row's step and minimum; NaN for a row whose a or lo is not finite; then GELU (gelu1) if asked
 * (the MLP's c_fc, fused: gpt2mha.inference.fast.GeluFusedMLP) */
struct Rescale {
    const float *a, *c;      /* [M]: a and a * 128 + lo per row */
    const float *wsum, *bias;
    const int32_t *qsum;
    const float *scales;
    bool gelu;
    /* y[n0 .. n0 + nn) of row m from its int32 sums s: eight lanes at a time, then one by one
     * (the same operations either way: IEEE multiplies and adds, nothing fused) */
    inline void apply(int64_t m, int64_t n0, int64_t nn, const int32_t *s, float *y) const {
        const __m256 av = _mm256_set1_ps(a[m]), cv = _mm256_set1_ps(c[m]);
        int64_t j = 0;
        for (; j + 8 <= nn; j += 8) {
            const int64_t n = n0 + j;
            const __m256i q = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(s + j)),
                                               _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(qsum + n)), 7));
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(scales + n));
            __m256 t = _mm256_add_ps(_mm256_mul_ps(v, av), _mm256_mul_ps(cv, _mm256_loadu_ps(wsum + n)));
            if (bias)
                t = _mm256_add_ps(t, _mm256_loadu_ps(bias + n));
            _mm256_storeu_ps(y + j, gelu ? gelu8(t) : t);
        }
        for (; j < nn; j++) {
            const int64_t n = n0 + j;
            const float v = (float)(s[j] - 128 * qsum[n]) * scales[n], t = v * a[m] + c[m] * wsum[n];
            const float tb = bias ? t + bias[n] : t;
            y[j] = gelu ? gelu1(tb) : tb;
        }
    }
    /* the same on 16 lanes (AVX-512; GELU's div and exp were ~1.3 of a 128-token prompt's ~22 ms on 8) */
    TARGET_AVX512 inline void apply16(int64_t m, int64_t n0, int64_t nn, const int32_t *s, float *y) const {
        const __m512 av = _mm512_set1_ps(a[m]), cv = _mm512_set1_ps(c[m]);
        int64_t j = 0;
        for (; j + 16 <= nn; j += 16) {
            const int64_t n = n0 + j;
            const __m512i q = _mm512_sub_epi32(_mm512_loadu_si512((const void *)(s + j)),
                                               _mm512_slli_epi32(_mm512_loadu_si512((const void *)(qsum + n)), 7));
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(scales + n));
            __m512 t = _mm512_add_ps(_mm512_mul_ps(v, av), _mm512_mul_ps(cv, _mm512_loadu_ps(wsum + n)));
            if (bias)
                t = _mm512_add_ps(t, _mm512_loadu_ps(bias + n));
            _mm512_storeu_ps(y + j, gelu ? gelu16(t) : t);
        }
        if (j < nn)
            apply(m, n0 + j, nn - j, s + j, y + j);
    }
};

/* the 128 bytes of step q of the next tile, into L2 (PACKED_ROWS' pf) */
static inline void prefetch_step(const int8_t *pf, int64_t q) {
    _mm_prefetch((const char *)(pf + 128 * q), _MM_HINT_T1);
    _mm_prefetch((const char *)(pf + 128 * q + 64), _MM_HINT_T1);
}

/* AVX-512 VNNI (vpdpbusd: four u8 x s8 products added into each int32 lane, no int16 step) where the
 * CPU has it (dispatch.h's PER_ROW), else AVX2's vpmaddubsw + vpmaddwd: the same exact sums */
template <int MT>
TARGET_AVX512_VNNI
static inline void packed_tile_vnni(const uint8_t *u8, int64_t ustride, int64_t Kq, const int8_t *pt, int32_t *sums,
                                    const int8_t *pf) {
    __m512i acc[2 * MT];
    for (int i = 0; i < 2 * MT; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t q = 0; q < Kq; q++) {
        if (pf)
            prefetch_step(pf, q);
        const __m512i w0 = _mm512_loadu_si512((const void *)(pt + 128 * q));
        const __m512i w1 = _mm512_loadu_si512((const void *)(pt + 128 * q + 64));
        for (int i = 0; i < MT; i++) {
            const __m512i b = _mm512_broadcastd_epi32(_mm_loadu_si32((const void *)(u8 + i * ustride + 4 * q)));
            acc[2 * i] = _mm512_dpbusd_epi32(acc[2 * i], b, w0);
            acc[2 * i + 1] = _mm512_dpbusd_epi32(acc[2 * i + 1], b, w1);
        }
    }
    for (int i = 0; i < 2 * MT; i++) _mm512_storeu_si512((void *)(sums + 16 * i), acc[i]);
}

/* AVX2: two rows of u per pass over a tile's 128-byte steps (eight accumulators of 8 channels) */
template <int MT>
static inline void packed_tile(const uint8_t *u8, int64_t ustride, int64_t Kq, const int8_t *pt, int32_t *sums,
                               const int8_t *pf) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[4 * MT];
    for (int i = 0; i < 4 * MT; i++) acc[i] = _mm256_setzero_si256();
    for (int64_t q = 0; q < Kq; q++) {
        if (pf)
            prefetch_step(pf, q);
        __m256i w[4];
        for (int j = 0; j < 4; j++) w[j] = _mm256_loadu_si256((const __m256i *)(pt + 128 * q + 32 * j));
        for (int i = 0; i < MT; i++) {
            int32_t four;
            std::memcpy(&four, u8 + i * ustride + 4 * q, 4);
            const __m256i b = _mm256_set1_epi32(four);
            for (int j = 0; j < 4; j++)     /* pairs of uint8 x 7-bit products never saturate int16 */
                acc[4 * i + j] = _mm256_add_epi32(acc[4 * i + j], _mm256_madd_epi16(_mm256_maddubs_epi16(b, w[j]), ones));
        }
    }
    for (int i = 0; i < 4 * MT; i++) _mm256_storeu_si256((__m256i *)(sums + 8 * i), acc[i]);
}

/* tiles t0..t1-1 of 32 channels times every row of u, in passes of up to ROWS rows (TILE's
 * MT); each pass leaves its sums in s [32 MT] for the rescale. With more rows than one pass
 * (prefill), the first pass over a tile also prefetches the next tile into L2 (pf): the 48
 * products of 124M at 128 rows 3-5% faster, weights from memory */
#define PACKED_ROWS(ROWS, APPLY, SWITCH)                                               \
    int32_t s[32 * ROWS];                                                              \
    for (int64_t t = t0; t < t1; t++) {                                                \
        const int8_t *pt = P + t * Kq * 128;                                           \
        const int64_t n0 = 32 * t, nn = N - n0 < 32 ? N - n0 : 32;                     \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                                     \
            const int64_t mt = M - m0 < ROWS ? M - m0 : ROWS;                          \
            const uint8_t *um = u8 + m0 * ustride;                                     \
            const int8_t *pf = m0 == 0 && M > ROWS && t + 1 < t1 ? pt + Kq * 128 : nullptr; \
            SWITCH                                                                     \
            for (int64_t i = 0; i < mt; i++) r.APPLY(m0 + i, n0, nn, s + 32 * i, y + (m0 + i) * N + n0); \
        }                                                                              \
    }

TARGET_AVX512_VNNI
static void packed_rows_vnni(const uint8_t *u8, int64_t M, int64_t ustride, int64_t Kq, const int8_t *P, int64_t N,
                             const Rescale &r, float *y, int64_t t0, int64_t t1) {
    PACKED_ROWS(8, apply16, switch (mt) {
        case 8: packed_tile_vnni<8>(um, ustride, Kq, pt, s, pf); break;
        case 7: packed_tile_vnni<7>(um, ustride, Kq, pt, s, pf); break;
        case 6: packed_tile_vnni<6>(um, ustride, Kq, pt, s, pf); break;
        case 5: packed_tile_vnni<5>(um, ustride, Kq, pt, s, pf); break;
        case 4: packed_tile_vnni<4>(um, ustride, Kq, pt, s, pf); break;
        case 3: packed_tile_vnni<3>(um, ustride, Kq, pt, s, pf); break;
        case 2: packed_tile_vnni<2>(um, ustride, Kq, pt, s, pf); break;
        default: packed_tile_vnni<1>(um, ustride, Kq, pt, s, pf); break;
    })
}

static void packed_rows(const uint8_t *u8, int64_t M, int64_t ustride, int64_t Kq, const int8_t *P, int64_t N,
                        const Rescale &r, float *y, int64_t t0, int64_t t1) {
    PACKED_ROWS(2, apply, if (mt == 2) packed_tile<2>(um, ustride, Kq, pt, s, pf); else packed_tile<1>(um, ustride, Kq, pt, s, pf);)
}
#undef PACKED_ROWS

static void gemv_packed(const uint8_t *u8, int64_t M, int64_t ustride, int64_t K, const int8_t *P, int64_t N,
                        const Rescale &r, float *y) {
    const int64_t Kq = (K + 3) / 4, tiles = (N + 31) / 32;
    const int64_t per = chunk_rows(Kq * 128, tiles), chunks = (tiles + per - 1) / per;
    const bool v = dispatch::on(dispatch::PER_ROW);
    #pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(M, K, N))
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t t0 = i * per, t1 = t0 + per < tiles ? t0 + per : tiles;
        if (v)
            packed_rows_vnni(u8, M, ustride, Kq, P, N, r, y, t0, t1);
        else
            packed_rows(u8, M, ustride, Kq, P, N, r, y, t0, t1);
    }
}

/* The operators' checks of a float32 vector argument [N] (a clear message, never a read out of
 * bounds): vec returns its data; bias_of returns NULL for None. */
static const float *vec(const char *op, const char *name, const at::Tensor &t, int64_t N) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                t.device().is_cpu(),
                op, ": ", name, " must be a contiguous float32 CPU tensor [N=", N, "]; got ", t.scalar_type(), " ",
                t.sizes());
    return t.data_ptr<float>();
}

const float *bias_of(const char *op, const std::optional<at::Tensor> &bias, int64_t N) {
    if (!bias.has_value())
        return nullptr;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous() && bias->device().is_cpu(),
                op, ": bias must be a contiguous float32 CPU tensor [N=", N, "] or None; got ", bias->scalar_type(),
                " ", bias->sizes());
    return bias->data_ptr<float>();
}

/* The operator: checks its arguments (a clear message, never a read out of bounds), then runs
 * gemv. Without autograd: the weights are quantized, for inference. */
static at::Tensor int8_gemv(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales,
                            const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "int8_gemv: x must be a float32 CPU tensor [M, K]; got ", x.scalar_type(), " ", x.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == K &&
                weight.is_contiguous() && weight.device().is_cpu(),
                "int8_gemv: weight must be a contiguous int8 CPU tensor [N, K=", K, "]; got ",
                weight.scalar_type(), " ", weight.sizes());
    vec("int8_gemv", "scales", scales, N);
    const float *b = bias_of("int8_gemv", bias, N);
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    gemv(xc.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scales.data_ptr<float>(), b, y.data_ptr<float>());
    return y;
}

/* the end of a row's range: folds the 8-lane min and max (lanes, then the last k .. K one by one);
 * a row with a non-finite value or range gets u = 0 and a = c = NaN (returns false); else the
 * step a = (hi - lo) / 255 (at least 1e-30 to divide by), a and c = a * 128 + lo kept */
static inline bool row_range(const float *xr, int64_t K, int64_t k, __m256 lo8, __m256 hi8, bool bad, uint8_t *ur,
                             float *ra, float *rc, float &lo, float &hi, float &step) {
    alignas(32) float l[8], h[8];
    _mm256_store_ps(l, lo8);
    _mm256_store_ps(h, hi8);
    lo = l[0];
    hi = h[0];
    for (int j = 1; j < 8; j++) {
        lo = std::fmin(lo, l[j]);
        hi = std::fmax(hi, h[j]);
    }
    for (; k < K; k++) {
        bad |= std::isnan(xr[k]);
        lo = std::fmin(lo, xr[k]);
        hi = std::fmax(hi, xr[k]);
    }
    const float a = (hi - lo) / 255.0f;
    if (bad || !std::isfinite(a) || !std::isfinite(lo)) {
        std::memset(ur, 0, (size_t)K);
        *ra = *rc = NAN;
        return false;
    }
    step = a > 1e-30f ? a : 1e-30f;
    *ra = a;
    *rc = a * 128.0f + lo;
    return true;
}

/* one row of round_rows: u [ustride] from x [K] */
static void round_row(const float *xr, int64_t K, uint8_t *ur, int64_t ustride, float *ra, float *rc) {
    std::memset(ur + K, 0, (size_t)(ustride - K));                    /* the padding to 4 bytes */
    __m256 lo8 = _mm256_set1_ps(INFINITY), hi8 = _mm256_set1_ps(-INFINITY), bad8 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        lo8 = _mm256_min_ps(lo8, v);
        hi8 = _mm256_max_ps(hi8, v);
    }
    float lo, hi, step;
    if (!row_range(xr, K, k, lo8, hi8, _mm256_movemask_ps(bad8) != 0, ur, ra, rc, lo, hi, step))
        return;
    const __m256 lov = _mm256_set1_ps(lo), stepv = _mm256_set1_ps(step);
    for (k = 0; k + 8 <= K; k += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + k), lov), stepv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i32 = _mm256_cvtps_epi32(r);
        const __m256i p16 = _mm256_packus_epi32(i32, i32);               /* per 128-bit lane */
        const __m256i p8 = _mm256_packus_epi16(p16, p16);
        const uint64_t both = (uint64_t)(uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(p8)) |
                              ((uint64_t)(uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(p8, 1)) << 32);
        std::memcpy(ur + k, &both, 8);
    }
    for (; k < K; k++) ur[k] = (uint8_t)std::nearbyint((xr[k] - lo) / step);
}

/* the same on 16 lanes (AVX-512): the same bytes and steps (min and max in any order are the same
 * values; each value's subtract, divide and round are the 8-lane path's) */
TARGET_AVX512 static void round_row16(const float *xr, int64_t K, uint8_t *ur, int64_t ustride, float *ra, float *rc) {
    std::memset(ur + K, 0, (size_t)(ustride - K));
    __m512 lo16 = _mm512_set1_ps(INFINITY), hi16 = _mm512_set1_ps(-INFINITY);
    __mmask16 bad16 = 0;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_loadu_ps(xr + k);
        bad16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        lo16 = _mm512_min_ps(lo16, v);
        hi16 = _mm512_max_ps(hi16, v);
    }
    __m256 lo8 = _mm256_min_ps(_mm512_castps512_ps256(lo16), _mm512_extractf32x8_ps(lo16, 1));
    __m256 hi8 = _mm256_max_ps(_mm512_castps512_ps256(hi16), _mm512_extractf32x8_ps(hi16, 1));
    bool bad = bad16 != 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
        lo8 = _mm256_min_ps(lo8, v);
        hi8 = _mm256_max_ps(hi8, v);
    }
    float lo, hi, step;
    if (!row_range(xr, K, k, lo8, hi8, bad, ur, ra, rc, lo, hi, step))
        return;
    const __m512 lov = _mm512_set1_ps(lo), stepv = _mm512_set1_ps(step);
    for (k = 0; k + 16 <= K; k += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + k), lov), stepv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i i32 = _mm512_max_epi32(_mm512_cvtps_epi32(r), _mm512_setzero_si512());   /* as packus: 0 .. 255 */
        _mm_storeu_si128((__m128i *)(ur + k), _mm512_cvtusepi32_epi8(i32));
    }
    for (; k < K; k++) ur[k] = (uint8_t)std::nearbyint((xr[k] - lo) / step);
}

/* per_row's rounding of the rows of x [M, K] (compiled.py's PerRowInt8Linear, int8_products.py's
 * int8_matmul_per_row): lo = min, a = (max - min) / 255, u = round((x - lo) / max(a, 1e-30)) in
 * 0..255 (round half to even, as torch.round), into rows of ustride bytes; a[m] and c[m] = a * 128
 * + lo for the rescale; a row with a non-finite value gets u = 0 and a = c = NaN. */
static void round_rows(const float *x, int64_t M, int64_t K, uint8_t *u8, int64_t ustride, float *ra, float *rc) {
    const bool wide = dispatch::on(dispatch::PER_ROW_ROUNDING);
    /* rows on the threads for prefill sizes (a 512 x 3072 input took ~0.5 ms on one) */
    #pragma omp parallel for schedule(static) if (M * K >= PARALLEL_ROUND)
    for (int64_t m = 0; m < M; m++) {
        if (wide)
            round_row16(x + m * K, K, u8 + m * ustride, ustride, ra + m, rc + m);
        else
            round_row(x + m * K, K, u8 + m * ustride, ustride, ra + m, rc + m);
    }
}

void per_row(const float *x, int64_t M, int64_t K, const int8_t *packed, int64_t N, const int32_t *qsum,
             const float *scales, const float *wsum, const float *bias, bool gelu, float *y) {
    const int64_t ustride = 4 * ((K + 3) / 4);
    const std::unique_ptr<uint8_t[]> u8(new uint8_t[M * ustride]);       /* uninitialized: round_rows fills it */
    const std::unique_ptr<float[]> rows(new float[2 * M]);
    round_rows(x, M, K, u8.get(), ustride, rows.get(), rows.get() + M);
    const Rescale r{rows.get(), rows.get() + M, wsum, bias, qsum, scales, gelu};
    gemv_packed(u8.get(), M, ustride, K, packed, N, r, y);
}

/* The per_row operator: rounds x's rows, multiplies on the packed weights, rescales (per_row). */
static at::Tensor int8_per_row(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &qsum,
                               const at::Tensor &scales, const at::Tensor &wsum, const std::optional<at::Tensor> &bias,
                               bool gelu) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "int8_per_row: x must be a float32 CPU tensor [M, K] with K >= 1; got ", x.scalar_type(), " ",
                x.sizes());
    TORCH_CHECK(qsum.dim() == 1 && qsum.scalar_type() == at::kInt && qsum.is_contiguous() && qsum.device().is_cpu(),
                "int8_per_row: qsum must be a contiguous int32 CPU tensor [N] (it sets N for packed, scales, wsum "
                "and bias); got ", qsum.scalar_type(), " ", qsum.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = qsum.size(0), Kq = (K + 3) / 4;
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(0) == (N + 31) / 32 &&
                packed.size(1) == Kq && packed.size(2) == 32 && packed.size(3) == 4 && packed.is_contiguous() &&
                packed.device().is_cpu(),
                "int8_per_row: packed must be a contiguous int8 CPU tensor [ceil(N/32)=", (N + 31) / 32,
                ", ceil(K/4)=", Kq, ", 32, 4] (gemv.pack_rows); got ", packed.scalar_type(), " ", packed.sizes());
    vec("int8_per_row", "scales", scales, N);
    const float *ws = vec("int8_per_row", "wsum", wsum, N), *b = bias_of("int8_per_row", bias, N);
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    per_row(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, qsum.data_ptr<int32_t>(), scales.data_ptr<float>(),
            ws, b, gelu, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
    m.def("int8_per_row(Tensor x, Tensor packed, Tensor qsum, Tensor scales, Tensor wsum, Tensor? bias, bool gelu=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("int8_gemv", &int8_gemv);
    m.impl("int8_per_row", &int8_per_row);
}
