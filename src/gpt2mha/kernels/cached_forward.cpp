/* gpt2mha's forward in one call for quantized, float32, bf16 and fp16 models on the CPU: the operator
 * torch.ops.gpt2mha.cached_forward (in the library build.py compiles; inference/native.py
 * is its Python side). T new tokens per row through every block and the head, as GPT2.forward
 * does with a KVCache and last_only (core/model.py), in one C++ function: no Python, dispatcher,
 * hook points or allocation between the 12 x 4 products of 124M. Products: int4 with per_block
 * activations (W4A8, w4a8_products.cpp's w4a8, prompts too), int8 with per_row activations (W7A8, per_row), or
 * float32 (float_products.cpp's conv1d_f32 over the model's own [in, out] weights, linear_f32
 * over the head's [V, E]: no rounding the dtype does not imply, each sum in a fixed order), bf16
 * (bf16_products.cpp) or fp16 (float_products.cpp's conv1d_f16: conv1d_f32's sums over the fp16
 * weights' exact float32 values, each output rounded to fp16 as a fp16 model's GEMM rounds it); a
 * 16-bit model's activations, embeddings and cache rounded where its own forward rounds them.
 *
 * Why it exists: at batch 1 an int4 124M step reads ~92 MB, a few milliseconds at a CPU's memory
 * speed, and a compiled step (inductor's kernels, its Python wrapper, the operator calls) spends
 * about a third as much again around them, enough to put it behind llama.cpp's whole step.
 * A prompt likewise spends a share of its time outside the products and attention (LayerNorm,
 * residual adds, module calls).
 *
 * Per row b (its new tokens at positions lengths[b] ..) and layer l:
 *   h = ln_1(x); qkv = c_attn(h); write k, v at the new positions of row b's cache;
 *   z = softmax(q k^T / sqrt(head_dim)) v over keys 0 .. each query's position (OpenAI's causal
 *   mask); x += c_proj(z); h = ln_2(x); x += mlp.c_proj(gelu(c_fc(h)));
 * then logits = head(ln_f(x)) at each row's last token. Each row's arithmetic is its own (the
 * products round and sum rows independently; attention reads the row's own keys), so a row's
 * logits do not depend on the other rows. Sums in float32 in a fixed order, not the model's
 * bits (torch's LayerNorm and softmax sum in other orders): a last-bit difference that the
 * products' 8-bit rounding of activations now and then turns into one rounding step (native.py). */
#include "simd.h" /* first: its note on immintrin.h says why */

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "kernels.h"

/* Attention runs on the threads from this many multiply-adds (~10 keys at 124M's sizes): at one query it
 * waits on reading the cached keys and values (evicted by the weights every step), not on arithmetic. */
static const int64_t PARALLEL_ATTENTION = 1 << 13;

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of a[0 .. E) (E a multiple of 8), or of (a - m)^2 with sq: four 8-lane sums over the 8-blocks
 * i mod 4 (four independent chains of adds), folded ((s0 + s2) + (s1 + s3)), then hsum8 */
static inline float sum_blocks(const float *a, int64_t E, bool sq, float m) {
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t i = 0; i < E; i += 8) {
        const int j = (int)((i >> 3) & 3);
        if (sq) {
            const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(a + i), mv);
            s[j] = _mm256_fmadd_ps(c, c, s[j]);
        } else {
            s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(a + i));
        }
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3])));
}

/* LayerNorm of one row x [E] into y: (x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + b, the
 * biased variance of openai/gpt-2's norm, one reciprocal square root multiplied in as torch's
 * LayerNorm does (E a multiple of 8). */
static void layer_norm(const float *x, int64_t E, const float *w, const float *b, float eps, float *y) {
    const float mean = sum_blocks(x, E, false, 0.0f) / (float)E;
    const float rstd = 1.0f / std::sqrt(sum_blocks(x, E, true, mean) / (float)E + eps);
    const __m256 m8 = _mm256_set1_ps(mean), r8 = _mm256_set1_ps(rstd);
    for (int64_t i = 0; i < E; i += 8) {
        const __m256 c = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8), r8);
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(c, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
    }
}

/* A model's 16-bit dtype (its activations, weights and cache), or none (float32, quantized) */
enum class Half { none, bf16, fp16 };

/* p[0 .. n) rounded to the model's 16-bit dtype (nothing for none) */
static inline void round_half(Half hf, float *p, int64_t n) {
    if (hf == Half::bf16)
        round_bf16(p, n);
    else if (hf == Half::fp16)
        round_fp16(p, n);
}

