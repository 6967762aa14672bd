/* The products of gemv.cpp that step.cpp calls (one library: gemv.py builds every .cpp here). */
#pragma once

#include <cstdint>

/* y [M, N] = x [M, K] @ (w [N, K] int8 * scales [N])^T + bias [N] (bias may be NULL): float32
 * activations, each weight converted to float32 (int8_gemv). */
void gemv(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, const float *scales, const float *bias,
          float *y);

/* y [M, N] = W4A8 product of x [M, K] with int4 nibbles w [N, K/2] and bfloat16 (scale, zero)
 * pairs sz [N, K/G, 2] (as uint16 bits), x's rows rounded to 8 bits per group of G, + bias
 * (may be NULL) (int4_gemv_a8). */
void w4a8(const float *x, int64_t M, int64_t K, int64_t G, const uint8_t *w, const uint16_t *sz, int64_t N,
          const float *bias, float *y);
