// softmax_tree.cuh: softmax.cuh's softmax_step with shorter dependency chains, for sm90_fwd's
// kTreeMax (cuflash/families/sm90_fwd.py: tree_max). The same results bit for bit: the max is exact
// in any order, and each row sum adds its terms in softmax_step's order.
//
// Why: at head dim 64 a K/V block is little GEMM work per score, so the softmax of one block has to
// fit under the other warpgroups' GEMMs, and the SFU (one ex2 per score) is as busy as the tensor
// cores. softmax_step's row max is a chain of BN / 4 dependent FMNMX per row (ptxas keeps the
// source's order), half 0 first: the first ex2 waits for that chain and two shuffles. Here both
// rows' maxima run as four interleaved chains each (depth BN / 32 + 2), computed together, and their
// shuffles interleave, so the ex2s start sooner.
#pragma once
#include "ptx.cuh"
#include "softmax.cuh"

namespace cuflash {

// softmax_step for one 16-row tile (kMT = 1, the sm90 kernels' accumulators): same arguments, same
// m, P, alpha and l.
template <int kNTS>
__device__ __forceinline__ void softmax_step_tree(float (&s)[1][kNTS][4], float (&m)[1][2], float (&l)[1][2],
                                                  float scale_log2, float (&alpha)[1][2]) {
    static_assert(kNTS >= 4, "softmax_step_tree: BN >= 32 (four chains of 8-column tiles)");
    // four chains per row, 8-column tile nt on chain nt % 4, both rows side by side: depth
    // kNTS / 4 + 2 instead of kNTS, with 8 registers of partial maxima (a full pairwise tree held
    // BN / 8 per row, which ptxas spilled at d64 BN 192 with 3 consumer warpgroups)
    float part[2][4];
#pragma unroll
    for (int nt = 0; nt < kNTS; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float x = fmaxf(s[0][nt][2 * half], s[0][nt][2 * half + 1]);
            part[half][nt % 4] = nt < 4 ? x : fmaxf(part[half][nt % 4], x);
        }
    float m_new[2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
        m_new[half] = fmaxf(fmaxf(m[0][half], fmaxf(part[half][0], part[half][1])),
                            fmaxf(part[half][2], part[half][3]));
    // the quad's four threads hold a row between them: both rows' shuffles side by side
#pragma unroll
    for (int lane_mask = 1; lane_mask <= 2; lane_mask *= 2) {
        const float o0 = __shfl_xor_sync(0xffffffffu, m_new[0], lane_mask);
        const float o1 = __shfl_xor_sync(0xffffffffu, m_new[1], lane_mask);
        m_new[0] = fmaxf(m_new[0], o0);
        m_new[1] = fmaxf(m_new[1], o1);
    }
    float m_scaled[2], sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        // a row masked so far: offset 0, so that -inf - (-inf) never happens (softmax_step)
        m_scaled[half] = m_new[half] == neg_inf() ? 0.f : m_new[half] * scale_log2;
        alpha[0][half] = exp2_approx(m[0][half] * scale_log2 - m_scaled[half]);
        m[0][half] = m_new[half];
        sum[half] = 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < kNTS; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[0][nt][2 * half + e];
                x = exp2_scaled(x, scale_log2, m_scaled[half]);
                sum[half] += x;
            }
#pragma unroll
    for (int half = 0; half < 2; ++half)
        l[0][half] = l[0][half] * alpha[0][half] + sum[half];
}

}  // namespace cuflash
