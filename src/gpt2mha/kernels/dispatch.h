/* How the kernels choose their paths at run time: one predicate per CPU feature they ask for (computed
 * once), one target attribute per AVX-512 path, and one switch per path asking exactly the features its
 * code uses. The only place a source asks the CPU or names a target (tests/test_kernel_dispatch.py holds
 * it).
 *
 * Every path assumes AVX2, FMA and F16C (build.py's -mavx2 -mfma -mf16c: gpt2mha does not load the
 * library on a CPU without them); an AVX-512 path is compiled for its own target whatever the build flags
 * and taken where the CPU has its features. Each gives the same bits as the AVX2 path it replaces.
 *
 * The features the kernels take are the CPU's, as far as allowed(): the operator allow_cpu_features
 * (gpt2mha.kernels.dispatch.allow; GPT2MHA_CPU_FEATURES at load) narrows them, so that tests run the
 * AVX2 paths, or AVX-512 without VNNI, on a CPU that has more; kernel_paths names what each switch takes
 * for a given set of features (dispatch.cpp). */
#pragma once

#include <atomic>
#include <cstdint>

namespace dispatch {

/* ---- the features, beyond the AVX2 + FMA + F16C every path has ---- */

enum Feature : uint32_t {
    AVX512 = 1u << 0,      /* AVX-512 F, BW, DQ and VL: 16 float32 lanes, masks, 8- to 64-bit integer lanes */
    AVX512_VNNI = 1u << 1, /* vpdpbusd: four u8 x s8 products added into each int32 lane */
    AVX512_BF16 = 1u << 2, /* vdpbf16ps: two bf16 products added into each float32 lane */
};
inline constexpr uint32_t ALL = AVX512 | AVX512_VNNI | AVX512_BF16;
/* their names (bit i's at i): the operators' and gpt2mha.kernels.dispatch's */
inline constexpr const char *FEATURE_NAMES[] = {"avx512", "avx512_vnni", "avx512_bf16"};
inline constexpr int N_FEATURES = 3;

/* the targets the AVX-512 paths are compiled for: each path's features (fma: the 16-lane FMAs) */
#define AVX512_ISA "avx512f,avx512bw,avx512dq,avx512vl,fma"
#define TARGET_AVX512 __attribute__((target(AVX512_ISA)))
#define TARGET_AVX512_VNNI __attribute__((target(AVX512_ISA ",avx512vnni")))
#define TARGET_AVX512_BF16 __attribute__((target(AVX512_ISA ",avx512bf16")))

/* the CPU's features (libgcc's cpuid, which also checks that the OS saves the AVX-512 registers), asked
 * once */
inline uint32_t cpu() {
    static const uint32_t has = [] {
        __builtin_cpu_init();
        const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
        return (avx512 ? AVX512 : 0u) | (__builtin_cpu_supports("avx512vnni") ? AVX512_VNNI : 0u) |
               (__builtin_cpu_supports("avx512bf16") ? AVX512_BF16 : 0u);
    }();
    return has;
}

/* the features the kernels may take (all by default); process-wide */
inline std::atomic<uint32_t> allowed_features{ALL};

inline uint32_t allowed() { return allowed_features.load(std::memory_order_relaxed); }

/* the features the kernels take now: the CPU's, as far as allowed */
inline uint32_t enabled() { return cpu() & allowed(); }

/* ---- the switches ---- */

/* One per path: the path named `path` where the features `needs` are all there, else `otherwise`. */
struct Switch {
    const char *name;
    uint32_t needs;
    const char *path, *otherwise;
};

/* float_products.cpp's conv1d_f32 and conv1d_f16 on 16 lanes */
inline constexpr Switch CONV1D{"conv1d", AVX512, "avx512", "avx2"};
/* head_products.cpp's linear_f32 and linear_f16 on 16 lanes */
inline constexpr Switch LINEAR{"linear", AVX512, "avx512", "avx2"};
/* GPT-2's GELU applied apart from a product, on 16 lanes (float_products.cpp's gelu_all: conv1d_f16's;
 * bf16_products.cpp's gelu_round: conv1d_bf16's) */
inline constexpr Switch GELU{"gelu", AVX512, "avx512", "avx2"};
/* causal_attention.cpp's causal_attention on 16 lanes */
inline constexpr Switch ATTENTION{"causal_attention", AVX512, "avx512", "avx2"};
/* products.cpp's rounding of int8_per_row's rows to 8 bits, on 16 lanes */
inline constexpr Switch PER_ROW_ROUNDING{"per_row_rounding", AVX512, "avx512", "avx2"};
/* products.cpp's int8_per_row product: vpdpbusd on the packed 7-bit weights, the rescale on 16 lanes */
inline constexpr Switch PER_ROW{"per_row", AVX512 | AVX512_VNNI, "avx512_vnni", "avx2"};
/* w4a8_products.cpp's W4A8 product (int4_a8_packed, int4_gemv_a8, the one-call forward's int4 layers) */
inline constexpr Switch W4A8{"w4a8", AVX512 | AVX512_VNNI, "avx512_vnni", "avx2"};
/* bf16_products.cpp's conv1d_bf16 and linear_bf16 by vdpbf16ps; cached_forward.cpp routes a bf16
 * prompt by it (without it, oneDNN's GEMM from ONEDNN_ROWS rows) */
inline constexpr Switch BF16{"bf16", AVX512 | AVX512_BF16, "avx512_bf16", "avx2"};
/* causal_attention.cpp's causal_attention_bf16 (refused without its features; cached_forward.cpp then
 * takes causal_attention) */
inline constexpr Switch ATTENTION_BF16{"causal_attention_bf16", AVX512 | AVX512_BF16, "avx512_bf16", "refused"};

/* every switch (kernel_paths reports them in this order) */
inline constexpr const Switch *SWITCHES[] = {&CONV1D, &LINEAR, &GELU, &ATTENTION, &PER_ROW_ROUNDING,
                                             &PER_ROW, &W4A8, &BF16, &ATTENTION_BF16};

/* whether s takes its path on a CPU with `features` */
constexpr bool on(const Switch &s, uint32_t features) { return (features & s.needs) == s.needs; }
/* whether s takes its path now */
inline bool on(const Switch &s) { return on(s, enabled()); }

}  // namespace dispatch
