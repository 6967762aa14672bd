/* gpt2mha's float32 products for decode-sized inputs (inference/dense.py wraps them; cached_forward.cpp
 * calls them for float32 and fp16 models): the operators torch.ops.gpt2mha.conv1d_f32 and linear_f32,
 * and conv1d_f16 and linear_f16.
 *
 *   conv1d_f32:  y[m, n] = bias[n] + sum_k x[m, k] * w[k, n]    w [K, N]: GPT-2's Conv1D layout
 *   linear_f32:  y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]    w [N, K]: the LM head (wte), F.linear's
 *
 * float32 activations and weights, float32 sums: the model's own products, in an order of our own.
 * fp16 weights: the same code (templates over the weight's type W), each weight converted to float32 as
 * it is loaded (F16C's vcvtph2ps: exact), so the same sums bit for bit as over w.float(); conv1d_f16 then
 * rounds each output to fp16 once (a fp16 model's GEMM), GELU after it, rounded again. The operators
 * round x to fp16 first; cached_forward's activations already are.
 *
 * Why they exist: a float32 124M decode step reads 497 MB of weights, and torch's products (MKL's GEMV
 * and small GEMMs, called 49 times from Python) read them at about half the memory's speed; at eight rows
 * MKL's small GEMM runs slower than at one (docs/performance.md: a step's products against torch's).
 *
 * Every output is summed in one fixed order whatever M, the threads or the instruction set, so a row's
 * result never depends on the other rows (batch invariance) and the AVX2 and AVX-512 paths give the same
 * bits:
 *
 * - conv1d_f32: each output lane is its own chain, acc = bias (or 0), then acc = fma(x[m, k], w[k, n],
 *   acc) for k = 0, 1, ..., K-1; vectors hold 8 or 16 consecutive outputs, so no horizontal sum. The
 *   partial sums are kept in y between blocks of weight rows (float32 stores: exact).
 *   One row of float32 on AVX-512 (a decode step: bound by the weights' reads): each thread takes one
 *   contiguous span of the columns and reads KB rows at a time along the whole span, one vector of each
 *   row in turn (row16: KB long sequential streams; x's KB values in registers: on a Zen 4 tiles read one
 *   row's weights at about half a sum's speed, these streams half as fast again: docs/performance.md).
 *   Everything else below a prompt (walk.h): each thread one contiguous span of the
 *   columns, walked KB_ROWS weight rows at a time in tiles of 8 rows x 3 vectors (4 x 3 on AVX2), each
 *   weight tile used for every row of x while it is in L1, every tile prefetching into L2 the weights of
 *   the tile PREFETCH_TILES ahead in its thread's walk (faster than tiles that do not at 2-63 rows, and
 *   at one row than KB streams for fp16, not for float32 on AVX-512). One row of float32 on AVX2: each
 *   thread streams 4 weight rows at a time along its whole span, y's span in L1 (row8_streams; the tiles
 *   for fp16). A prompt (PROMPT_ROWS rows or more, AVX-512) copies each 48-column
 *   strip once into a contiguous buffer and runs every row down the whole of K on it.
 * - linear_f32 and linear_f16 (the head): head_products.cpp says their order.
 *
 * One exception to "the same bits": a NaN made from NaNs of both signs (x[k] and w[k, n] both NaN, or a
 * NaN sum meeting a NaN product) may come out with either sign, alone or in a batch, on either path: x86
 * keeps its first NaN operand, and the compiler picks the operands' order of each fma (vfmadd132ps or
 * 231ps). NaN logits are an error upstream (the model's sampling refuses them) whatever their sign.
 *
 * GELU (GPT-2's, simd.h's gelu8/gelu16) may be applied to conv1d_f32's outputs as they are written
 * (the MLP's c_fc). Compiled with -ffp-contract=off: nothing is fused that this file does not say. */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>

#include "dispatch.h"
#include "kernels.h"
#include "walk.h"

