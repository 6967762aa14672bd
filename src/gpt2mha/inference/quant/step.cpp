/* gpt2mha's decode step in one call, for int4 models with per_block (W4A8) activations: the
 * operator torch.ops.gpt2mha.decode_step (optional; built with gemv.cpp by gemv.py; step.py is
 * its Python side). One token per row through every block and the head, as GPT2.forward does
 * with a KVCache (core/model.py), in one C++ function: no Python, dispatcher or allocation
 * between the 12 x 4 products of 124M.
 *
 * Why it exists (benchmarks/RESULTS.md, "The decode step in one call"): at batch 1 an int4 124M
 * step reads ~92 MB, about 2.3 ms at this machine's memory speed, and the compiled step
 * (inductor's kernels, its Python wrapper, the operator calls) spent ~0.8 ms more around them;
 * llama.cpp's whole step takes ~2.7.
 *
 * Per row b (its token tokens[b] at position lengths[b], the row's next cache index) and layer l:
 *   h = ln_1(x); qkv = c_attn(h) (W4A8); write k, v at position lengths[b] of row b's cache;
 *   z = softmax(q k^T / sqrt(head_dim)) v over keys 0 .. lengths[b] (the causal mask at one
 *   query); x += c_proj(z); h = ln_2(x); x += mlp.c_proj(gelu(c_fc(h)));
 * then logits = head(ln_f(x)) (int8, float32 activations). Each row's arithmetic is its own
 * (the products' rows are independent; attention reads the row's own keys), so a row's logits do
 * not depend on the other rows. Sums in float32 in a fixed order: within float32 rounding of the
 * model's own step, not the same bits (torch's LayerNorm and softmax sum in other orders). */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "simd.h"

/* Attention runs on the threads from this many multiply-adds (~10 keys at 124M's sizes): at one query it
 * waits on reading the cached keys and values (evicted by the weights every step), not on arithmetic. */
static const int64_t PARALLEL_ATTENTION = 1 << 13;

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* LayerNorm of one row x [E] into y: (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b, the
 * biased variance of openai/gpt-2's norm (E a multiple of 8). */
static void layer_norm(const float *x, int64_t E, const float *w, const float *b, float eps, float *y) {
    __m256 s8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < E; i += 8) s8 = _mm256_add_ps(s8, _mm256_loadu_ps(x + i));
    const float mean = hsum8(s8) / (float)E;
    const __m256 m8 = _mm256_set1_ps(mean);
    __m256 v8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < E; i += 8) {
        const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(x + i), m8);
        v8 = _mm256_fmadd_ps(c, c, v8);
    }
    const __m256 scale = _mm256_set1_ps(std::sqrt(hsum8(v8) / (float)E + eps));
    for (int64_t i = 0; i < E; i += 8) {
        const __m256 c = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8), scale);
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(c, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
    }
}

/* One query q [D] over keys kc [0 .. n) and values vc [n, D] (D a multiple of 8): out [D] =
 * softmax((q k_j) / sqrt(D)) v, the softmax written (s_j - max) / sqrt(D) as attention.cpp's;
 * p [n] scratch. Four keys' dot products at a time, and p v as up to eight independent sums over
 * the keys (one chain of dependent FMAs per key and dimension ran at a quarter of the speed). */
static void attend(const float *q, const float *kc, const float *vc, int64_t n, int64_t D, float *p, float *out) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kc + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + D + d), a1);
            a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * D + d), a3);
        }
        p[j] = hsum8(a0);
        p[j + 1] = hsum8(a1);
        p[j + 2] = hsum8(a2);
        p[j + 3] = hsum8(a3);
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kc + j * D + d), a);
        p[j] = hsum8(a);
    }
    float mx = -INFINITY;
    bool nan = false;
    for (j = 0; j < n; j++) {
        nan |= std::isnan(p[j]);
        mx = std::fmax(mx, p[j]);
    }
    if (nan || !std::isfinite(mx)) mx = NAN;     /* a NaN or infinite score: the row is NaN, as SDPA's */
    const float scale = 1.0f / std::sqrt((float)D);
    const __m256 mx8 = _mm256_set1_ps(mx), sc8 = _mm256_set1_ps(scale);
    __m256 t8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), mx8), sc8));
        _mm256_storeu_ps(p + j, e);
        t8 = _mm256_add_ps(t8, e);
    }
    float total = hsum8(t8);
    for (; j < n; j++) {
        p[j] = exp1((p[j] - mx) * scale);
        total += p[j];
    }
    const __m256 inv = _mm256_set1_ps(total);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {                 /* dims d0 .. d0 + 63: up to 8 sums */
        const int64_t nd = D - d0 < 64 ? (D - d0) / 8 : 8;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < n; k++) {
            const __m256 pk = _mm256_set1_ps(p[k]);
            const float *vk = vc + k * D + d0;
            for (int i = 0; i < nd; i++) a[i] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vk + 8 * i), a[i]);
        }
        for (int i = 0; i < nd; i++) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_div_ps(a[i], inv));
    }
}

