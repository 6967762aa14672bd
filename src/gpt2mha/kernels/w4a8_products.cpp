/* int4 weights times 8-bit activations (W4A8, as llama.cpp's q4_0 x q8_0), on weights packed
 * for it: the operators int4_pack_a8 (the packing, once per layer) and int4_a8_packed (the
 * product); products.cpp's int4_gemv_a8 packs per call and runs the same product.
 *
 * Each activation row is rounded to 8 bits per group of G inputs, e = round(x / d) with
 * d = max|x| / 127 over the group (round half to even, as torch.round), and the nibbles q (0..15)
 * multiply e in exact int32 sums. With w = (q - 8) s + z per group (QuantizedLinear's int4):
 *
 *   y[m, n] = sum_g ( float(sum_{k in g} q[n, k] e[m, k]) * (s_g * d_g)  +  o_g * (d_g * A_g) ) + bias[n]
 *
 * o_g = z_g - 8 s_g and A_g = sum_{k in g} e[m, k]. Each output sums its groups in order, each
 * group as those two float32 multiply-adds: one order fixed by K and G alone, so a row's result
 * does not depend on the other rows, the threads, the tiles or the instructions (AVX-512 VNNI's
 * vpdpbusd and AVX2's vpmaddubsw give the same bits: the integer sums are exact and the float
 * operations the same per lane).
 *
 * Why packed: a kernel that reads each weight row along K and reduces every output at the end
 * spends ~8 instructions per 64 weight bytes per activation row, slower than float32 for prompts
 * (benchmarks/results/w4a8_products.json has the packed kernel against float32). Here 32
 * output channels' nibbles for 4 inputs lie in one 64-byte step, the low nibbles channels 0-15
 * and the high ones 16-31, so a step is two vpdpbusd per activation row against 4 bytes of it
 * broadcast (the layout llama.cpp's and oneDNN's int8 GEMMs use), and a tile's weights serve up
 * to 8 rows from registers.
 *
 * Layouts. packed uint8 [T = ceil(N/32), K/4, 64]: byte 4c + j of step s of tile t holds
 * q[32t + c, 4s + j] in its low nibble and q[32t + 16 + c, 4s + j] in its high one (c 0..15,
 * j 0..3; 0 past N). params float32 [T, K/G, 2, 32]: per tile and group, the 32 channels'
 * scales s, then their offsets o = z - 8 s (s and z bf16, o rounded to float32; 0 past N).
 */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>

#include "dispatch.h"
#include "kernels.h"

static inline float bf16_bits(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

void pack_int4_a8(const uint8_t *w, const uint16_t *sz, int64_t N, int64_t K, int64_t G, uint8_t *packed,
                  float *params) {
    const int64_t T = (N + 31) / 32, Kq = K / 4, half = K / 2, ng = K / G;
    auto nib = [&](int64_t n, int64_t k) -> uint8_t {
        return n < N ? (uint8_t)((w[n * half + k / 2] >> (4 * (k & 1))) & 15) : 0;
    };
    #pragma omp parallel for if (N * K >= (1 << 20))
    for (int64_t t = 0; t < T; t++) {
        for (int64_t s = 0; s < Kq; s++) {
            uint8_t *p = packed + (t * Kq + s) * 64;
            for (int64_t c = 0; c < 16; c++)
                for (int64_t j = 0; j < 4; j++)
                    p[4 * c + j] = (uint8_t)(nib(32 * t + c, 4 * s + j) | nib(32 * t + 16 + c, 4 * s + j) << 4);
        }
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c = 0; c < 32; c++) {
                const int64_t n = 32 * t + c;
                const float sc = n < N ? bf16_bits(sz[(n * ng + g) * 2]) : 0.0f;
                const float z = n < N ? bf16_bits(sz[(n * ng + g) * 2 + 1]) : 0.0f;
                params[((t * ng + g) * 2) * 32 + c] = sc;
                params[((t * ng + g) * 2 + 1) * 32 + c] = z - 8.0f * sc;
            }
    }
}