/* one 16-bit value (its bits) as float32, exact */
static inline float widen(Half hf, uint16_t u) {
    if (hf == Half::fp16)
        return _cvtsh_ss(u);
    const uint32_t w = (uint32_t)u << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
}

/* x += y (if y), then h = LayerNorm(x) for rows r of x, y, h [M, E]; rows on the threads from
 * ROWS_PARALLEL rows (a 128-token prompt's 25 LayerNorms took ~1 ms on one). bf16, fp16: x and h rounded
 * after each (a 16-bit model's add and LayerNorm round their outputs). */
static const int64_t ROWS_PARALLEL = 16;
static void add_norm(float *x, const float *y, int64_t M, int64_t E, const float *w, const float *b, float eps, float *h,
                     Half hf = Half::none) {
    #pragma omp parallel for schedule(static) if (M >= ROWS_PARALLEL)
    for (int64_t r = 0; r < M; r++) {
        if (y) {
            for (int64_t i = 0; i < E; i += 8)
                _mm256_storeu_ps(x + r * E + i, _mm256_add_ps(_mm256_loadu_ps(x + r * E + i), _mm256_loadu_ps(y + r * E + i)));
            round_half(hf, x + r * E, E);
        }
        layer_norm(x + r * E, E, w, b, eps, h + r * E);
        round_half(hf, h + r * E, E);
    }
}

/* a fp16 cache's element (its bits), a type of its own beside bf16's uint16_t */
struct fp16_bits {
    uint16_t bits;
};

/* 8 cached keys or values as float32: a float32 cache's, a bf16 cache's (its bits widened), a fp16 cache's */
static inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load8(const fp16_bits *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One query q [D] over keys kc [0 .. n) and values vc [n, D] (D a multiple of 8; float32, bf16 bits
 * C = uint16_t or fp16 bits C = fp16_bits): out [D] = softmax((q k_j) / sqrt(D)) v, the softmax
 * written (s_j - max) / sqrt(D) as causal_attention.cpp's; p [n] scratch. Four keys' dot products at a
 * time, and p v as up to eight independent sums over the keys (one chain of dependent FMAs per key and
 * dimension ran at a quarter of the speed). */
template <typename C>
static void attend(const float *q, const C *kc, const C *vc, int64_t n, int64_t D, float *p, float *out) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const C *k0 = kc + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, load8(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, load8(k0 + D + d), a1);
            a2 = _mm256_fmadd_ps(qd, load8(k0 + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qd, load8(k0 + 3 * D + d), a3);
        }
        p[j] = hsum8(a0);
        p[j + 1] = hsum8(a1);
        p[j + 2] = hsum8(a2);
        p[j + 3] = hsum8(a3);
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kc + j * D + d), a);
        p[j] = hsum8(a);
    }
    const float total = softmax_row(p, n, 1.0f / std::sqrt((float)D));   /* NaN: a NaN row, as SDPA's */
    if (sizeof(C) == 2)        /* a 16-bit model: its weights rounded to its dtype before p v (SDPA's flash kernel) */
        round_half(std::is_same_v<C, fp16_bits> ? Half::fp16 : Half::bf16, p, n);
    const __m256 tot = _mm256_set1_ps(total);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {                 /* dims d0 .. d0 + 63: up to 8 sums */
        const int64_t nd = D - d0 < 64 ? (D - d0) / 8 : 8;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < n; k++) {
            const __m256 pk = _mm256_set1_ps(p[k]);
            const C *vk = vc + k * D + d0;
            for (int i = 0; i < nd; i++) a[i] = _mm256_fmadd_ps(pk, load8(vk + 8 * i), a[i]);
        }
        for (int i = 0; i < nd; i++) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_div_ps(a[i], tot));
    }
}

/* y[0 .. n) (bf16 values) -> bf16(gelu(y)), as a bf16 model's GELU rounds */
static void gelu_bf16(float *y, int64_t n) {
    gelu_all(y, n);
    round_bf16(y, n);
}

