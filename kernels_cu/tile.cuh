// tile.cuh: small pieces shared by the kernel families: infinities, a 16-byte vector, and
// the global -> shared tile copy (cp.async) that every kernel uses for Q, K, V, dO.
#pragma once
#include "ptx.cuh"

namespace cuflash {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }

struct alignas(16) u32x4 { u32 x, y, z, w; };

// Copy a (kRows x kHeadDim) tile from global memory (row pitch `row_stride` elements) into
// shared memory (row pitch kPitch) with 16-byte cp.async. Rows >= rows_valid and columns
// >= head_dim are zero-filled, so padding never injects garbage into the mma; a tile with
// neither (every tile but the last of a ragged sequence) takes the plain copy.
// Thread layout: kLanesPerRow consecutive threads cover one row (one 16-byte chunk each),
// so a thread keeps one column and walks rows in steps of kRowsPerPass: its addresses are
// one base plus compile-time offsets, which keeps address registers out of the main loop.
template <int kRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void load_tile_g2s(u16* tile_smem, const u16* tile_gmem, i64 row_stride,
                                              int rows_valid, int head_dim, int tid) {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    constexpr int kRowsPerPass = kThreads / kLanesPerRow;
    static_assert(kThreads % kLanesPerRow == 0, "a CTA must cover whole rows per pass");
    const int row = tid / kLanesPerRow, col = (tid % kLanesPerRow) * 8;
    if (col >= kHeadDim) return;  // lanes past the last chunk of a non-power-of-2 head dim
    const bool col_valid = col < head_dim;
    const u16* src = tile_gmem + row * row_stride + col;
    const u32 dst = smem_u32(tile_smem + row * kPitch + col);
    if (rows_valid >= kRows && head_dim >= kHeadDim) {  // the common case: nothing to zero-fill
#pragma unroll
        for (int pass = 0; pass * kRowsPerPass < kRows; ++pass)
            if (kRows % kRowsPerPass == 0 || row + pass * kRowsPerPass < kRows)
                cp_async_16(dst + pass * kRowsPerPass * kPitch * 2, src + pass * kRowsPerPass * row_stride);
        return;
    }
#pragma unroll
    for (int pass = 0; pass * kRowsPerPass < kRows; ++pass) {
        const int r = row + pass * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || r < kRows) {
            const bool valid = col_valid && r < rows_valid;
            cp_async_16(dst + pass * kRowsPerPass * kPitch * 2,
                        valid ? src + pass * kRowsPerPass * row_stride : tile_gmem, valid);
        }
    }
}

}  // namespace cuflash