/* One activation row x [K] rounded per group of G (a multiple of 16): e [K] int8, d [ng] and
 * da = d * A [ng]. A group with a non-finite value gets e = 0 and d = NaN (its outputs NaN); one
 * too small for 127 / amax to be finite (amax < ~4e-37) counts as zeros. */
static void round_row(const float *x, int64_t K, int64_t G, int8_t *e, float *d, float *da) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / G; g++) {
        const float *xg = x + g * G;
        __m256 amax8 = zero, bad8 = zero;
        for (int64_t k = 0; k < G; k += 8) {
            const __m256 v = _mm256_loadu_ps(xg + k);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v));
            bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_NEQ_UQ));   /* inf - inf, NaN */
        }
        alignas(32) float a[8];
        _mm256_store_ps(a, amax8);
        float amax = a[0];
        for (int j = 1; j < 8; j++) amax = std::fmax(amax, a[j]);
        const bool finite = _mm256_movemask_ps(bad8) == 0;
        const float dg = finite ? amax / 127.0f : NAN, r = 127.0f / amax;
        const __m256 inv = _mm256_set1_ps(finite && amax > 0.0f && std::isfinite(r) ? r : 0.0f);
        __m256i sum8 = _mm256_setzero_si256();
        for (int64_t k = 0; k < G; k += 16) {
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), inv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k + 8), inv));
            if (!finite) i0 = i1 = _mm256_setzero_si256();
            sum8 = _mm256_add_epi32(sum8, _mm256_add_epi32(i0, i1));
            /* packs per 128-bit lane: [i0 0-3, i1 0-3 | i0 4-7, i1 4-7] -> quads in order, then 16 int8 */
            const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
            _mm_storeu_si128((__m128i *)(e + g * G + k),
                             _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
        }
        alignas(32) int32_t t[8];
        _mm256_store_si256((__m256i *)t, sum8);
        const int32_t sum = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
        d[g] = dg;
        da[g] = dg * (float)sum;
    }
}

struct Rows {
    const int8_t *e;         /* [M, K] */
    const float *d, *da;     /* [M, ng] */
    int64_t K, G, ng;
};

/* Groups g0..g1-1 of MT rows of e (row stride K, from the tile's first input) times a tile pt: the exact sums
 * run on from acc [2 MT, 16] (int32, row i's channels 0-15 then 16-31), and after each group they are stored,
 * cumulative, in sums [g1 - g0, 2 MT, 16]; acc keeps them for the next call. Cumulative, never zeroed between
 * groups: with the accumulators zeroed at each group GCC copied every one at every step and spilled some. */
template <int MT>
TARGET_AVX512_VNNI static inline void sums_vnni(const int8_t *e, int64_t K, const uint8_t *pt, int64_t steps, int64_t g0,
                                         int64_t g1, int32_t *state, int32_t *sums) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i acc[2 * MT];
    for (int i = 0; i < 2 * MT; i++) acc[i] = _mm512_loadu_si512((const void *)(state + 16 * i));
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t s = g * steps; s < (g + 1) * steps; s++) {
            const __m512i v = _mm512_loadu_si512((const void *)(pt + 64 * s));
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int i = 0; i < MT; i++) {
                const __m512i b = _mm512_broadcastd_epi32(_mm_loadu_si32((const void *)(e + i * K + 4 * s)));
                acc[2 * i] = _mm512_dpbusd_epi32(acc[2 * i], lo, b);
                acc[2 * i + 1] = _mm512_dpbusd_epi32(acc[2 * i + 1], hi, b);
            }
        }
        for (int i = 0; i < 2 * MT; i++) _mm512_storeu_si512((void *)(sums + ((g - g0) * 2 * MT + i) * 16), acc[i]);
    }
    for (int i = 0; i < 2 * MT; i++) _mm512_storeu_si512((void *)(state + 16 * i), acc[i]);
}