/* Weight rows per block of row16 (x's KB values in registers); the tiles' blocks are walk.h's KB_ROWS
 * (tiles of 8 rows x 3 vectors on AVX-512, 24 accumulators; 4 x 3 on AVX2, 12 of 16 registers) */
static const int64_t KB = 16;
/* From PROMPT_ROWS rows, AVX-512 takes packed strips (prompt16; before them, blocks of 128 weight rows,
 * ~1.3x faster than KB's there, and the strips ~1.06x faster again) */
static const int64_t PROMPT_ROWS = 64;

/* ---- conv1d_f32, AVX-512 ---- */

/* the mask of vector r of a tile whose last vector holds `tail` lanes (1 .. 16) of nv */
TARGET_AVX512 static inline __mmask16 lane_mask(int r, int nv, int tail) {
    return r < nv - 1 ? (__mmask16)0xFFFF : r == nv - 1 ? (__mmask16)((1u << tail) - 1) : (__mmask16)0;
}

/* rows [0, MR) of x (row stride ldx) times w's rows [k0, k1) at columns j .. j + 16 NR, accumulated into
 * y (row stride N); `first`: start from bias (or 0), else from y; `last`: apply GELU if gelu. FULL: all
 * NR vectors whole; else the tile holds nv vectors, the last `tail` lanes (masked loads and stores).
 * pfo (not 0): each weight row's lines at pfo elements on are prefetched into L2 (walk's tile ahead). */
template <int MR, int NR, bool FULL, typename W>
TARGET_AVX512 static void tile16(const float *x, int64_t ldx, const W *w, int64_t N, int64_t k0, int64_t k1, int64_t j,
                        int nv, int tail, const float *bias, bool first, bool last, bool gelu, float *y, int64_t pfo) {
    __m512 acc[MR][NR];
    __mmask16 mk[NR];
    for (int r = 0; r < NR; r++) mk[r] = FULL ? (__mmask16)0xFFFF : lane_mask(r, nv, tail);
    for (int r = 0; r < NR; r++) {
        const __m512 b = first && bias ? ld16<FULL>(mk[r], bias + j + 16 * r) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) acc[m][r] = first ? b : ld16<FULL>(mk[r], y + m * N + j + 16 * r);
    }
    for (int64_t k = k0; k < k1; k++) {
        const W *wk = w + k * N + j;
        __m512 wv[NR];
        if (pfo)                                       /* walk.h's note says why */
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(wk + pfo + 16 * r), _MM_HINT_T1);
        for (int r = 0; r < NR; r++) wv[r] = ld16<FULL>(mk[r], wk + 16 * r);
        for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) {
            const __m512 v = last && gelu ? gelu16(acc[m][r]) : acc[m][r];
            if (FULL)
                _mm512_storeu_ps(y + m * N + j + 16 * r, v);
            else if (mk[r])
                _mm512_mask_storeu_ps(y + m * N + j + 16 * r, mk[r], v);
        }
}

/* tile16 for a whole tile or an edge one */
template <int MR, int NR, typename W>
TARGET_AVX512 static inline void tile16_any(bool full, const float *x, int64_t ldx, const W *w, int64_t N, int64_t k0,
                                   int64_t k1, int64_t j, int nv, int tail, const float *bias, bool first, bool last,
                                   bool gelu, float *y, int64_t pfo) {
    if (full)
        tile16<MR, NR, true, W>(x, ldx, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, y, pfo);
    else
        tile16<MR, NR, false, W>(x, ldx, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, y, pfo);
}

/* every row of x over w's rows [k0, k1) at columns j .. j + 48 (fewer at N), 8 rows at a time; the
 * first 8 prefetch (pfo: walk's) */
