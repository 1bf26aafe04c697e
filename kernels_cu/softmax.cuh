// softmax.cuh: FlashAttention's online softmax (running row max m, row sum l, rescale alpha)
// and its finish (O / l, LSE), on S tiles in the mma.sync accumulator layout (per warp also
// wgmma's, so sm90_fwd shares it); and the scaled exp2 that the backward shares to recompute P
// from LSE.
//
// Every exp goes through exp2: exp(scale·s - x) = exp2(s·scale·log2(e) - x·log2(e)), one FFMA
// and one MUFU.EX2, with scale·log2(e) computed once on the host (params.scale_log2).
#pragma once
#include "ptx.cuh"
#include "tile.cuh"

namespace cuflash {

// exp(scale·s - x) from scale_log2 = scale·log2(e) and offset_log2 = x·log2(e).
__device__ __forceinline__ float exp2_scaled(float s, float scale_log2, float offset_log2) {
    return exp2_approx(fmaf(s, scale_log2, -offset_log2));
}

// The four threads of a quad (same g = lane / 4) hold one accumulator row between them.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax of the rows that one thread holds: kMT mma tiles of 16 rows, rows g and
// g + 8 of each; index [mt][half] is row 16·mt + g + 8·half of the warp's rows.
//   m[kMT][2]  running row max of the raw scores S (not yet scaled); -inf: all masked so far
//   l[kMT][2]  running row sum of P, this thread's columns only (quad_sum at the end)
// m and l are the kernel's own arrays, not members of a state struct: with a struct, ptxas
// assigned the forward's registers differently (compared in SASS, kernels_cu/README.md).
template <int kMT>
__device__ __forceinline__ void softmax_init(float (&m)[kMT][2], float (&l)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        m[mt][0] = m[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = 0.f;
    }
}

// One K/V block without touching O: m_new = max(m, rowmax S); S becomes P = exp(scale·(S -
// m_new)) in place (fp32); l is rescaled by alpha = exp(scale·(m - m_new)) and gains rowsum P.
// alpha goes out for softmax_rescale to apply to O: at once in softmax_update (fa2_fwd);
// later in sm90_fwd, whose O is still being written by the previous block's asynchronous P V.
//   s:     (kMT·16 x kNTS·8) raw scores of this warp, P on return
//   alpha: [mt][half] the rescale of row 16·mt + g + 8·half
template <int kMT, int kNTS>
__device__ __forceinline__ void softmax_step(float (&s)[kMT][kNTS][4], float (&m)[kMT][2],
                                             float (&l)[kMT][2], float scale_log2, float (&alpha)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m_new = m[mt][half];
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
                m_new = fmaxf(m_new, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            m_new = quad_max(m_new);
            // A row masked so far has m_new = -inf: use 0 as the exponent's offset so that
            // -inf - (-inf) = NaN never happens; its P and alpha are then exp2(-inf) = 0.
            const float m_scaled = m_new == neg_inf() ? 0.f : m_new * scale_log2;
            alpha[mt][half] = exp2_approx(m[mt][half] * scale_log2 - m_scaled);
            m[mt][half] = m_new;
            float row_sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[mt][nt][2 * half + e];
                    x = exp2_scaled(x, scale_log2, m_scaled);
                    row_sum += x;
                }
            l[mt][half] = l[mt][half] * alpha[mt][half] + row_sum;
        }
}

// O *= alpha, row by row: brings O = Σ P V of the earlier blocks to the new running max.
//   o: (kMT·16 x kNTO·8) output accumulator of this warp
template <int kMT, int kNTO>
__device__ __forceinline__ void softmax_rescale(float (&o)[kMT][kNTO][4], const float (&alpha)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTO; ++nt) {
            o[mt][nt][0] *= alpha[mt][0];
            o[mt][nt][1] *= alpha[mt][0];
            o[mt][nt][2] *= alpha[mt][1];
            o[mt][nt][3] *= alpha[mt][1];
        }
}

// One K/V block, O rescaled at once: softmax_step then softmax_rescale.
template <int kMT, int kNTS, int kNTO>
__device__ __forceinline__ void softmax_update(float (&s)[kMT][kNTS][4], float (&o)[kMT][kNTO][4],
                                               float (&m)[kMT][2], float (&l)[kMT][2], float scale_log2) {
    float alpha[kMT][2];
    softmax_step(s, m, l, scale_log2, alpha);
    softmax_rescale(o, alpha);
}

// Finish, per row, after the last K/V block, with l_row = quad_sum(l) the row's whole sum:
// 1 / l for the delayed normalization O / l; 0 for a row that saw no key (l = 0, O = 0).
__device__ __forceinline__ float softmax_inv_l(float l_row) { return l_row > 0.f ? 1.f / l_row : 0.f; }
// LSE = m·scale + log l (natural log); +inf for a row that saw no key, flash-attn's convention
// (the backward then recomputes P = exp2(S·scale·log2e - inf) = 0). A row whose scores hold a
// NaN has l = NaN and gets LSE = NaN (the test is l == 0, which NaN fails), as SDPA does.
__device__ __forceinline__ float softmax_lse(float m_row, float l_row, float softmax_scale) {
    return l_row == 0.f ? pos_inf() : m_row * softmax_scale + logf(l_row);
}

}  // namespace cuflash