/* MT rows of a (from m0) times tile pt [K/4, 64] with its params pp [ng, 2, 32]: out [MT, 32]. Groups in
 * blocks of GROUPS: their cumulative sums (sums_vnni), then each group's (this one's less the last) scaled. */
template <int MT>
TARGET_AVX512_VNNI static inline void tile_vnni(const Rows &A, int64_t m0, const uint8_t *pt, const float *pp, float *out) {
    constexpr int64_t GROUPS = 8;
    const int64_t steps = A.G / 4;
    int32_t state[2 * MT * 16], sums[GROUPS * 2 * MT * 16], last[2 * MT * 16];
    std::memset(state, 0, sizeof(state));
    std::memset(last, 0, sizeof(last));
    __m512 f[2 * MT];
    for (int i = 0; i < 2 * MT; i++) f[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < A.ng; g0 += GROUPS) {
        const int64_t g1 = g0 + GROUPS < A.ng ? g0 + GROUPS : A.ng;
        sums_vnni<MT>(A.e + m0 * A.K, A.K, pt, steps, g0, g1, state, sums);
        for (int64_t g = g0; g < g1; g++) {
            const float *pq = pp + g * 64;
            const int32_t *now = sums + (g - g0) * 2 * MT * 16, *before = g == g0 ? last : now - 2 * MT * 16;
            for (int i = 0; i < MT; i++) {
                const __m512 dd = _mm512_set1_ps(A.d[(m0 + i) * A.ng + g]), da = _mm512_set1_ps(A.da[(m0 + i) * A.ng + g]);
                for (int h = 0; h < 2; h++) {
                    const int64_t j = 2 * i + h;
                    const __m512i q = _mm512_sub_epi32(_mm512_loadu_si512((const void *)(now + 16 * j)),
                                                       _mm512_loadu_si512((const void *)(before + 16 * j)));
                    f[j] = _mm512_fmadd_ps(_mm512_loadu_ps(pq + 32 + 16 * h), da,
                                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(_mm512_loadu_ps(pq + 16 * h), dd), f[j]));
                }
            }
        }
        std::memcpy(last, state, sizeof(last));
    }
    for (int i = 0; i < 2 * MT; i++) _mm512_storeu_ps(out + 16 * i, f[i]);
}

/* The same on AVX2: a step's 64 bytes as two halves of 8 channels' low and high nibbles each,
 * vpmaddubsw (a pair of nibble x int8 products never saturates int16) and vpmaddwd against ones */
template <int MT>
static inline void tile_avx2(const Rows &A, int64_t m0, const uint8_t *pt, const float *pp, float *out) {
    const int64_t steps = A.G / 4;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 f[MT][4];     /* channels 0-7, 8-15 (low nibbles), 16-23, 24-31 (high) */
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < 4; j++) f[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < A.ng; g++) {
        __m256i acc[MT][4];
        for (int i = 0; i < MT; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
        const uint8_t *pg = pt + g * steps * 64;
        const int8_t *eg = A.e + m0 * A.K + g * A.G;
        for (int64_t s = 0; s < steps; s++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pg + 64 * s));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pg + 64 * s + 32));
            const __m256i w[4] = {_mm256_and_si256(v0, low), _mm256_and_si256(v1, low),
                                  _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                  _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)};
            for (int i = 0; i < MT; i++) {
                int32_t four;
                std::memcpy(&four, eg + i * A.K + 4 * s, 4);
                const __m256i b = _mm256_set1_epi32(four);
                for (int j = 0; j < 4; j++)
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], b), ones));
            }
        }
        const float *pq = pp + g * 64;
        for (int i = 0; i < MT; i++) {
            const __m256 dd = _mm256_set1_ps(A.d[(m0 + i) * A.ng + g]), da = _mm256_set1_ps(A.da[(m0 + i) * A.ng + g]);
            for (int j = 0; j < 4; j++)
                f[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(pq + 32 + 8 * j), da,
                                          _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]),
                                                          _mm256_mul_ps(_mm256_loadu_ps(pq + 8 * j), dd), f[i][j]));
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 32 * i + 8 * j, f[i][j]);
}