template <typename W>
TARGET_AVX512 static void rows16(const float *x, int64_t M, int64_t K, const W *w, int64_t N, int64_t k0, int64_t k1,
                        int64_t j, int64_t pfo, const float *bias, bool gelu, float *y) {
    const bool first = k0 == 0, last = k1 == K;
    const int64_t cols = std::min<int64_t>(48, N - j);
    const int nv = (int)((cols + 15) / 16), tail = (int)(cols - 16 * (nv - 1));
    const bool full = cols == 48;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8, pfo = 0)
        tile16_any<8, 3, W>(full, x + m * K, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, y + m * N, pfo);
    const float *xm = x + m * K;
    float *ym = y + m * N;
    switch (M - m) {
        case 7: tile16_any<7, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 6: tile16_any<6, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 5: tile16_any<5, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 4: tile16_any<4, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 3: tile16_any<3, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 2: tile16_any<2, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        case 1: tile16_any<1, 3, W>(full, xm, K, w, N, k0, k1, j, nv, tail, bias, first, last, gelu, ym, pfo); break;
        default: break;
    }
}

/* ---- conv1d_f32 over many rows (a prompt), AVX-512: packed strips ---- */

/* w's columns [j, j + cols) (cols <= 48) as a contiguous strip [K][48], zeros past cols */
template <typename W>
TARGET_AVX512 static void pack_strip(const W *w, int64_t K, int64_t N, int64_t j, int64_t cols, float *out) {
    __mmask16 mk[3];
    for (int r = 0; r < 3; r++) mk[r] = (__mmask16)((1u << std::clamp<int64_t>(cols - 16 * r, 0, 16)) - 1);
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < 3; r++) _mm512_storeu_ps(out + 48 * k + 16 * r, ld16<false>(mk[r], w + k * N + j + 16 * r));
}

/* MR rows of x times a packed strip over all of K: tile16's chains (bias, then one fma per k in order),
 * written once (GELU if gelu) */
template <int MR>
TARGET_AVX512 static void tile_packed(const float *x, int64_t ldx, const float *strip, int64_t K, int64_t N, int64_t j,
                             int64_t cols, const float *bias, bool gelu, float *y) {
    __m512 acc[MR][3];
    __mmask16 mk[3];
    for (int r = 0; r < 3; r++) {
        mk[r] = (__mmask16)((1u << std::clamp<int64_t>(cols - 16 * r, 0, 16)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mk[r], bias + j + 16 * r) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) acc[m][r] = b;
    }
    for (int64_t k = 0; k < K; k++, strip += 48) {
        const __m512 w0 = _mm512_loadu_ps(strip), w1 = _mm512_loadu_ps(strip + 16), w2 = _mm512_loadu_ps(strip + 32);
        for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
            acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < 3; r++)
            if (mk[r]) _mm512_mask_storeu_ps(y + m * N + j + 16 * r, mk[r], gelu ? gelu16(acc[m][r]) : acc[m][r]);
}

/* The strips over the threads; each packs its strip once (then in L2 for every row group; read in place,
 * a strip's lines lie 4N bytes apart and fall in few cache sets), then runs all rows on it, 8 at a time. */
template <typename W>
TARGET_AVX512 static void prompt16(const float *x, int64_t M, int64_t K, const W *w, int64_t N, const float *bias,
                          bool gelu, float *y) {
    const int64_t strips = (N + 47) / 48;
    #pragma omp parallel
    {
        std::unique_ptr<float[]> strip(new float[K * 48]);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < strips; s++) {
            const int64_t j = 48 * s, cols = std::min<int64_t>(48, N - j);
            pack_strip(w, K, N, j, cols, strip.get());
            int64_t m = 0;
            for (; m + 8 <= M; m += 8) tile_packed<8>(x + m * K, K, strip.get(), K, N, j, cols, bias, gelu, y + m * N);
            const float *xm = x + m * K;
            float *ym = y + m * N;
            switch (M - m) {
                case 7: tile_packed<7>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 6: tile_packed<6>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 5: tile_packed<5>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 4: tile_packed<4>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 3: tile_packed<3>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 2: tile_packed<2>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                case 1: tile_packed<1>(xm, K, strip.get(), K, N, j, cols, bias, gelu, ym); break;
                default: break;
            }
        }
    }
}

