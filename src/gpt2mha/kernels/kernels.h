/* What cached_forward.cpp calls in products.cpp, int4_products.cpp, float_products.cpp, head_products.cpp,
 * bf16_products.cpp and causal_attention.cpp (one library: every .cpp here, build.py's SOURCES). */
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

/* y [M, N] = x [M, K] @ (w [N, K] int8 * scales [N])^T + bias [N] (bias may be NULL): float32
 * activations, each weight converted to float32 (int8_gemv). */
void gemv(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, const float *scales, const float *bias,
          float *y);

/* y [M, N] = W4A8 product of x [M, K], rows rounded to 8 bits per group of G, with int4 weights packed by
 * pack_int4_a8 (packed [ceil(N/32), K/4, 64], params [ceil(N/32), K/G, 2, 32]), + bias (may be NULL)
 * (w4a8_products.cpp, the operator int4_a8_packed). */
void w4a8(const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *packed, const float *params, int64_t N,
          const float *bias, float *y);

/* int4 nibbles w [N, K/2] and bf16 (scale, zero) pairs sz [N, K/G, 2] (uint16 bits) -> w4a8's packed and
 * params (w4a8_products.cpp, the operator int4_pack_a8). */
void pack_int4_a8(const uint8_t *w, const uint16_t *sz, int64_t N, int64_t K, int64_t G, uint8_t *packed,
                  float *params);

/* y [M, N] = per_row's W7A8 product of x [M, K] (each row rounded to 8 bits with its own step
 * and minimum) with the packed 7-bit weights [ceil(N/32), ceil(K/4), 32, 4], qsum [N], scales [N],
 * wsum [N], + bias (may be NULL), then GPT-2's GELU if gelu (int8_per_row). */
void per_row(const float *x, int64_t M, int64_t K, const int8_t *packed, int64_t N, const int32_t *qsum,
             const float *scales, const float *wsum, const float *bias, bool gelu, float *y);

/* y [M, N] = x [M, K] @ w [K, N] + bias [N] (bias may be NULL), then GPT-2's GELU if gelu: float32, each
 * output summed in one fixed order (float_products.cpp, the operator conv1d_f32). */
void conv1d_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, bool gelu,
                float *y);

/* y [M, N] = x [M, K] @ w [N, K]^T + bias [N] (bias may be NULL): float32, each output summed in one fixed
 * order (head_products.cpp, the operator linear_f32). */
void linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y);

/* y [M, N] = fp16(x [M, K] @ w [K, N] + bias [N]) (bias may be NULL), then fp16(GELU(y)) if gelu: w fp16
 * bits, x float32 holding fp16 values, y float32 holding fp16 values; conv1d_f32's sums over the weights'
 * exact float32 values (float_products.cpp, the operator conv1d_f16). */
void conv1d_f16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, bool gelu,
                float *y);

/* y [M, N] = x [M, K] @ w [N, K]^T + bias [N] (bias may be NULL), float32: w fp16 bits, x float32 holding
 * fp16 values; linear_f32's sums (head_products.cpp, the operator linear_f16: a fp16 model's head). */
void linear_f16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, float *y);

/* y[0 .. n) = GPT-2's GELU of y (simd.h's): on 16 lanes where dispatch.h's GELU is on, else 8, the rest one
 * at a time, the same bits every way (float_products.cpp) */
void gelu_all(float *y, int64_t n);

/* p[0 .. n) rounded to the nearest fp16 (ties to even; inf past 65504), kept as float32 (float_products.cpp) */
void round_fp16(float *p, int64_t n);

/* y [M, N] = bf16(x [M, K] @ w [K, N] + bias [N]) (bias may be NULL), then bf16(GELU(y)) if gelu: w bf16
 * bits, x float32 holding bf16 values (rounded to bf16 first), y float32 holding bf16 values; float32
 * sums in vdpbf16ps's order (bf16_products.cpp, the operator conv1d_bf16). */
void conv1d_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, bool gelu,
                 float *y);

/* y [M, N] = x [M, K] @ w [N, K]^T + bias [N] (bias may be NULL), float32: w bf16 bits, x rounded to bf16
 * (bf16_products.cpp, the operator linear_bf16: a bf16 model's head). */
void linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias, float *y);

/* p[0 .. n) rounded to the nearest bf16 (ties to even), kept as float32 (bf16_products.cpp) */
void round_bf16(float *p, int64_t n);

/* Causal attention of q [B, h, T, D] over k, v [B, h, S, D] (S >= T, OpenAI's bottom-right
 * mask), last dimensions contiguous; returns o [B, T, h, D] permuted to [B, h, T, D]
 * (causal_attention.cpp, the operator causal_attention). */
at::Tensor causal_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v);

/* causal_attention for a bf16 model (q, k, v float32 holding bf16 values, rounded to bf16 first): scores
 * and p v by AVX-512 BF16's vdpbf16ps, each row's exps rounded to bf16 before p v (causal_attention.cpp,
 * the operator causal_attention_bf16); only where dispatch.h's ATTENTION_BF16 is on */
at::Tensor causal_attention_bf16(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v);

/* s [0 .. n) -> exp(scale * (s - max)) in place; returns their sum, or NaN when a score is NaN or
 * the largest is not finite (causal_attention.cpp). */
float softmax_row(float *s, int64_t n, float scale);

/* rows of row_bytes each per chunk of about 128 KiB for N rows, the chunks a multiple of the threads
 * (products.cpp's note on threads) */
int64_t chunk_rows(int64_t row_bytes, int64_t N);

/* whether a product of M x K x N multiply-adds is worth an OpenMP region (products.cpp's note on threads) */
bool parallel_worth(int64_t M, int64_t K, int64_t N);

/* an operator's check of its optional float32 bias [N] (a clear message naming op, never a read out of
 * bounds): its data, or NULL for None (products.cpp) */
const float *bias_of(const char *op, const std::optional<at::Tensor> &bias, int64_t N);
