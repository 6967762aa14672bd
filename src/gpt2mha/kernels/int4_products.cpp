/* gpt2mha's int4 products with float32 activations and W4A8 (inference/quant/gemv.py wraps them): the
 * operators torch.ops.gpt2mha.int4_gemv and int4_gemv_a8 (whose kernel is w4a8_products.cpp's). Threads
 * and chunks as products.cpp's note on threads says; compiled with -ffp-contract=off like every file here.
 */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "kernels.h"

/* int4 (QuantizedLinear's int4 scheme, PyTorch's int4pack convention): weight uint8 [N, K/2]
 * holding input 2i in the low nibble of byte i and input 2i + 1 in the high one (pack_int4),
 * q in 0..15; per group of G inputs a bf16 scale s and zero z, w = (q - 8) * s + z. Written as
 *
 *   sum_k x[k] * w[k] = sum_g ( s_g * sum_{k in g} q[k] x[k]  +  (z_g - 8 s_g) * X_g ),
 *
 * X_g = sum_{k in g} x[k] (once per call), the float32 product with the dequantized weight up to
 * float32 rounding. x is split once per call into its even and odd inputs, so 8 bytes of a row
 * give 16 weights in two 8-lane registers (low nibbles times even inputs, high times odd). The
 * order of every sum is fixed by K and G alone (two accumulators, groups alternating), so a
 * row's result does not depend on the other rows or the threads. */
static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

/* one weight row's (scale, zero) pairs as float32 into sf [2 * ng] */
static inline void params_f32(const uint16_t *szn, int64_t ng, float *sf) {
    int64_t i = 0;
    for (; i + 8 <= 2 * ng; i += 8) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(szn + i)));
        _mm256_storeu_ps(sf + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < 2 * ng; i++) sf[i] = bf16_value(szn[i]);
}

/* sum_i a[i] * b[i] over n floats, in a fixed order */
static inline float dotf(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    const __m256 zero = _mm256_setzero_ps();
    float s = sum4x8(acc, zero, zero, zero);
    for (; i < n; i++) s = std::fmaf(a[i], b[i], s);
    return s;
}

/* MT rows (1 or 2) of x over one weight row; GT the group size when known at compile time
 * (0: G at run time). xz [M, 2 * ng] holds (-8 X_g, X_g) per group, so that the zero terms
 * sum_g (z_g - 8 s_g) X_g are one dot product with the row's (s, z) pairs. */
template <int MT, int GT>
static inline void int4_tile(const float *xe, const float *xo, const float *xz, int64_t K, int64_t G,
                             const uint8_t *wn, const float *sf, float *out) {
    const __m256i low = _mm256_set1_epi32(15);
    const int64_t half = K / 2, gh = GT ? GT / 2 : G / 2, ng = K / (2 * gh);
    __m256 acc[MT][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 ga[MT][2];
        for (int i = 0; i < MT; i++) ga[i][0] = ga[i][1] = _mm256_setzero_ps();
        const uint8_t *wg = wn + g * gh;
        for (int64_t c = 0; c < gh; c += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + c)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            for (int i = 0; i < MT; i++) {
                ga[i][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + i * half + g * gh + c), ga[i][0]);
                ga[i][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + i * half + g * gh + c), ga[i][1]);
            }
        }
        const __m256 sv = _mm256_broadcast_ss(sf + 2 * g);
        for (int i = 0; i < MT; i++)
            acc[i][g & 1] = _mm256_fmadd_ps(_mm256_add_ps(ga[i][0], ga[i][1]), sv, acc[i][g & 1]);
    }
    const __m256 zero = _mm256_setzero_ps();
    for (int i = 0; i < MT; i++)
        out[i] = sum4x8(acc[i][0], acc[i][1], zero, zero) + dotf(sf, xz + i * 2 * ng, 2 * ng);
}

template <int GT>
static void gemv_int4(const float *xe, const float *xo, const float *xz, int64_t M, int64_t K, int64_t G,
                      const uint8_t *w, int64_t N, const uint16_t *sz, const float *bias, float *y) {
    const int64_t half = K / 2, ng = K / G, chunk = chunk_rows(half, N);
    #pragma omp parallel if (parallel_worth(M, K, N))
    {
        std::vector<float> sf(2 * ng);
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wn = w + n * half;
            params_f32(sz + n * ng * 2, ng, sf.data());
            const float b = bias ? bias[n] : 0.0f;
            float s[2];
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) {
                int4_tile<2, GT>(xe + m * half, xo + m * half, xz + m * 2 * ng, K, G, wn, sf.data(), s);
                y[m * N + n] = s[0] + b;
                y[(m + 1) * N + n] = s[1] + b;
            }
            if (m < M) {
                int4_tile<1, GT>(xe + m * half, xo + m * half, xz + m * 2 * ng, K, G, wn, sf.data(), s);
                y[m * N + n] = s[0] + b;
            }
        }
    }
}