/* A tensor argument's check (a clear message, never a read out of bounds): dtype, sizes, contiguous, CPU. */
static void need(const at::Tensor &t, at::ScalarType dtype, std::vector<int64_t> sizes, const char *name, int64_t layer) {
    TORCH_CHECK(t.scalar_type() == dtype && t.sizes().vec() == sizes && t.is_contiguous() && t.device().is_cpu(),
                "decode_step: ", name, layer >= 0 ? " of layer " + std::to_string(layer) : std::string(""),
                " must be a contiguous ", dtype, " CPU tensor ", at::IntArrayRef(sizes), "; got ", t.scalar_type(),
                " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

/* The operator. layers: 16 tensors per block, in order: ln_1 weight, bias; attn.c_attn nibbles
 * [3E, E/2], (scale, zero) [3E, E/G, 2] bf16, bias; attn.c_proj nibbles, pairs, bias; ln_2
 * weight, bias; mlp.c_fc nibbles, pairs, bias; mlp.c_proj nibbles, pairs, bias (the layouts of
 * int4_gemv_a8). k, v: the cache [L, B, h, T_max, D], written at each row's position. */
static at::Tensor decode_step(const at::Tensor &tokens, const at::Tensor &wte, const at::Tensor &wpe,
                              at::TensorList layers, const at::Tensor &ln_f_weight, const at::Tensor &ln_f_bias,
                              const at::Tensor &head_weight, const at::Tensor &head_scales,
                              const std::optional<at::Tensor> &head_bias, const at::Tensor &k, const at::Tensor &v,
                              at::IntArrayRef lengths, int64_t group_size, double eps) {
    TORCH_CHECK(k.dim() == 5, "decode_step: k must be the cache [n_layer, B, n_head, T_max, head_dim]; got ", k.sizes());
    const int64_t L = k.size(0), B = k.size(1), H = k.size(2), T = k.size(3), D = k.size(4), E = H * D, G = group_size;
    TORCH_CHECK(wte.dim() == 2 && wpe.dim() == 2 && head_weight.dim() == 2,
                "decode_step: wte, wpe and head_weight must be 2-D; got ", wte.sizes(), wpe.sizes(), head_weight.sizes());
    const int64_t V = head_weight.size(0), n_vocab = wte.size(0), P = wpe.size(0);
    TORCH_CHECK(D % 8 == 0, "decode_step: head_dim must be a multiple of 8; got ", D);
    TORCH_CHECK(G >= 32 && E % G == 0 && (128 % G == 0 || G % 128 == 0),
                "decode_step: group_size must be 32, 64 or a multiple of 128 dividing n_embd=", E, "; got ", G);
    TORCH_CHECK((int64_t)layers.size() == 16 * L, "decode_step: layers must hold 16 tensors per layer (", 16 * L,
                "); got ", layers.size());
    TORCH_CHECK((int64_t)lengths.size() == B, "decode_step: lengths must hold one position per row (", B, "); got ",
                lengths.size());
    need(k, at::kFloat, {L, B, H, T, D}, "k", -1);
    need(v, at::kFloat, {L, B, H, T, D}, "v", -1);
    need(tokens, at::kLong, {B}, "tokens", -1);
    need(wte, at::kFloat, {n_vocab, E}, "wte", -1);
    need(wpe, at::kFloat, {P, E}, "wpe", -1);
    need(ln_f_weight, at::kFloat, {E}, "ln_f weight", -1);
    need(ln_f_bias, at::kFloat, {E}, "ln_f bias", -1);
    need(head_weight, at::kChar, {V, E}, "head_weight", -1);
    need(head_scales, at::kFloat, {V}, "head_scales", -1);
    if (head_bias.has_value()) need(*head_bias, at::kFloat, {V}, "head_bias", -1);
    const int64_t *tok = tokens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(tok[b] >= 0 && tok[b] < n_vocab, "decode_step: token ", tok[b], " of row ", b,
                    " is not an id in [0, n_vocab=", n_vocab, ")");
        TORCH_CHECK(lengths[b] >= 0 && lengths[b] < T && lengths[b] < P, "decode_step: row ", b, " is at position ",
                    lengths[b], ": the cache holds T_max=", T, " and wpe n_ctx=", P, " positions");
    }
    const int64_t sizes[4][2] = {{3 * E, E}, {E, E}, {4 * E, E}, {E, 4 * E}};     /* [N, K] of the 4 products */
    const char *names[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
    for (int64_t l = 0; l < L; l++) {
        const at::Tensor *t = layers.data() + 16 * l;
        need(t[0], at::kFloat, {E}, "ln_1 weight", l);
        need(t[1], at::kFloat, {E}, "ln_1 bias", l);
        need(t[8], at::kFloat, {E}, "ln_2 weight", l);
        need(t[9], at::kFloat, {E}, "ln_2 bias", l);
        for (int i = 0; i < 4; i++) {
            const int64_t off = i < 2 ? 2 + 3 * i : 10 + 3 * (i - 2), N = sizes[i][0], K = sizes[i][1];
            const std::string name(names[i]);
            need(t[off], at::kByte, {N, K / 2}, (name + " weight").c_str(), l);
            need(t[off + 1], at::kBFloat16, {N, K / G, 2}, (name + " scale_zero").c_str(), l);
            need(t[off + 2], at::kFloat, {N}, (name + " bias").c_str(), l);
        }
    }

    std::vector<float> buf((size_t)(B * (E + E + 3 * E + E + 4 * E + E) + B * H * T));
    float *x = buf.data(), *h = x + B * E, *qkv = h + B * E, *z = qkv + 3 * B * E, *f = z + B * E,
          *y = f + 4 * B * E, *p = y + B * E;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < E; i++)
            x[b * E + i] = wte.data_ptr<float>()[tok[b] * E + i] + wpe.data_ptr<float>()[lengths[b] * E + i];
    auto product = [&](const at::Tensor *t, const float *in, int64_t K, int64_t N, float *out) {
        w4a8(in, B, K, G, t[0].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t *>(t[1].data_ptr<at::BFloat16>()),
             N, t[2].data_ptr<float>(), out);
    };
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = lengths[b] + 1 > longest ? lengths[b] + 1 : longest;
    const float e = (float)eps;
    float *kc = k.data_ptr<float>(), *vc = v.data_ptr<float>();
    for (int64_t l = 0; l < L; l++) {
        const at::Tensor *t = layers.data() + 16 * l;
        for (int64_t b = 0; b < B; b++)
            layer_norm(x + b * E, E, t[0].data_ptr<float>(), t[1].data_ptr<float>(), e, h + b * E);
        product(t + 2, h, E, 3 * E, qkv);
        #pragma omp parallel for collapse(2) schedule(static) if (B * H * longest * D >= PARALLEL_ATTENTION)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hd = 0; hd < H; hd++) {
                const int64_t pos = lengths[b], off = ((l * B + b) * H + hd) * T * D;
                const float *row = qkv + b * 3 * E;
                for (int64_t d = 0; d < D; d++) {
                    kc[off + pos * D + d] = row[E + hd * D + d];
                    vc[off + pos * D + d] = row[2 * E + hd * D + d];
                }
                if (hd + 1 < H)                /* the next head's keys and values: latency, not bandwidth, bound */
                    for (int64_t i = 0; i < (pos + 1) * D; i += 16) {
                        _mm_prefetch((const char *)(kc + off + T * D + i), _MM_HINT_T0);
                        _mm_prefetch((const char *)(vc + off + T * D + i), _MM_HINT_T0);
                    }
                attend(row + hd * D, kc + off, vc + off, pos + 1, D, p + (b * H + hd) * T, z + b * E + hd * D);
            }
        product(t + 5, z, E, E, y);
        for (int64_t i = 0; i < B * E; i++) x[i] += y[i];
        for (int64_t b = 0; b < B; b++)
            layer_norm(x + b * E, E, t[8].data_ptr<float>(), t[9].data_ptr<float>(), e, h + b * E);
        product(t + 10, h, E, 4 * E, f);
        for (int64_t i = 0; i < 4 * B * E; i += 8) _mm256_storeu_ps(f + i, gelu8(_mm256_loadu_ps(f + i)));
        product(t + 13, f, 4 * E, E, y);
        for (int64_t i = 0; i < B * E; i++) x[i] += y[i];
    }
    for (int64_t b = 0; b < B; b++)
        layer_norm(x + b * E, E, ln_f_weight.data_ptr<float>(), ln_f_bias.data_ptr<float>(), e, h + b * E);
    at::Tensor logits = at::empty({B, V}, wte.options());
    gemv(h, B, E, head_weight.data_ptr<int8_t>(), V, head_scales.data_ptr<float>(),
         head_bias.has_value() ? head_bias->data_ptr<float>() : nullptr, logits.data_ptr<float>());
    return logits;
}

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("decode_step(Tensor tokens, Tensor wte, Tensor wpe, Tensor[] layers, Tensor ln_f_weight, Tensor ln_f_bias, "
          "Tensor head_weight, Tensor head_scales, Tensor? head_bias, Tensor(a!) k, Tensor(b!) v, int[] lengths, "
          "int group_size, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2mha, CPU, m) { m.impl("decode_step", &decode_step); }