/* A tensor argument's check (a clear message, never a read out of bounds): dtype, sizes, contiguous, CPU. */
static void need(const at::Tensor &t, at::ScalarType dtype, std::vector<int64_t> sizes, const std::string &name,
                 int64_t layer = -1) {
    TORCH_CHECK(t.scalar_type() == dtype && t.sizes().vec() == sizes && t.is_contiguous() && t.device().is_cpu(),
                "cached_forward: ", name, layer >= 0 ? " of layer " + std::to_string(layer) : std::string(""),
                " must be a contiguous ", dtype, " CPU tensor ", at::IntArrayRef(sizes), "; got ", t.scalar_type(),
                " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

/* One product y [M, N] = x [M, K] W^T + b of a layer given as its tensors t: three for W4A8
 * (w4a8_products.cpp's packed [ceil(N/32), K/4, 64] uint8 and params [ceil(N/32), K/G, 2, 32] float32,
 * bias [N]: every row, prompts as steps), five for per_row (packed
 * [ceil(N/32), ceil(K/4), 32, 4] int8, qsum [N] int32, scales [N], wsum [N], bias [N]), two for
 * float32, bf16 and fp16 (the Conv1D's weight [K, N] as the model holds it, its bias [N] as float32:
 * float_products.cpp, bf16_products.cpp). */
static const int64_t FLOAT32 = -1, BF16 = -2, FP16 = -3;
/* a bf16 prompt of this many rows or more multiplies by torch's float32 GEMM over the widened weight on
 * CPUs without AVX-512 BF16 (conv1d_bf16 adds on 8 float32 lanes there); with it, conv1d_bf16's packed strips run close to
 * oneDNN's speed (docs/performance.md) and give a row's products the bits it has alone */
static const int64_t ONEDNN_ROWS = 32;
struct Product {
    int64_t G;               /* group size: W4A8; 0: per_row; FLOAT32; BF16; FP16 */
    bool prompt = false;     /* T > 1: without AVX-512 BF16, a bf16 prompt of ONEDNN_ROWS rows takes oneDNN's GEMM */
    int count() const { return G < 0 ? 2 : G ? 3 : 5; }
    /* M rows of a bf16 prompt on oneDNN's GEMM (no AVX-512 BF16): a row's sums are not the 8-lane kernel's */
    bool onednn(int64_t M) const { return G == BF16 && prompt && M >= ONEDNN_ROWS && !dispatch::on(dispatch::BF16); }
    void check(const at::Tensor *t, int64_t N, int64_t K, const std::string &name, int64_t layer, bool bias = true) const {
        if (G < 0) {
            need(t[0], G == BF16 ? at::kBFloat16 : G == FP16 ? at::kHalf : at::kFloat, {K, N}, name + " weight", layer);
        } else if (G) {
            need(t[0], at::kByte, {(N + 31) / 32, K / 4, 64}, name + " packed", layer);
            need(t[1], at::kFloat, {(N + 31) / 32, K / G, 2, 32}, name + " params", layer);
        } else {
            need(t[0], at::kChar, {(N + 31) / 32, (K + 3) / 4, 32, 4}, name + " packed", layer);
            need(t[1], at::kInt, {N}, name + " qsum", layer);
            need(t[2], at::kFloat, {N}, name + " scales", layer);
            need(t[3], at::kFloat, {N}, name + " wsum", layer);
        }
        if (bias) need(t[count() - 1], at::kFloat, {N}, name + " bias", layer);
    }
    void operator()(const at::Tensor *t, const float *x, int64_t M, int64_t K, int64_t N, float *y, bool gelu) const {
        if (G == FLOAT32) {
            conv1d_f32(x, M, K, t[0].data_ptr<float>(), N, t[1].data_ptr<float>(), gelu, y);
        } else if (onednn(M)) {
            /* a bf16 prompt without AVX-512 BF16: the model's own product (float32 sums of the exact products
             * of bf16 values, rounded to bf16 once) as torch's float32 GEMM (oneDNN/MKL's sgemm) over the
             * weight widened to float32 (exact), then rounded: torch's bf16 addmm has no fast kernel on
             * such CPUs (docs/performance.md, "Every GPT-2 size"). x holds bf16 values and the bias is exact
             * in bf16, so the one rounding is the output's. */
            const auto f32 = at::TensorOptions().dtype(at::kFloat);
            const at::Tensor xf = at::from_blob(const_cast<float *>(x), {M, K}, f32);
            at::Tensor yf = at::from_blob(y, {M, N}, f32);
            at::addmm_out(yf, t[1], xf, t[0].to(at::kFloat));
            round_bf16(y, M * N);
            if (gelu) gelu_bf16(y, M * N);
        } else if (G == FP16) {
            conv1d_f16(x, M, K, reinterpret_cast<const uint16_t *>(t[0].data_ptr<at::Half>()), N, t[1].data_ptr<float>(),
                       gelu, y);
        } else if (G == BF16) {
            conv1d_bf16(x, M, K, reinterpret_cast<const uint16_t *>(t[0].data_ptr<at::BFloat16>()), N,
                        t[1].data_ptr<float>(), gelu, y);
        } else if (G) {
            w4a8(x, M, K, G, t[0].data_ptr<uint8_t>(), t[1].data_ptr<float>(), N, t[2].data_ptr<float>(), y);
            if (gelu)
                gelu_all(y, M * N);
        } else {
            per_row(x, M, K, t[0].data_ptr<int8_t>(), N, t[1].data_ptr<int32_t>(), t[2].data_ptr<float>(),
                    t[3].data_ptr<float>(), t[4].data_ptr<float>(), gelu, y);
        }
    }
};

/* Product's G for the products of kind (named by the caller): "w4a8" in groups of group_size (a multiple of
 * 32 dividing n_embd, checked below), "w7a8" (per_row), "float32", "bf16", "fp16" (group_size 0: their
 * products have no groups); an empty kind: G = group_size as it is (> 0: W4A8, 0: per_row, FLOAT32, BF16,
 * FP16). */
static int64_t product_code(c10::string_view kind, int64_t group_size) {
    if (kind.empty()) return group_size;
    if (kind == "w4a8") {
        TORCH_CHECK(group_size > 0, "cached_forward: kind 'w4a8' needs the products' group_size > 0; got ", group_size);
        return group_size;
    }
    const std::pair<const char *, int64_t> kinds[] = {{"w7a8", 0}, {"float32", FLOAT32}, {"bf16", BF16}, {"fp16", FP16}};
    for (const auto &named : kinds)
        if (kind == named.first) {
            TORCH_CHECK(group_size == 0, "cached_forward: kind '", kind, "' takes group_size=0 (only w4a8's products "
                        "come in groups); got ", group_size);
            return named.second;
        }
    TORCH_CHECK(false, "cached_forward: kind must be 'w4a8', 'w7a8', 'float32', 'bf16' or 'fp16' (or empty: the kind "
                "from group_size); got '", kind, "'");
    return 0;                                            /* not reached */
}

/* The operator (see the file's comment). tokens [B, T]: T new tokens per row, row b's first at
 * its cache index lengths[b] (with T > 1 every row at the same index). layers: per block ln_1
 * weight, bias, attn.c_attn, attn.c_proj, ln_2 weight, bias, mlp.c_fc, mlp.c_proj, each product
 * as Product's tensors (kind, or with an empty kind group_size: > 0 W4A8, 0 per_row). head: the int8 head as int8_gemv's
 * (weight [V, E], scales [V]) or per_row's four tensors, or an int4 head as W4A8's two (in the
 * blocks' group_size), then its bias or an empty tensor. k, v:
 * the cache [L, B, h, T_max, D] (rows may be a view of a larger cache: each row's [h, T_max, D]
 * contiguous), written at the new tokens' positions. Returns each row's last logits [B, V]. */
static at::Tensor cached_forward(const at::Tensor &tokens, const at::Tensor &wte, const at::Tensor &wpe,
                                 at::TensorList layers, const at::Tensor &ln_f_weight, const at::Tensor &ln_f_bias,
                                 at::TensorList head, const at::Tensor &k, const at::Tensor &v, at::IntArrayRef lengths,
                                 int64_t group_size, double eps, c10::string_view kind) {
    group_size = product_code(kind, group_size);
    TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.sizes() == v.sizes(),
                "cached_forward: k and v must be the cache [n_layer, B, n_head, T_max, head_dim]; got ", k.sizes(),
                " and ", v.sizes());
    const int64_t L = k.size(0), B = k.size(1), H = k.size(2), Tm = k.size(3), D = k.size(4), E = H * D;
    TORCH_CHECK(L >= 1 && B >= 1 && H >= 1 && Tm >= 1 && D >= 1, "cached_forward: the cache must have every size >= 1 "
                "[n_layer, B, n_head, T_max, head_dim]; got ", k.sizes());
    auto span = [](const at::Tensor &t) {                 /* the bytes t's elements lie in */
        int64_t last = 0;
        for (int64_t i = 0; i < t.dim(); i++) last += (t.size(i) - 1) * t.stride(i);
        const char *p0 = static_cast<const char *>(t.data_ptr());
        return std::make_pair(p0, p0 + (last + 1) * t.element_size());
    };
    const auto ks = span(k), vs = span(v);
    TORCH_CHECK(!(ks.first < vs.second && vs.first < ks.second), "cached_forward: k and v share memory: a cache "
                "needs separate storage for keys and values");
    TORCH_CHECK(!k.requires_grad() && !v.requires_grad(), "cached_forward: k and v are written in place and must not "
                "require grad");
    TORCH_CHECK(std::isfinite(eps) && eps > 0, "cached_forward: eps must be a positive number; got ", eps);
    /* a bf16 or fp16 model (group_size BF16, FP16): its embeddings, products, head and cache in that dtype */
    const Half hf = group_size == BF16 ? Half::bf16 : group_size == FP16 ? Half::fp16 : Half::none;
    const bool bf = hf != Half::none;                   /* 16-bit activations, cache and embeddings */
    const at::ScalarType act = hf == Half::bf16 ? at::kBFloat16 : hf == Half::fp16 ? at::kHalf : at::kFloat;
    for (const at::Tensor *c : {&k, &v})
        TORCH_CHECK(c->scalar_type() == act && c->device().is_cpu() && c->stride(4) == 1 && c->stride(3) == D &&
                    c->stride(2) == Tm * D && (B == 1 || c->stride(1) >= H * Tm * D) && c->stride(0) >= B * H * Tm * D,
                    "cached_forward: k and v must be ", act, " CPU caches whose rows [n_head, T_max, head_dim] are "
                    "each contiguous; got ", c->scalar_type(), " strides ", c->strides());
    TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) >= 1,
                "cached_forward: tokens must be [B=", B, ", T >= 1]; got ", tokens.sizes());
    const int64_t T = tokens.size(1);
    int64_t M = B * T;                                  /* rows; B in a prompt's last block */
    TORCH_CHECK(wte.dim() == 2 && wpe.dim() == 2, "cached_forward: wte and wpe must be 2-D; got ", wte.sizes(), " and ",
                wpe.sizes());
    const int64_t n_vocab = wte.size(0), P = wpe.size(0);
    TORCH_CHECK(D % 8 == 0, "cached_forward: head_dim must be a multiple of 8; got ", D);
    const Product product{group_size, tokens.dim() == 2 && tokens.size(1) > 1};
    TORCH_CHECK(group_size == 0 || group_size == FLOAT32 || group_size == BF16 || group_size == FP16 ||
                    (group_size >= 32 && group_size % 32 == 0 && E % group_size == 0),
                "cached_forward: group_size must be 0 (per_row), -1 (float32), -2 (bf16), -3 (fp16) or a multiple of 32 dividing "
                "n_embd=", E, "; got ", group_size);
    const int64_t per_layer = 4 + 4 * product.count();
    TORCH_CHECK((int64_t)layers.size() == per_layer * L, "cached_forward: layers must hold ", per_layer,
                " tensors per layer (", per_layer * L, "); got ", layers.size());
    TORCH_CHECK((int64_t)lengths.size() == B, "cached_forward: lengths must hold one position per row (", B, "); got ",
                lengths.size());
    need(tokens, at::kLong, {B, T}, "tokens");
    need(wte, act, {n_vocab, E}, "wte");
    need(wpe, act, {P, E}, "wpe");
    need(ln_f_weight, at::kFloat, {E}, "ln_f weight");
    need(ln_f_bias, at::kFloat, {E}, "ln_f bias");
    const int64_t *tok = tokens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(T == 1 || lengths[b] == lengths[0], "cached_forward: with T=", T,
                    " new tokens every row must hold the same length; got ", lengths);
        TORCH_CHECK(lengths[b] >= 0 && lengths[b] <= Tm - T && lengths[b] <= P - T, "cached_forward: row ", b,
                    " at position ", lengths[b], " with ", T, " new tokens: the cache holds T_max=", Tm,
                    " and wpe n_ctx=", P, " positions");
        for (int64_t t = 0; t < T; t++)
            TORCH_CHECK(tok[b * T + t] >= 0 && tok[b * T + t] < n_vocab, "cached_forward: token ", tok[b * T + t],
                        " of row ", b, " is not an id in [0, n_vocab=", n_vocab, ")");
    }
    const bool head_per_row = !head.empty() && head[0].dim() == 4;
    const bool head_w4a8 = !head_per_row && !head.empty() && head[0].scalar_type() == at::kByte;
    const bool head_f32 = head.size() == 2 && head[0].scalar_type() == at::kFloat;
    const bool head_bf16 = head.size() == 2 && head[0].scalar_type() == at::kBFloat16;
    const bool head_f16 = head.size() == 2 && head[0].scalar_type() == at::kHalf;
    TORCH_CHECK(head.size() == (head_per_row ? 5u : head_f32 || head_bf16 || head_f16 ? 2u : 3u) && head[head_per_row ? 1 : 0].dim() >= 1,
                "cached_forward: head must be int8_gemv's weight [V, E], scales and bias (or an empty tensor), "
                "per_row's packed, qsum [V], scales, wsum and bias, W4A8's packed [ceil(V/32), E/4, 64], params "
                "and bias, or a float32, bf16 or fp16 weight [V, E] and bias; got ", head.size(), " tensors");
    TORCH_CHECK(!head_w4a8 || group_size > 0, "cached_forward: an int4 head (W4A8 packed uint8) needs the blocks' "
                "group_size > 0 (W4A8); got group_size=", group_size);
    const int64_t V = head_per_row ? head[1].size(0) : head_w4a8 ? n_vocab : head[0].size(0);   /* W4A8's: padded tiles */
    if (head_f32 || head_bf16 || head_f16) {
        need(head[0], head[0].scalar_type(), {V, E}, "head weight");
    } else if (head_per_row || head_w4a8) {
        Product{head_w4a8 ? group_size : 0}.check(head.data(), V, E, "head", -1, false);
    } else {
        need(head[0], at::kChar, {V, E}, "head weight");
        need(head[1], at::kFloat, {V}, "head scales");
    }
    const at::Tensor &head_bias = head[head.size() - 1];
    if (head_bias.numel() > 0) need(head_bias, at::kFloat, {V}, "head bias");
    const int64_t sizes[4][2] = {{3 * E, E}, {E, E}, {4 * E, E}, {E, 4 * E}};   /* [N, K] of the 4 products */
    const char *names[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
    const int64_t pc = product.count(), at_[4] = {2, 2 + pc, 4 + 2 * pc, 4 + 3 * pc}, ln2 = 2 + 2 * pc;
    for (int64_t l = 0; l < L; l++) {
        const at::Tensor *t = layers.data() + per_layer * l;
        need(t[0], at::kFloat, {E}, "ln_1 weight", l);
        need(t[1], at::kFloat, {E}, "ln_1 bias", l);
        need(t[ln2], at::kFloat, {E}, "ln_2 weight", l);
        need(t[ln2 + 1], at::kFloat, {E}, "ln_2 bias", l);
        for (int i = 0; i < 4; i++) product.check(t + at_[i], sizes[i][0], sizes[i][1], names[i], l);
    }

    const int64_t S = lengths[0] + T;                   /* keys every row reads when T > 1 */
    const std::unique_ptr<float[]> buf(new float[M * (E + E + 3 * E + E + 4 * E + E) + (T == 1 ? B * H * Tm : 0)]);
    float *x = buf.get(), *h = x + M * E, *qkv = h + M * E, *z = qkv + 3 * M * E, *f = z + M * E, *y = f + 4 * M * E,
          *p = y + M * E;
    if (bf) {                                           /* 16-bit + 16-bit, rounded: the model's add */
        const uint16_t *wt = static_cast<const uint16_t *>(wte.data_ptr()), *wp = static_cast<const uint16_t *>(wpe.data_ptr());
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < E; i++)
                    x[(b * T + t) * E + i] = widen(hf, wt[tok[b * T + t] * E + i]) + widen(hf, wp[(lengths[b] + t) * E + i]);
        round_half(hf, x, M * E);
    } else {
        const float *wt = wte.data_ptr<float>(), *wp = wpe.data_ptr<float>();
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < E; i++)
                    x[(b * T + t) * E + i] = wt[tok[b * T + t] * E + i] + wp[(lengths[b] + t) * E + i];
    }
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = lengths[b] + 1 > longest ? lengths[b] + 1 : longest;
    const float e = (float)eps;
    float *kd = bf ? nullptr : k.data_ptr<float>(), *vd = bf ? nullptr : v.data_ptr<float>();
    uint16_t *kh = bf ? static_cast<uint16_t *>(k.data_ptr()) : nullptr, *vh = bf ? static_cast<uint16_t *>(v.data_ptr()) : nullptr;
    const int64_t kl = k.stride(0), kb = k.stride(1), vl = v.stride(0), vb = v.stride(1);
    for (int64_t l = 0; l < L; l++) {
        const at::Tensor *t = layers.data() + per_layer * l;
        /* x += the last block's MLP output (y), then ln_1 */
        add_norm(x, l > 0 ? y : nullptr, M, E, t[0].data_ptr<float>(), t[1].data_ptr<float>(), e, h, hf);
        product(t + at_[0], h, M, E, 3 * E, qkv, false);
        /* the new keys and values into the cache (on the threads for a prompt: ~0.6 ms of a 128-token one's ~21 on one) */
        #pragma omp parallel for collapse(2) schedule(static) if (M >= ROWS_PARALLEL)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hd = 0; hd < H; hd++)
                for (int64_t tt = 0; tt < T; tt++) {
                    const float *row = qkv + (b * T + tt) * 3 * E + hd * D;
                    const int64_t at_pos = (hd * Tm + lengths[b] + tt) * D;
                    if (hf == Half::fp16) {     /* fp16 values: converted exactly */
                        for (int64_t d = 0; d < D; d++) {
                            kh[l * kl + b * kb + at_pos + d] = _cvtss_sh(row[E + d], _MM_FROUND_TO_NEAREST_INT);
                            vh[l * vl + b * vb + at_pos + d] = _cvtss_sh(row[2 * E + d], _MM_FROUND_TO_NEAREST_INT);
                        }
                        continue;
                    }
                    if (bf) {                  /* bf16 values: their top halves are their bits */
                        for (int64_t d = 0; d < D; d++) {
                            uint32_t uk, uv;
                            std::memcpy(&uk, row + E + d, 4);
                            std::memcpy(&uv, row + 2 * E + d, 4);
                            kh[l * kl + b * kb + at_pos + d] = (uint16_t)(uk >> 16);
                            vh[l * vl + b * vb + at_pos + d] = (uint16_t)(uv >> 16);
                        }
                        continue;
                    }
                    std::memcpy(kd + l * kl + b * kb + at_pos, row + E, D * sizeof(float));
                    std::memcpy(vd + l * vl + b * vb + at_pos, row + 2 * E, D * sizeof(float));
                }
        at::Tensor o;
        if (T == 1) {
            #pragma omp parallel for collapse(2) schedule(static) if (B * H * longest * D >= PARALLEL_ATTENTION)
            for (int64_t b = 0; b < B; b++)
                for (int64_t hd = 0; hd < H; hd++) {
                    const int64_t n = lengths[b] + 1, ko = l * kl + b * kb + hd * Tm * D, vo = l * vl + b * vb + hd * Tm * D;
                    const size_t es = bf ? 2 : 4;
                    const char *kc = bf ? (const char *)(kh + ko) : (const char *)(kd + ko),
                               *vc = bf ? (const char *)(vh + vo) : (const char *)(vd + vo);
                    if (hd + 1 < H)            /* the next head's keys and values: latency, not bandwidth, bound */
                        for (int64_t i = 0; i < n * D * (int64_t)es; i += 64) {
                            _mm_prefetch(kc + Tm * D * es + i, _MM_HINT_T0);
                            _mm_prefetch(vc + Tm * D * es + i, _MM_HINT_T0);
                        }
                    float *pp = p + (b * H + hd) * Tm, *out = z + b * E + hd * D;
                    if (hf == Half::fp16)
                        attend(qkv + b * 3 * E + hd * D, reinterpret_cast<const fp16_bits *>(kh + ko),
                               reinterpret_cast<const fp16_bits *>(vh + vo), n, D, pp, out);
                    else if (bf)
                        attend(qkv + b * 3 * E + hd * D, kh + ko, vh + vo, n, D, pp, out);
                    else
                        attend(qkv + b * 3 * E + hd * D, kd + ko, vd + vo, n, D, pp, out);
                }
            round_half(hf, z, M * E);
        } else {                                        /* a prompt: causal_attention.cpp's kernel */
            const auto opts = at::TensorOptions().dtype(at::kFloat);
            const at::Tensor q = at::from_blob(qkv, {B, H, T, D}, {T * 3 * E, D, 3 * E, 1}, opts);
            at::Tensor kk, vv;
            if (bf && S == T) {                         /* a first prompt: its keys and values are qkv's (16-bit values) */
                kk = at::from_blob(qkv + E, {B, H, S, D}, {T * 3 * E, D, 3 * E, 1}, opts);
                vv = at::from_blob(qkv + 2 * E, {B, H, S, D}, {T * 3 * E, D, 3 * E, 1}, opts);
            } else if (bf) {                            /* a 16-bit cache's keys and values as float32 (exact) */
                kk = at::empty({B, H, S, D}, opts);
                vv = at::empty({B, H, S, D}, opts);
                float *kf = kk.data_ptr<float>(), *vf = vv.data_ptr<float>();
                #pragma omp parallel for collapse(2) schedule(static)
                for (int64_t b = 0; b < B; b++)
                    for (int64_t hd = 0; hd < H; hd++)
                        for (int64_t i = 0; i < S * D; i++) {
                            kf[(b * H + hd) * S * D + i] = widen(hf, kh[l * kl + b * kb + hd * Tm * D + i]);
                            vf[(b * H + hd) * S * D + i] = widen(hf, vh[l * vl + b * vb + hd * Tm * D + i]);
                        }
            } else {
                kk = at::from_blob(kd + l * kl, {B, H, S, D}, {kb, Tm * D, D, 1}, opts);
                vv = at::from_blob(vd + l * vl, {B, H, S, D}, {vb, Tm * D, D, 1}, opts);
            }
            /* a bf16 model's on vdpbf16ps where the CPU has it (faster: two multiply-adds an instruction),
             * else on float32 lanes */
            const auto attention = [&](const at::Tensor &qq) {
                return hf == Half::bf16 && dispatch::on(dispatch::ATTENTION_BF16) ? causal_attention_bf16(qq, kk, vv)
                                                                                  : causal_attention(qq, kk, vv);
            };
            if (l + 1 < L || product.onednn(M)) {      /* (oneDNN's products: every row stays) */
                o = attention(q);                       /* [B, T, h, D] in memory: the rows of z */
            } else {
                /* the last block: only each row's last token reaches the logits, so from here on only those
                 * B rows (its query alone, then x's last rows moved to rows 0 .. B - 1); the cache already
                 * holds every position's keys and values. Each row's outputs are the bits it has in the
                 * whole prompt: every kernel here gives a row the bits it has alone. */
                const at::Tensor q1 = at::from_blob(qkv + (T - 1) * 3 * E, {B, H, 1, D}, {T * 3 * E, D, 3 * E, 1}, opts);
                o = attention(q1);                      /* [B, 1, h, D] */
                for (int64_t b = 0; b < B; b++) std::memmove(x + b * E, x + (b * T + T - 1) * E, E * sizeof(float));
                M = B;
            }
            round_half(hf, o.data_ptr<float>(), M * E);
        }
        const float *zz = T == 1 ? z : o.data_ptr<float>();
        product(t + at_[1], zz, M, E, E, y, false);
        add_norm(x, y, M, E, t[ln2].data_ptr<float>(), t[ln2 + 1].data_ptr<float>(), e, h, hf);
        product(t + at_[2], h, M, E, 4 * E, f, true);
        product(t + at_[3], f, M, 4 * E, E, y, false);
    }
    for (int64_t b = 0; b < B; b++) {                   /* each row's last token: x += y, ln_f */
        const int64_t r = M == B ? b : b * T + T - 1;   /* a prompt's last block left its last tokens at rows 0 .. B - 1 */
        for (int64_t i = 0; i < E; i++) x[r * E + i] += y[r * E + i];
        round_half(hf, x + r * E, E);
        layer_norm(x + r * E, E, ln_f_weight.data_ptr<float>(), ln_f_bias.data_ptr<float>(), e, h + b * E);
        round_half(hf, h + b * E, E);
    }
    at::Tensor logits = at::empty({B, V}, wte.options().dtype(at::kFloat));
    const float *hb = head_bias.numel() > 0 ? head_bias.data_ptr<float>() : nullptr;
    if (head_f32)
        linear_f32(h, B, E, head[0].data_ptr<float>(), V, hb, logits.data_ptr<float>());
    else if (head_f16)
        linear_f16(h, B, E, reinterpret_cast<const uint16_t *>(head[0].data_ptr<at::Half>()), V, hb, logits.data_ptr<float>());
    else if (head_bf16)
        linear_bf16(h, B, E, reinterpret_cast<const uint16_t *>(head[0].data_ptr<at::BFloat16>()), V, hb,
                    logits.data_ptr<float>());
    else if (head_per_row)
        per_row(h, B, E, head[0].data_ptr<int8_t>(), V, head[1].data_ptr<int32_t>(), head[2].data_ptr<float>(),
                head[3].data_ptr<float>(), hb, false, logits.data_ptr<float>());
    else if (head_w4a8)
        w4a8(h, B, E, group_size, head[0].data_ptr<uint8_t>(), head[1].data_ptr<float>(), V, hb, logits.data_ptr<float>());
    else
        gemv(h, B, E, head[0].data_ptr<int8_t>(), V, head[1].data_ptr<float>(), hb, logits.data_ptr<float>());
    return logits;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("cached_forward(Tensor tokens, Tensor wte, Tensor wpe, Tensor[] layers, Tensor ln_f_weight, "
          "Tensor ln_f_bias, Tensor[] head, Tensor(a!) k, Tensor(b!) v, int[] lengths, int group_size, float eps, "
          "str kind=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) { m.impl("cached_forward", &cached_forward); }