/* One row of float32 (AVX-512): each thread one contiguous span of the columns, the weights read KB rows
 * at a time along the whole span, one vector of each row in turn (KB sequential streams; the partial sums
 * in y, in L1), x's KB values broadcast once a block: tile16's chains. */
TARGET_AVX512 static void row16(const float *x, int64_t K, const float *w, int64_t N, int64_t c0, int64_t c1,
                       const float *bias, bool gelu, float *y) {
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kn = std::min(KB, K - k0);
        const bool first = k0 == 0, last = k0 + kn == K;
        __m512 xv[KB];
        for (int64_t r = 0; r < kn; r++) xv[r] = _mm512_set1_ps(x[k0 + r]);
        const float *wk = w + k0 * N;
        for (int64_t j = c0; j < c1; j += 16) {
            const __mmask16 mk = c1 - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c1 - j)) - 1);
            __m512 a = first ? (bias ? _mm512_maskz_loadu_ps(mk, bias + j) : _mm512_setzero_ps())
                             : _mm512_maskz_loadu_ps(mk, y + j);
            if (kn == KB && mk == 0xFFFF) {
                for (int r = 0; r < KB; r++)            /* the next block's line, into L2 ("Prefetch into L2") */
                    _mm_prefetch((const char *)(wk + (r + KB) * N + j), _MM_HINT_T1);
                for (int r = 0; r < KB; r++) a = _mm512_fmadd_ps(xv[r], _mm512_loadu_ps(wk + r * N + j), a);
                _mm512_storeu_ps(y + j, last && gelu ? gelu16(a) : a);
                continue;
            }
            for (int64_t r = 0; r < kn; r++) a = _mm512_fmadd_ps(xv[r], _mm512_maskz_loadu_ps(mk, wk + r * N + j), a);
            _mm512_mask_storeu_ps(y + j, mk, last && gelu ? gelu16(a) : a);
        }
    }
}

template <typename W>
TARGET_AVX512 static void conv1d16(const float *x, int64_t M, int64_t K, const W *w, int64_t N, const float *bias,
                          bool gelu, float *y) {
    if (M >= PROMPT_ROWS) {                            /* a prompt: packed strips (~1.06x the blocks below) */
        prompt16(x, M, K, w, N, bias, gelu, y);
        return;
    }
    if constexpr (std::is_same_v<W, float>)            /* one row of float32: KB streams (fp16: walked, faster) */
        if (M == 1)
            return spans(1, K, N, 16, [&](int64_t c0, int64_t c1) { row16(x, K, w, N, c0, c1, bias, gelu, y); });
    /* one row of fp16: tiles of 96 columns, 192 bytes of each weight row as float32's 48 */
    if constexpr (!std::is_same_v<W, float>)
        if (M == 1)
            return walk(1, K, N, 96, [&](int64_t k0, int64_t k1, int64_t j, int64_t pfo) {
                const int64_t cols = std::min<int64_t>(96, N - j);
                const int nv = (int)((cols + 15) / 16), tail = (int)(cols - 16 * (nv - 1));
                tile16_any<1, 6, W>(cols == 96, x, K, w, N, k0, k1, j, nv, tail, bias, k0 == 0, k1 == K, gelu, y, pfo);
            }, [](int64_t, int64_t) {});
    /* 2 to 63 rows: tiles of 8 rows x 3 vectors along each thread's span */
    walk(M, K, N, 48, [&](int64_t k0, int64_t k1, int64_t j, int64_t pfo) { rows16(x, M, K, w, N, k0, k1, j, pfo, bias, gelu, y); },
         [](int64_t, int64_t) {});
}