/* tiles t0..t1-1 times every row: y [M, N] (+ bias) */
TARGET_AVX512_VNNI static void tiles_vnni(const Rows &A, int64_t M, const uint8_t *packed, const float *params, int64_t N,
                                   const float *bias, float *y, int64_t t0, int64_t t1) {
    float s[8 * 32];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *pt = packed + t * (A.K / 4) * 64;
        const float *pp = params + t * A.ng * 64;
        const int64_t n0 = 32 * t, nn = N - n0 < 32 ? N - n0 : 32;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t mt = M - m0 < 8 ? M - m0 : 8;
            switch (mt) {
                case 8: tile_vnni<8>(A, m0, pt, pp, s); break;
                case 7: tile_vnni<7>(A, m0, pt, pp, s); break;
                case 6: tile_vnni<6>(A, m0, pt, pp, s); break;
                case 5: tile_vnni<5>(A, m0, pt, pp, s); break;
                case 4: tile_vnni<4>(A, m0, pt, pp, s); break;
                case 3: tile_vnni<3>(A, m0, pt, pp, s); break;
                case 2: tile_vnni<2>(A, m0, pt, pp, s); break;
                default: tile_vnni<1>(A, m0, pt, pp, s); break;
            }
            for (int64_t i = 0; i < mt; i++)
                for (int64_t c = 0; c < nn; c++) y[(m0 + i) * N + n0 + c] = s[32 * i + c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
}

static void tiles_avx2(const Rows &A, int64_t M, const uint8_t *packed, const float *params, int64_t N,
                       const float *bias, float *y, int64_t t0, int64_t t1) {
    float s[2 * 32];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *pt = packed + t * (A.K / 4) * 64;
        const float *pp = params + t * A.ng * 64;
        const int64_t n0 = 32 * t, nn = N - n0 < 32 ? N - n0 : 32;
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int64_t mt = M - m0 < 2 ? M - m0 : 2;
            if (mt == 2)
                tile_avx2<2>(A, m0, pt, pp, s);
            else
                tile_avx2<1>(A, m0, pt, pp, s);
            for (int64_t i = 0; i < mt; i++)
                for (int64_t c = 0; c < nn; c++) y[(m0 + i) * N + n0 + c] = s[32 * i + c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
}

void w4a8(const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *packed, const float *params, int64_t N,
          const float *bias, float *y) {
    const int64_t ng = K / G;
    const std::unique_ptr<int8_t[]> e(new int8_t[M * K]);
    const std::unique_ptr<float[]> dd(new float[2 * M * ng]);
    const bool many = M * K * N >= (1 << 18);
    #pragma omp parallel for if (many && M >= 16)
    for (int64_t m = 0; m < M; m++) round_row(x + m * K, K, G, e.get() + m * K, dd.get() + m * ng, dd.get() + (M + m) * ng);
    const Rows A{e.get(), dd.get(), dd.get() + M * ng, K, G, ng};
    /* threads take chunks of tiles of about 128 KiB of weights (products.cpp's note on threads) */
    const int64_t T = (N + 31) / 32, per = chunk_rows(K * 16, T), chunks = (T + per - 1) / per;
    const bool v = dispatch::on(dispatch::W4A8);
    #pragma omp parallel for schedule(dynamic, 1) if (many)
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t t0 = i * per, t1 = t0 + per < T ? t0 + per : T;
        if (v)
            tiles_vnni(A, M, packed, params, N, bias, y, t0, t1);
        else
            tiles_avx2(A, M, packed, params, N, bias, y, t0, t1);
    }
}

/* int4_pack_a8(weight [N, K/2] uint8, scale_zero [N, K/G, 2] bf16, G) -> (packed, params) */
static std::tuple<at::Tensor, at::Tensor> int4_pack_a8(const at::Tensor &weight, const at::Tensor &scale_zero,
                                                       int64_t group_size) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                    weight.device().is_cpu() && weight.size(0) >= 1 && weight.size(1) >= 1,
                "int4_pack_a8: weight must be a contiguous uint8 CPU tensor [N, K/2]; got ", weight.scalar_type(), " ",
                weight.sizes());
    const int64_t N = weight.size(0), K = 2 * weight.size(1), G = group_size;
    TORCH_CHECK(G >= 32 && G % 32 == 0 && K % G == 0, "int4_pack_a8: group_size must be a multiple of 32 dividing K=", K,
                "; got ", G);
    TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == N && scale_zero.size(1) == K / G &&
                    scale_zero.size(2) == 2 && scale_zero.scalar_type() == at::kBFloat16 &&
                    scale_zero.is_contiguous() && scale_zero.device().is_cpu(),
                "int4_pack_a8: scale_zero must be a contiguous bfloat16 CPU tensor [N=", N, ", K/group_size=", K / G,
                ", 2]; got ", scale_zero.scalar_type(), " ", scale_zero.sizes());
    const int64_t T = (N + 31) / 32;
    at::Tensor packed = at::empty({T, K / 4, 64}, weight.options());
    at::Tensor params = at::empty({T, K / G, 2, 32}, weight.options().dtype(at::kFloat));
    pack_int4_a8(weight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t *>(scale_zero.data_ptr<at::BFloat16>()), N,
                 K, G, packed.data_ptr<uint8_t>(), params.data_ptr<float>());
    return {packed, params};
}

