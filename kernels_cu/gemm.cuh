// gemm.cuh: warp-level tile products on mma.sync m16n8k16, fed by ldmatrix from shared memory.
//
// A warp owns kMT 16-row tiles of the output; the accumulator layout is the mma C layout
// (ptx.cuh): acc[mt][nt][e] is row 16·mt + g + 8·(e / 2), column 8·nt + 2t + e % 2.
// Addresses are per-lane byte addresses in shared memory prepared by the caller (see the
// lane formulas in fa2_fwd.cu / fa2_bwd.cu); these loops only add compile-time offsets.
// Both kernels' products go through these: S = Q Kᵀ and O += P V in the forward; Sᵀ, dPᵀ,
// dV and dK in the backward.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// acc = 0 (kMT x kNT accumulator tiles).
template <int kMT, int kNT>
__device__ __forceinline__ void zero_acc(float (&acc)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// One k16 step kk of acc += A Bᵀ: A's fragments of the step in registers (a[mt][ka]), B's kNT·8 rows from
// row-major shared memory, 16 at a time (one ldmatrix.x4), the step's 32 bytes of each row.
template <int kMT, int kNT, int kKA, int kRowBytes, class Elem>
__device__ __forceinline__ void mma_step_x_rows(float (&acc)[kMT][kNT][4], const u32 (&a)[kMT][kKA][4], int ka,
                                                u32 b_lane, int kk) {
    static_assert(kNT % 2 == 0, "B rows come 16 at a time (one ldmatrix.x4)");
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
        u32 b[4];  // [0..1]: B rows 16np..16np+7, [2..3]: rows 16np+8..16np+15
        ldmatrix_x4(b, b_lane + np * 16 * kRowBytes + kk * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<Elem>(acc[mt][2 * np], a[mt][ka], b[0], b[1]);
            mma_16816<Elem>(acc[mt][2 * np + 1], a[mt][ka], b[2], b[3]);
        }
    }
}

// acc = A Bᵀ where A (kMT·16 rows) and B (kNT·8 rows) are both stored row-major with the
// reduction dimension (kKSteps·16 wide) along the row: e.g. S = Q Kᵀ, or Sᵀ = K Qᵀ.
template <int kMT, int kNT, int kKSteps, int kRowBytes, class Elem>
__device__ __forceinline__ void gemm_rows_x_rows(float (&acc)[kMT][kNT][4], u32 a_lane, u32 b_lane) {
    zero_acc(acc);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        u32 a[kMT][1][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt][0], a_lane + mt * 16 * kRowBytes + kk * 32);
        mma_step_x_rows<kMT, kNT, 1, kRowBytes, Elem>(acc, a, 0, b_lane, kk);
    }
}

// A's fragments for gemm_frags_x_rows, read once (ldmatrix) from row-major A in shared memory:
// a warp that multiplies the same A by many B tiles (decode's Q) keeps them in registers.
template <int kMT, int kKSteps, int kRowBytes>
__device__ __forceinline__ void load_a_frags(u32 (&a)[kMT][kKSteps][4], u32 a_lane) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) ldmatrix_x4(a[mt][kk], a_lane + mt * 16 * kRowBytes + kk * 32);
}

// gemm_rows_x_rows with A's fragments in registers (load_a_frags): acc = A Bᵀ, B rows from
// shared memory.
template <int kMT, int kNT, int kKSteps, int kRowBytes, class Elem>
__device__ __forceinline__ void gemm_frags_x_rows(float (&acc)[kMT][kNT][4], const u32 (&a)[kMT][kKSteps][4],
                                                  u32 b_lane) {
    zero_acc(acc);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) mma_step_x_rows<kMT, kNT, kKSteps, kRowBytes, Elem>(acc, a, kk, b_lane, kk);
}

// The C layout of two adjacent n8 accumulator tiles equals the A layout of one k16 step:
// rounding to 16 bits and packing turns an fp32 result (P, dS) into the A operand of the
// next product without a trip through shared memory.
template <int kMT, int kK16, class Elem>
__device__ __forceinline__ void pack_a_frags(u32 (&frag)[kMT][kK16][4], const float (&acc)[kMT][2 * kK16][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kK16; ++kk) {
            frag[mt][kk][0] = pack2<Elem>(acc[mt][2 * kk][0], acc[mt][2 * kk][1]);
            frag[mt][kk][1] = pack2<Elem>(acc[mt][2 * kk][2], acc[mt][2 * kk][3]);
            frag[mt][kk][2] = pack2<Elem>(acc[mt][2 * kk + 1][0], acc[mt][2 * kk + 1][1]);
            frag[mt][kk][3] = pack2<Elem>(acc[mt][2 * kk + 1][2], acc[mt][2 * kk + 1][3]);
        }
}

// One k16 step kk of acc += A B: A's fragments of the step in registers (a[mt][ka]), B with the
// reduction dimension down its rows (kBRowBytes apart; the step's 16 rows), kNT·8 columns read 16
// at a time with ldmatrix.x4.trans.
template <int kMT, int kNT, int kKA, int kBRowBytes, class Elem>
__device__ __forceinline__ void mma_step_x_rows_t(float (&acc)[kMT][kNT][4], const u32 (&a)[kMT][kKA][4], int ka,
                                                  u32 bt_lane, int kk) {
    static_assert(kNT % 2 == 0, "B columns come 16 at a time (one ldmatrix.x4.trans)");
#pragma unroll
    for (int dp = 0; dp < kNT / 2; ++dp) {
        u32 b[4];  // [0..1]: columns 16dp..16dp+7, [2..3]: columns 16dp+8..16dp+15
        ldmatrix_x4_trans(b, bt_lane + kk * 16 * kBRowBytes + dp * 32);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<Elem>(acc[mt][2 * dp], a[mt][ka], b[0], b[1]);
            mma_16816<Elem>(acc[mt][2 * dp + 1], a[mt][ka], b[2], b[3]);
        }
    }
}

// acc += A B where A is in registers (packed fragments, kK16 steps of 16) and B is stored
// row-major with the reduction dimension down its rows (kK16·16 rows, kNT·8 columns), read
// with ldmatrix.trans: e.g. O += P V, dV += Pᵀ dO, dK += dSᵀ Q.
template <int kMT, int kNT, int kK16, int kRowBytes, class Elem>
__device__ __forceinline__ void gemm_frags_x_rows_t(float (&acc)[kMT][kNT][4], const u32 (&frag)[kMT][kK16][4],
                                                    u32 bt_lane) {
#pragma unroll
    for (int kk = 0; kk < kK16; ++kk) mma_step_x_rows_t<kMT, kNT, kK16, kRowBytes, Elem>(acc, frag, kk, bt_lane, kk);
}

// acc += A B where A (kMT·16 rows, k along the row, kARowBytes apart) and B (k down its rows,
// kBRowBytes apart, read with ldmatrix.trans) are both in shared memory: e.g. dV += Pᵀ dO with
// Pᵀ stored keys x queries.
template <int kMT, int kNT, int kK16, int kARowBytes, int kBRowBytes, class Elem>
__device__ __forceinline__ void gemm_rows_x_rows_t(float (&acc)[kMT][kNT][4], u32 a_lane, u32 bt_lane) {
#pragma unroll
    for (int kk = 0; kk < kK16; ++kk) {
        u32 a[kMT][1][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt][0], a_lane + mt * 16 * kARowBytes + kk * 32);
        mma_step_x_rows_t<kMT, kNT, 1, kBRowBytes, Elem>(acc, a, 0, bt_lane, kk);
    }
}

}  // namespace cuflash