/* ---- conv1d_f32, AVX2: the same chains on 8 lanes ---- */


/* tile16's chains on 8 lanes: rows [0, MR) of x over w's rows [k0, k1) at columns j .. j + cols (cols <=
 * 8 NR), accumulated into y. FULL (cols == 8 NR): plain loads and stores; else masked (AMD's masked
 * stores are slow: the edge tiles only). */
template <int MR, int NR, bool FULL, typename W>
static void tile8(const float *x, int64_t ldx, const W *w, int64_t N, int64_t k0, int64_t k1, int64_t j,
                  int64_t cols, const float *bias, bool first, bool last, bool gelu, float *y, int64_t pfo) {
    __m256 acc[MR][NR];
    __m256i mk[NR];
    for (int r = 0; r < NR; r++) mk[r] = FULL ? _mm256_set1_epi32(-1) : mask8(std::clamp<int64_t>(cols - 8 * r, 0, 8));
    for (int r = 0; r < NR; r++) {
        const __m256 b = !(first && bias) ? _mm256_setzero_ps()
                         : FULL ? _mm256_loadu_ps(bias + j + 8 * r) : _mm256_maskload_ps(bias + j + 8 * r, mk[r]);
        for (int m = 0; m < MR; m++)
            acc[m][r] = first ? b : FULL ? _mm256_loadu_ps(y + m * N + j + 8 * r)
                                         : _mm256_maskload_ps(y + m * N + j + 8 * r, mk[r]);
    }
    for (int64_t k = k0; k < k1; k++) {
        const W *wk = w + k * N + j;
        if (pfo)                                       /* tile16's prefetch: each line of the row */
            for (int r = 0; r < NR; r += 2) _mm_prefetch((const char *)(wk + pfo + 8 * r), _MM_HINT_T1);
        __m256 wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = FULL ? ld8_all(wk + 8 * r) : ld8(wk + 8 * r, mk[r], cols - 8 * r);
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) {
            const __m256 v = last && gelu ? gelu8(acc[m][r]) : acc[m][r];
            if (FULL)
                _mm256_storeu_ps(y + m * N + j + 8 * r, v);
            else if (cols > 8 * r)
                _mm256_maskstore_ps(y + m * N + j + 8 * r, mk[r], v);
        }
}

template <int MR, int NR, typename W>
static inline void tile8_any(const float *x, int64_t ldx, const W *w, int64_t N, int64_t k0, int64_t k1, int64_t j,
                             int64_t cols, const float *bias, bool first, bool last, bool gelu, float *y, int64_t pfo) {
    if (cols == 8 * NR)
        tile8<MR, NR, true, W>(x, ldx, w, N, k0, k1, j, cols, bias, first, last, gelu, y, pfo);
    else
        tile8<MR, NR, false, W>(x, ldx, w, N, k0, k1, j, cols, bias, first, last, gelu, y, pfo);
}

static inline float w1f(float v) { return v; }
static inline float w1f(uint16_t h) { return _cvtsh_ss(h); }

/* One row on AVX2 (a decode step, bound by the weights' reads): each thread keeps its span [c0, c1) of y
 * (a few KB: in L1) and streams 4 weight rows at a time along the whole span, each row's part read once,
 * in order, as the memory delivers it best; every output is the same chain as the tiles' (bias or 0, then
 * fma over k in order), so its bits do not change. Tiles of 24 columns read each weight row in 96-byte
 * pieces 256 rows apart, which the memory serves more slowly than whole rows in order (docs/performance.md,
 * "Every GPT-2 size"); over fp16 weights the tiles stay faster, so they keep them. */