/* The int4 operators' argument checks (a clear message, never a read out of bounds); returns
 * the bias pointer (NULL for None). `unit`: what the group size must be a multiple of. */
static const float *check_int4(const char *name, int64_t unit, const at::Tensor &x, const at::Tensor &weight,
                               const at::Tensor &scale_zero, int64_t G, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                name, ": x must be a float32 CPU tensor [M, K]; got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(weight.dim() == 2, name, ": weight must be a contiguous uint8 CPU tensor [N, K/2]; got ",
                weight.scalar_type(), " ", weight.sizes());
    const int64_t K = x.size(1), N = weight.size(0);
    TORCH_CHECK(G >= unit && G % unit == 0 && K % G == 0,
                name, ": group_size must be a multiple of ", unit, " dividing K=", K, "; got ", G);
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.size(1) == K / 2 &&
                weight.is_contiguous() && weight.device().is_cpu(),
                name, ": weight must be a contiguous uint8 CPU tensor [N, K/2=", K / 2, "]; got ",
                weight.scalar_type(), " ", weight.sizes());
    TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == N && scale_zero.size(1) == K / G &&
                scale_zero.size(2) == 2 && scale_zero.scalar_type() == at::kBFloat16 &&
                scale_zero.is_contiguous() && scale_zero.device().is_cpu(),
                name, ": scale_zero must be a contiguous bfloat16 CPU tensor [N=", N, ", K/group_size=",
                K / G, ", 2]; got ", scale_zero.scalar_type(), " ", scale_zero.sizes());
    return bias_of(name, bias, N);
}

/* The int4 operator (gemv_int4). */
static at::Tensor int4_gemv(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_zero,
                            int64_t group_size, const std::optional<at::Tensor> &bias) {
    const float *b = check_int4("int4_gemv", 16, x, weight, scale_zero, group_size, bias);
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), G = group_size;
    at::Tensor xc = x.contiguous();
    /* the even and the odd inputs of each row, and each group's sum, in a fixed order */
    const int64_t half = K / 2, ng = K / G;
    at::Tensor parts = at::empty({2 * M * half + 2 * M * ng}, x.options());
    const float *src = xc.data_ptr<float>();
    float *xe = parts.data_ptr<float>(), *xo = xe + M * half, *xz = xo + M * half;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
                xe[m * half + k / 2] = src[m * K + k];
                xo[m * half + k / 2] = src[m * K + k + 1];
                t += src[m * K + k];
                t += src[m * K + k + 1];
            }
            xz[m * 2 * ng + 2 * g] = -8.0f * t;
            xz[m * 2 * ng + 2 * g + 1] = t;
        }
    at::Tensor y = at::empty({M, N}, x.options());
    const uint8_t *w = weight.data_ptr<uint8_t>();
    const uint16_t *sz = reinterpret_cast<const uint16_t *>(scale_zero.data_ptr<at::BFloat16>());
    float *out = y.data_ptr<float>();
    switch (G) {
        case 32: gemv_int4<32>(xe, xo, xz, M, K, G, w, N, sz, b, out); break;
        case 64: gemv_int4<64>(xe, xo, xz, M, K, G, w, N, sz, b, out); break;
        case 128: gemv_int4<128>(xe, xo, xz, M, K, G, w, N, sz, b, out); break;
        default: gemv_int4<0>(xe, xo, xz, M, K, G, w, N, sz, b, out); break;
    }
    return y;
}

/* The W4A8 operator: the same arguments as int4_gemv; the weight is packed for w4a8_products.cpp's
 * kernel at every call (int4_pack_a8; a model's layers keep their packed copy: int4_a8_packed) */
static at::Tensor int4_gemv_a8(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_zero,
                               int64_t group_size, const std::optional<at::Tensor> &bias) {
    const float *b = check_int4("int4_gemv_a8", 32, x, weight, scale_zero, group_size, bias);
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), G = group_size, T = (N + 31) / 32;
    at::Tensor xc = x.contiguous();
    const std::unique_ptr<uint8_t[]> packed(new uint8_t[T * (K / 4) * 64]);
    const std::unique_ptr<float[]> params(new float[T * (K / G) * 64]);
    pack_int4_a8(weight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t *>(scale_zero.data_ptr<at::BFloat16>()), N,
                 K, G, packed.get(), params.get());
    at::Tensor y = at::empty({M, N}, x.options());
    w4a8(xc.data_ptr<float>(), M, K, G, packed.get(), params.get(), N, b, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("int4_gemv(Tensor x, Tensor weight, Tensor scale_zero, int group_size, Tensor? bias) -> Tensor");
    m.def("int4_gemv_a8(Tensor x, Tensor weight, Tensor scale_zero, int group_size, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("int4_gemv", &int4_gemv);
    m.impl("int4_gemv_a8", &int4_gemv_a8);
}
