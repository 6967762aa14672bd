/* How the threads walk a product's weights w [K, N] (GPT-2's Conv1D layout) for decode-sized inputs:
 * float_products.cpp's conv1d_f32 and conv1d_f16, bf16_products.cpp's conv1d_bf16.
 *
 * Each thread takes one contiguous span of the output columns (spans) and walks it KB_ROWS weight rows
 * at a time, in tiles of `width` columns (walk). A tile is given, besides its place, the offset of the
 * weights of the tile PREFETCH_TILES further along its thread's walk (past the end of a block: the next
 * block's first tiles), and prefetches those into L2 row by row as it goes: the memory's latency then
 * overlaps the tile's arithmetic (over cold weights, tiles without it read at about half the speed, and
 * prefetching into L1 gains nothing); long blocks keep each
 * tile's entry and exit (its partial sums loaded from y and stored back) rare. The walk changes no sum:
 * every output is one chain over k in order whatever the walk, so its bits do not depend on it. */
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

/* weight rows per block of the walk, and how many tiles ahead a tile prefetches */
inline constexpr int64_t KB_ROWS = 256, PREFETCH_TILES = 2;

/* the N columns of an M x K x N product over the threads (one, if not parallel_worth): each thread one
 * contiguous span [c0, c1), a multiple of `lanes` long but the last, for row(c0, c1) */
template <typename F>
static void spans(int64_t M, int64_t K, int64_t N, int64_t lanes, F &&row) {
    const int64_t T = parallel_worth(M, K, N) ? std::max(1, omp_get_max_threads()) : 1;
    const int64_t span = lanes * ((N + lanes * T - 1) / (lanes * T));
    #pragma omp parallel for schedule(static, 1) num_threads(T)
    for (int64_t t = 0; t < T; t++)
        if (t * span < N) row(t * span, std::min(N, (t + 1) * span));
}

/* every thread's span, KB_ROWS weight rows at a time, in tiles of `width` columns: tile(k0, k1, j, pfo)
 * for w's rows [k0, k1) at columns j .. j + width (fewer at N), pfo the offset in elements from w[k, j]
 * of the weights PREFETCH_TILES tiles on; then done(c0, c1) once a span is whole */
template <typename F, typename G>
static void walk(int64_t M, int64_t K, int64_t N, int64_t width, F &&tile, G &&done) {
    spans(M, K, N, width, [&](int64_t c0, int64_t c1) {
        const int64_t nt = (c1 - c0 + width - 1) / width;
        for (int64_t k0 = 0; k0 < K; k0 += KB_ROWS)
            for (int64_t i = 0; i < nt; i++) {
                const int64_t t = i + PREFETCH_TILES;
                tile(k0, std::min(K, k0 + KB_ROWS), c0 + width * i, t / nt * KB_ROWS * N + width * (t % nt - i));
            }
        done(c0, c1);
    });
}
