// dropout_transposed.cuh: sm90_bwd's dropout on Pᵀ's packed 16-bit words (kDropPacked), instead of
// per fp32 element (philox.cuh Dropout::keep_bits_transposed and the kernel's per-element sign and
// select). The same canonical keep mask, read the same way (visit_transposed's walk: lane g draws the
// call of query parity g % 2 and trades halves with lane g ^ 1); a separate file, included by
// sm90_bwd.cu only, so that the families that include philox.cuh or dropout_packed.cuh keep their
// code hash.
//
// Why: keep_bits_transposed packs one keep bit per element (about 25 shifts, masks and ORs per
// Philox call), and the kernel then tests a bit and selects per element twice (the sign of Pᵀ for
// dSᵀ, and max(P, 0) / (1 - p) for dV). Here the keep flags stay as KeepSwar's byte signs (3
// instructions per 4 bytes), two flags a byte, one register for the thread's 16-key tile; after the
// packing one sign-replicating permute per word makes the 16-bit keep masks of its two elements, one
// AND gives dV's operand Pᵀ ∘ Z (its 1 / (1 - p) goes to dV's epilogue: one multiply per dV element
// of the tile instead of one per Pᵀ element), one LOP3 the signed Pᵀ that dSᵀ reads.
//
// Layout (visit_transposed's): per 16-query block qb the thread holds 8 elements of Pᵀ, keys
// g + 8·hk, queries 16·qb + 8·hr + 2t + e, whose keep byte is byte j = 2·hk + hr of the word of query
// parity e. keep_flags_transposed puts that byte's sign at bit 8j + 7 - 2·qb (e = 0) and 8j + 6 - 2·qb
// (e = 1) of one register: four blocks (64 queries) fill it. The packed word of (nt = 2·qb + hr,
// hk) holds e = 0 in its low and e = 1 in its high 16 bits (gemm.cuh pack_a_frags).
#pragma once
#include "dropout_packed.cuh"
#include "ptx_sm90_bwd.cuh"

namespace cuflash {

// The keep flags of a thread's elements of one 16-key tile of Pᵀ (kNT / 2 blocks of 16 queries from
// query0; key0 + g its first key), as above. One Philox call per block and thread (visit_transposed's
// count); the blocks run one at a time (not unrolled), so one call's state is live, not kNT / 2.
// kOpaqueKeys: the Philox key passed through opaque_u32 per call. In the SASS ptxas still holds the
// rounds' keys in registers (the loop's instructions are the same 48), but it allocates the d128
// kernel of sm90_bwd's kDropPacked 2 (dS by stmatrix) without the 8-byte spill it has without
// (nvcc 13.0, sm_90a; a ptxas choice, checked by tests/test_sm90_bwd_drop_packed_cpu.py).
// kRounds: the mask's (kPhiloxRounds); 0 only in sm90_bwd's timing form (kDropPacked 3: not the mask).
template <int kNT, bool kOpaqueKeys = false, int kRounds = kPhiloxRounds>
__device__ __forceinline__ u32 keep_flags_transposed(const Dropout& dropout, const KeepSwar& swar, int bh,
                                                     int key0, int query0, int g, int t) {
    static_assert(kNT % 2 == 0 && kNT <= 8, "at most four 16-query blocks: two flags per block in a byte");
    const int gp = g & 1, key = key0 + g;
    u32 flags = 0;
#pragma unroll 1
    for (int qb = 0; qb < kNT / 2; ++qb) {
        Dropout d = dropout;
        if constexpr (kOpaqueKeys) {
            d.k0 = opaque_u32(d.k0);
            d.k1 = opaque_u32(d.k1);
        }
        const PhiloxWords w = d.template draw<kRounds>(bh, query0 + 16 * qb + 2 * t + gp, key);
        const u32 w0 = key & 16 ? w.w[2] : w.w[0], w1 = key & 16 ? w.w[3] : w.w[1];
        // own: the bytes of this thread's key parity (gp) of its call (query parity e = gp); the other
        // parity goes to lane g ^ 1, which sends this thread its call's (e = 1 - gp)
        const u32 own = __byte_perm(w0, w1, gp ? 0x7531u : 0x6420u);
        const u32 other = __shfl_xor_sync(0xffffffffu, __byte_perm(w0, w1, gp ? 0x6420u : 0x7531u), 4);
        const u32 s0 = swar.signs(gp ? other : own), s1 = swar.signs(gp ? own : other);   // e = 0, 1
        flags |= ((s0 & 0x80808080u) | ((s1 >> 1) & 0x40404040u)) >> (2 * qb);
    }
    return flags;
}

// Dropout on the packed word `word` of Pᵀ (tile nt = 2·qb + hr, keys g + 8·hk; flags from
// keep_flags_transposed): returns Pᵀ ∘ Z (dropped elements +0) and sets `signed_p` to Pᵀ with the
// dropped elements negated (the sign carries Z for dSᵀ; Pᵀ >= 0).
// (qb, j: constants once the caller's loops are unrolled)
__device__ __forceinline__ u32 drop_packed_word(u32 word, u32 flags, int qb, int j, u32& signed_p) {
    // block qb's flags of byte j at the top of x's byte j (e = 0) and of y's (e = 1), each replicated
    // over a 16-bit half: bytes 0, 1 from x's, bytes 2, 3 from y's
    const u32 x = flags << (2 * qb), y = flags << (2 * qb + 1);
    const u32 keep = prmt_sign(x, y, u32(0xC + j) << 12 | u32(0xC + j) << 8 | u32(0x8 + j) << 4 | u32(0x8 + j));
    signed_p = word ^ (~keep & 0x80008000u);
    return word & keep;
}

}  // namespace cuflash