/* int4_a8_packed(x [M, K] float32, packed, params, G, N, bias [N] or None) -> y [M, N] */
static at::Tensor int4_a8_packed(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &params,
                                 int64_t group_size, int64_t n_out, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(0) >= 1,
                "int4_a8_packed: x must be a float32 CPU tensor [M >= 1, K]; got ", x.scalar_type(), " ", x.sizes());
    const int64_t M = x.size(0), K = x.size(1), G = group_size, N = n_out;
    TORCH_CHECK(G >= 32 && G % 32 == 0 && K % G == 0, "int4_a8_packed: group_size must be a multiple of 32 dividing K=",
                K, "; got ", G);
    TORCH_CHECK(N >= 1, "int4_a8_packed: n_out must be >= 1; got ", N);
    const int64_t T = (N + 31) / 32;
    TORCH_CHECK(packed.dim() == 3 && packed.size(0) == T && packed.size(1) == K / 4 && packed.size(2) == 64 &&
                    packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu(),
                "int4_a8_packed: packed must be a contiguous uint8 CPU tensor [ceil(n_out/32)=", T, ", K/4=", K / 4,
                ", 64]; got ", packed.scalar_type(), " ", packed.sizes());
    TORCH_CHECK(params.dim() == 4 && params.size(0) == T && params.size(1) == K / G && params.size(2) == 2 &&
                    params.size(3) == 32 && params.scalar_type() == at::kFloat && params.is_contiguous() &&
                    params.device().is_cpu(),
                "int4_a8_packed: params must be a contiguous float32 CPU tensor [", T, ", K/group_size=", K / G,
                ", 2, 32]; got ", params.scalar_type(), " ", params.sizes());
    const float *b = nullptr;
    if (bias.has_value()) {
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                        bias->is_contiguous() && bias->device().is_cpu(),
                    "int4_a8_packed: bias must be a contiguous float32 CPU tensor [N=", N, "]; got ",
                    bias->scalar_type(), " ", bias->sizes());
        b = bias->data_ptr<float>();
    }
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    w4a8(xc.data_ptr<float>(), M, K, G, packed.data_ptr<uint8_t>(), params.data_ptr<float>(), N, b, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("int4_pack_a8(Tensor weight, Tensor scale_zero, int group_size) -> (Tensor, Tensor)");
    m.def("int4_a8_packed(Tensor x, Tensor packed, Tensor params, int group_size, int n_out, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("int4_pack_a8", &int4_pack_a8);
    m.impl("int4_a8_packed", &int4_a8_packed);
}