template <typename W>
static void row8_streams(const float *x, int64_t K, const W *w, int64_t N, const float *bias, bool gelu, float *y) {
    spans(1, K, N, 8, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; c++) y[c] = bias ? bias[c] : 0.0f;
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
            const __m256 x0 = _mm256_set1_ps(x[k]), x1 = _mm256_set1_ps(x[k + 1]), x2 = _mm256_set1_ps(x[k + 2]),
                         x3 = _mm256_set1_ps(x[k + 3]);
            const W *w0 = w + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
            int64_t c = c0;
            for (; c + 8 <= c1; c += 8) {
                __m256 a = _mm256_loadu_ps(y + c);
                a = _mm256_fmadd_ps(x0, ld8_all(w0 + c), a);
                a = _mm256_fmadd_ps(x1, ld8_all(w1 + c), a);
                a = _mm256_fmadd_ps(x2, ld8_all(w2 + c), a);
                a = _mm256_fmadd_ps(x3, ld8_all(w3 + c), a);
                _mm256_storeu_ps(y + c, a);
            }
            for (; c < c1; c++) {
                float a = y[c];
                a = std::fmaf(x[k], w1f(w0[c]), a);
                a = std::fmaf(x[k + 1], w1f(w1[c]), a);
                a = std::fmaf(x[k + 2], w1f(w2[c]), a);
                y[c] = std::fmaf(x[k + 3], w1f(w3[c]), a);
            }
        }
        for (; k < K; k++) {
            const __m256 xk = _mm256_set1_ps(x[k]);
            const W *wk = w + k * N;
            int64_t c = c0;
            for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(y + c, _mm256_fmadd_ps(xk, ld8_all(wk + c), _mm256_loadu_ps(y + c)));
            for (; c < c1; c++) y[c] = std::fmaf(x[k], w1f(wk[c]), y[c]);
        }
        if (gelu) {                                    /* gelu8 = gelu1, lane for lane */
            int64_t c = c0;
            for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(y + c, gelu8(_mm256_loadu_ps(y + c)));
            for (; c < c1; c++) y[c] = gelu1(y[c]);
        }
    });
}

template <typename W>
static void conv1d8(const float *x, int64_t M, int64_t K, const W *w, int64_t N, const float *bias, bool gelu,
                    float *y) {
    /* every M: tiles of 4 rows x 3 vectors (1 x 3 for the rest) along each thread's span */
    if constexpr (std::is_same_v<W, float>)          /* fp16 weights: the tiles (faster for them) */
        if (M == 1)
            return row8_streams(x, K, w, N, bias, gelu, y);
    walk(M, K, N, 24, [&](int64_t k0, int64_t k1, int64_t j, int64_t pfo) {
        const bool first = k0 == 0, last = k1 == K;
        const int64_t cols = std::min<int64_t>(24, N - j);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4, pfo = 0)
            tile8_any<4, 3, W>(x + m * K, K, w, N, k0, k1, j, cols, bias, first, last, gelu, y + m * N, pfo);
        for (; m < M; m++, pfo = 0)
            tile8_any<1, 3, W>(x + m * K, K, w, N, k0, k1, j, cols, bias, first, last, gelu, y + m * N, pfo);
    }, [](int64_t, int64_t) {});
}

void conv1d_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, bool gelu,
                float *y) {
    if (dispatch::on(dispatch::CONV1D))
        conv1d16(x, M, K, w, N, bias, gelu, y);
    else
        conv1d8(x, M, K, w, N, bias, gelu, y);
}

void round_fp16(float *p, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(p + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; i++) p[i] = _cvtsh_ss(_cvtss_sh(p[i], _MM_FROUND_TO_NEAREST_INT));
}

