/* The operators that say which paths the kernels take (dispatch.h), for gpt2mha.kernels.dispatch:
 *   cpu_features()                 the CPU's features ("avx512", "avx512_vnni", "avx512_bf16");
 *   allowed_cpu_features()         those the kernels may take (all by default);
 *   allow_cpu_features(features)   the kernels may take only these from now on (process-wide); returns
 *                                  the features they take now (the CPU's, as far as allowed);
 *   kernel_paths(features)         "switch=path" for every switch on a CPU with exactly these features
 *                                  (None: the features the kernels take now): the switches' own
 *                                  answer, a pure function of its argument. */
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "dispatch.h"

namespace {

std::vector<std::string> names(uint32_t features) {
    std::vector<std::string> out;
    for (int i = 0; i < dispatch::N_FEATURES; i++)
        if (features & (1u << i)) out.emplace_back(dispatch::FEATURE_NAMES[i]);
    return out;
}

uint32_t bits(const char *op, const std::vector<std::string> &features) {
    uint32_t out = 0;
    for (const std::string &name : features) {
        int i = 0;
        while (i < dispatch::N_FEATURES && name != dispatch::FEATURE_NAMES[i]) i++;
        TORCH_CHECK(i < dispatch::N_FEATURES, op, ": '", name, "' is not a feature the kernels ask for (",
                    dispatch::FEATURE_NAMES[0], ", ", dispatch::FEATURE_NAMES[1], ", ", dispatch::FEATURE_NAMES[2],
                    "; AVX2, FMA and F16C are always taken)");
        out |= 1u << i;
    }
    return out;
}

std::vector<std::string> cpu_features() { return names(dispatch::cpu()); }

std::vector<std::string> allowed_cpu_features() { return names(dispatch::allowed()); }

std::vector<std::string> allow_cpu_features(const std::vector<std::string> &features) {
    dispatch::allowed_features.store(bits("allow_cpu_features", features), std::memory_order_relaxed);
    return names(dispatch::enabled());
}

std::vector<std::string> kernel_paths(const std::optional<std::vector<std::string>> &features) {
    const uint32_t f = features ? bits("kernel_paths", *features) : dispatch::enabled();
    std::vector<std::string> out;
    for (const dispatch::Switch *s : dispatch::SWITCHES)
        out.push_back(std::string(s->name) + "=" + (dispatch::on(*s, f) ? s->path : s->otherwise));
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpt2mha, m) {
    m.def("cpu_features() -> str[]");
    m.def("allowed_cpu_features() -> str[]");
    m.def("allow_cpu_features(str[] features) -> str[]");
    m.def("kernel_paths(str[]? features=None) -> str[]");
}

TORCH_LIBRARY_IMPL(gpt2mha, CompositeExplicitAutograd, m) {
    m.impl("cpu_features", &cpu_features);
    m.impl("allowed_cpu_features", &allowed_cpu_features);
    m.impl("allow_cpu_features", &allow_cpu_features);
    m.impl("kernel_paths", &kernel_paths);
}