TARGET_AVX512 static void gelu_all16(float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, gelu16(_mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = gelu1(y[i]);
}

void gelu_all(float *y, int64_t n) {
    if (dispatch::on(dispatch::GELU))
        return gelu_all16(y, n);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gelu8(_mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = gelu1(y[i]);
}

void conv1d_f16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, bool gelu,
                float *y) {
    if (dispatch::on(dispatch::CONV1D))
        conv1d16(x, M, K, w, N, bias, false, y);
    else
        conv1d8(x, M, K, w, N, bias, false, y);
    round_fp16(y, M * N);                              /* a fp16 model's GEMM: float32 sums rounded once */
    if (!gelu)
        return;
    gelu_all(y, M * N);
    round_fp16(y, M * N);                              /* and its GELU's output */
}

/* ---- the operators ---- */

/* x [M, K] float32, w float32 or float16 (wdt) [K, N] (conv1d) or [N, K] (linear), bias [N] or None:
 * checked, named */
static const float *check(const char *name, const at::Tensor &x, const at::Tensor &w,
                          const std::optional<at::Tensor> &bias, bool conv, at::ScalarType wdt, int64_t &N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.numel() > 0, name,
                ": x must be a non-empty float32 CPU tensor [M, K]; got ", x.scalar_type(), " ", x.sizes());
    const int64_t K = x.size(1);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == wdt && w.device().is_cpu() && w.is_contiguous() &&
                    w.size(conv ? 0 : 1) == K && w.size(conv ? 1 : 0) >= 1, name, ": weight must be a contiguous ",
                wdt == at::kHalf ? "float16" : "float32", " CPU tensor ", conv ? "[K=" : "[N, K=", K, conv ? ", N]" : "]",
                "; got ", w.scalar_type(), " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
    N = w.size(conv ? 1 : 0);
    if (!bias.has_value())
        return nullptr;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->device().is_cpu() &&
                    bias->is_contiguous(), name, ": bias must be a contiguous float32 CPU tensor [N=", N, "]; got ",
                bias->scalar_type(), " ", bias->sizes());
    return bias->data_ptr<float>();
}

/* x as a contiguous float32 copy holding fp16 values (a fp16 model's activations), or x itself */
static at::Tensor activations(const at::Tensor &x, bool fp16) {
    if (!fp16)
        return x.contiguous();
    at::Tensor xc = x.contiguous().clone();
    round_fp16(xc.data_ptr<float>(), xc.numel());
    return xc;
}

static at::Tensor conv1d_op(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                            bool gelu, bool fp16) {
    int64_t N = 0;
    const float *b = check(fp16 ? "conv1d_f16" : "conv1d_f32", x, weight, bias, true, fp16 ? at::kHalf : at::kFloat, N);
    const at::Tensor xc = activations(x, fp16);
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    if (fp16)
        conv1d_f16(xc.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t *>(weight.data_ptr<at::Half>()),
                   N, b, gelu, y.data_ptr<float>());
    else
        conv1d_f32(xc.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), N, b, gelu, y.data_ptr<float>());
    return y;
}

static at::Tensor linear_op(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                            bool fp16) {
    int64_t N = 0;
    const float *b = check(fp16 ? "linear_f16" : "linear_f32", x, weight, bias, false, fp16 ? at::kHalf : at::kFloat, N);
    const at::Tensor xc = activations(x, fp16);
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    if (fp16)
        linear_f16(xc.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t *>(weight.data_ptr<at::Half>()),
                   N, b, y.data_ptr<float>());
    else
        linear_f32(xc.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), N, b, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("conv1d_f32(Tensor x, Tensor weight, Tensor? bias, bool gelu=False) -> Tensor");
    m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("conv1d_f16(Tensor x, Tensor weight, Tensor? bias, bool gelu=False) -> Tensor");
    m.def("linear_f16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) {
    m.impl("conv1d_f32", [](const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b, bool gelu) {
        return conv1d_op(x, w, b, gelu, false);
    });
    m.impl("linear_f32", [](const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b) {
        return linear_op(x, w, b, false);
    });
    m.impl("conv1d_f16", [](const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b, bool gelu) {
        return conv1d_op(x, w, b, gelu, true);
    });
    m.impl("linear_f16", [](const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b) {
        return linear_op(x, w, b, true);
    });
}
