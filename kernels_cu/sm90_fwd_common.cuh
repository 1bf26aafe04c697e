// sm90_fwd_common.cuh: what the Hopper forward kernels share, sm90_fwd.cu (bf16 / fp16) and
// sm90_fwd_fp8.cu (e4m3): the tile numbering, the pingpong turns of the consumer warpgroups, the
// mbarriers of Q and of the K/V ring, the producer's loads of Q and of a ring slot, the consumers'
// loop over a tile's K/V blocks, and the epilogue that stores O and LSE from registers.
// sm90_fwd.cu's header explains the algorithm and the handshake; each kernel file keeps its own
// GEMMs, softmax, features, tile order and shared-memory layout.
#pragma once
#include "ptx.cuh"
#include "ptx_sm90.cuh"
#include "ptx_sm90_cluster.cuh"
#include "softmax.cuh"
#include "varlen.cuh"

namespace cuflash {

// Pingpong turns of consumer warpgroup wg (sm90_fwd.cu header: why arrivals equal waits). A turn
// is the code between begin() (wait on named barrier 1 + wg for the hand-over) and end() (hand
// over to the next warpgroup, round robin). start(): the last warpgroup gives warpgroup 0 the
// first turn; end(true) marks the final turn, whose hand-over the last warpgroup skips. Without
// kOn every member is a no-op.
template <bool kOn, int kConsumers>
struct Pingpong {
    int wg;
    __device__ __forceinline__ explicit Pingpong(int wg_) : wg(wg_) {}
    __device__ __forceinline__ void start() const {
        if (kOn && wg == kConsumers - 1) named_barrier_arrive(1, 256);
    }
    __device__ __forceinline__ void begin() const { if (kOn) named_barrier_sync(1 + wg, 256); }
    __device__ __forceinline__ void end(bool last = false) const {
        if (kOn && !(last && wg == kConsumers - 1)) named_barrier_arrive(1 + (wg + 1) % kConsumers, 256);
    }
};

// Tile `tile` of the grid's numbering (sm90_fwd.cu header): its Q block, head and batch.
struct Sm90Tile {
    int m_block, head, batch;
    __device__ __forceinline__ Sm90Tile(int tile, int m_blocks, int nheads) {
        m_block = m_blocks - 1 - tile % m_blocks;
        const int hb = tile / m_blocks;
        head = hb % nheads;
        batch = hb / nheads;
    }
};

// The mbarriers of Q and of the K/V ring (sm90_fwd.cu header: the producer / consumer handshake),
// 8 bytes each from `base`: Q full, Q empty, then K full, V full, K empty, V empty, kStages each.
// An iteration `it` is a K/V block in the CTA's order (counted across its tiles): it uses slot
// it % kStages, whose fill number it / kStages gives the phases.
//   full   one arrival (the producer's expect_tx with the tile's bytes) and the bytes themselves
//   empty  kConsumers · 128 arrivals, one per consumer thread after its last read of the tile
// kPair (sm90_fwd's kCluster: the two CTAs of a cluster fill each other's K/V slots by multicast,
// Sm90RowTile's kPair): a slot's K or V is refilled by both producers, so its empty mbarrier counts the
// partner CTA's consumers too: each consumer warp's lane 0 releases the partner's slot (release) once
// the warp is past its wait for the GEMM that read it (wgmma waits are warp-collective: the whole
// warp is), one remote arrival per warp instead of per thread; init_ring's count is then
// consumer_threads + consumer_threads / 32 (remote_arrivals). None to the partner for the CTA's last
// kStages iterations (it + kStages >= kv_total), which nothing refills, so that no arrival reaches a
// CTA that has finished. Both CTAs run the same iterations (the same tiles' K/V blocks).
template <int kStages, bool kPair = false>
struct Sm90FwdBars {
    static constexpr int kCount = 2 + 4 * kStages;
    u32 base;
    int kv_total = 0;   // kPair: the CTA's K/V iterations
    // kPair: the partner's arrivals on an empty mbarrier, one per consumer warp
    static __device__ __forceinline__ constexpr int remote_arrivals(int consumer_threads) {
        return kPair ? consumer_threads / 32 : 0;
    }
    // a consumer thread's release of K or V slot `empty` after its last read of iteration it
    __device__ __forceinline__ void release(u32 empty, int it) const {
        mbarrier_arrive(empty);
        if constexpr (kPair)
            if ((threadIdx.x & 31) == 0 && it + kStages < kv_total)
                mbarrier_arrive_remote(mapa_shared(empty, cluster_ctarank() ^ 1u));
    }
    __device__ __forceinline__ u32 q_full() const { return base; }
    __device__ __forceinline__ u32 q_empty() const { return base + 8u; }
    __device__ __forceinline__ u32 k_full(int slot) const { return base + 8u * (2 + slot); }
    __device__ __forceinline__ u32 v_full(int slot) const { return base + 8u * (2 + kStages + slot); }
    __device__ __forceinline__ u32 k_empty(int slot) const { return base + 8u * (2 + 2 * kStages + slot); }
    __device__ __forceinline__ u32 v_empty(int slot) const { return base + 8u * (2 + 3 * kStages + slot); }

    // thread 0, before the CTA's __syncthreads (and fence_mbarrier_init): Q's, then the ring's
    __device__ __forceinline__ void init_q(int consumer_threads) const {
        mbarrier_init(q_full(), 1);                         // the producer's expect_tx arrival
        mbarrier_init(q_empty(), consumer_threads);         // every consumer thread releases Q
    }
    __device__ __forceinline__ void init_ring(int consumer_threads) const {
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(k_full(s), 1);
            mbarrier_init(v_full(s), 1);
            mbarrier_init(k_empty(s), consumer_threads);    // every consumer thread releases
            mbarrier_init(v_empty(s), consumer_threads);
        }
    }
};

// ---- producer ----
// A tile that TMA loads as kBoxes boxes of one 128-byte swizzled row each (kBoxCols elements: 64
// of 16 bits, 128 e4m3), box b into dst + b · kBoxBytes from column b · kBoxCols: Q_i (rows are
// queries), K_j and V_j (rows are keys). kBytes, the boxes' bytes with TMA's zero fill (columns
// past the real head dim, rows past the sequence's end), is what the full mbarrier expects.
// kPair (sm90_fwd's kCluster; kBoxes even): the two CTAs of a cluster load half the boxes each, CTA
// rank r boxes r · kBoxes / 2 .. (r + 1) · kBoxes / 2 - 1, multicast into both CTAs' shared memory
// at dst, each box's bytes completing on the mbarrier `full` of both CTAs: each CTA's full mbarrier
// still expects the whole tile (kBytes) from its own producer's expect_tx.
template <int kBoxes, int kBoxCols, int kBoxBytes, bool kPair = false>
struct Sm90RowTile {
    static_assert(!kPair || kBoxes % 2 == 0, "a tile shared by two CTAs needs an even number of boxes");
    static constexpr int kBytes = kBoxes * kBoxBytes;
    // rows row0.. of (head, batch) of the tensor map's rank-4 tensor, completing on mbarrier `full`
    static __device__ __forceinline__ void load(u32 dst, const void* map, u32 full, int row0, int head, int batch) {
        if constexpr (kPair) {
            const int b0 = int(cluster_ctarank()) * (kBoxes / 2);
#pragma unroll
            for (int i = 0; i < kBoxes / 2; ++i)
                tma_load_4d_multicast(dst + (b0 + i) * kBoxBytes, map, full, (b0 + i) * kBoxCols, row0, head, batch,
                                      3);
        } else {
#pragma unroll
            for (int b = 0; b < kBoxes; ++b)
                tma_load_4d(dst + b * kBoxBytes, map, full, b * kBoxCols, row0, head, batch);
        }
    }
};

// The producer thread's load of Q_i into a Q buffer whose mbarriers are (full, empty), its fill
// number `fill` (phases: sm90_fwd.cu header): the buffer is free once every consumer thread released
// fill - 1 (the last S GEMM of that tile has completed), then Q's bytes are announced and loaded.
template <class QTile>
__device__ __forceinline__ void sm90_load_q(u32 dst, u32 full, u32 empty, int fill, const void* tma_q, int row0,
                                            int head, int batch) {
    if (fill > 0) mbarrier_wait(empty, (fill - 1) & 1);
    mbarrier_arrive_expect_tx(full, QTile::kBytes);
    QTile::load(dst, tma_q, full, row0, head, batch);
}

// The producer thread's fill of the K/V ring with a tile's n_blocks K/V blocks, in the consumers'
// order (block j's keys from key0(j) on, of kv head head_kv), at the CTA's K/V iterations it, it + 1,
// ... (it is advanced past them): K_j and V_j into slot it % kStages (KTile / VTile: their TMA
// boxes, each slot's tiles kBytes apart). Slot reuse: from the ring's second round on, the
// consumers must have released the tiles of iteration it - kStages (the slot's release
// it / kStages - 1), K and V apart, so that a slot's next K tile can load while its V_j is still read.
template <class KTile, class VTile, int kStages, bool kPair, class Key0>
__device__ __forceinline__ void sm90_fill_kv(const Sm90FwdBars<kStages, kPair>& bar, int& it, int n_blocks, Key0&& key0,
                                             u32 k_smem, u32 v_smem, const void* tma_k, const void* tma_v,
                                             int head_kv, int batch) {
    for (int j = 0; j < n_blocks; ++j, ++it) {
        const int slot = it % kStages;
        const u32 reuse_phase = (it / kStages - 1) & 1;
        const int key = key0(j);
        if (it >= kStages) mbarrier_wait(bar.k_empty(slot), reuse_phase);
        mbarrier_arrive_expect_tx(bar.k_full(slot), KTile::kBytes);
        KTile::load(k_smem + slot * KTile::kBytes, tma_k, bar.k_full(slot), key, head_kv, batch);
        if (it >= kStages) mbarrier_wait(bar.v_empty(slot), reuse_phase);
        mbarrier_arrive_expect_tx(bar.v_full(slot), VTile::kBytes);
        VTile::load(v_smem + slot * VTile::kBytes, tma_v, bar.v_full(slot), key, head_kv, batch);
    }
}

// ---- consumers ----
// A hook the kernel leaves empty (sm90_consume_blocks' optional steps)
struct Sm90Skip {
    template <class... A>
    __device__ __forceinline__ void operator()(A...) const {}
};

// One tile's K/V loop on the consumer side, FA3's pipeline (sm90_fwd.cu header), over the CTA's
// iterations kv_iter .. kv_iter + n_blocks - 1 (j counts the tile's blocks in loop order):
//   j = 0       issue S_0 (kIssueFirst: else the kernel issued it ahead), wait, softmax -> P_0
//   j = 1..n-1  issue S_j and O += P_{j-1} V_{j-1} in one turn, wait for S_j, softmax under the P V
//               GEMM, wait for it, release V_{j-1}, rescale O, P_j to the A operand
//   end         O += P_{n-1} V_{n-1} (the tile's final turn), wait (kLastWait groups may stay in flight)
// The kernel's parts:
//   issue_s(slot), issue_pv(slot)  S = Q K_slotᵀ, O += P V_slot: issued and committed, not waited for
//   softmax_s(slot, j)             S_j has landed: release K_j (and Q after the tile's last S), mask,
//                                  the online softmax step (P_j, m, l, alpha)
//   to_p(j)                        P_j to the A operand of the next P V (with the kernel's dropout)
//   rescale_o()                    O *= alpha_j, once P_{j-1} V_{j-1} is in O
// and its optional steps (Sm90Skip where it has none):
//   draw(j)                        work for block j under the wait for S_j
//   first_landed()                 right after S_0 is waited for
//   rescale_first(in_loop)         O *= alpha before the P V GEMM is issued (in_loop: behind S_j)
//   after_last_pv()                behind the last P V, in the same turn
// kRotate: the same steps in the same order, with the loop rotated: block j - 1's finish (wait for
// P_{j-2} V_{j-2}, release V_{j-2}, rescale O, P_{j-1} to the A operand) runs at the head of
// iteration j (and, for the last block, after the loop), so softmax_s(j) ends its iteration and
// the next wait for a P V sits across the loop's back edge. Why: ptxas (nvcc 13.0) schedules
// inside a basic block, and there it put the wait for P_{j-1} V_{j-1} (WARPGROUP.DEPBAR.LE gsb0,
// 0x0) above softmax_s(j)'s row max and exp2s (the whole step of the plain kernel after the wait:
// it overlapped only the other warpgroups' GEMMs, not its own P V). j = 1's head waits with no
// group in flight (no-op) and neither releases nor rescales (block 0 had no P V before it).
// false (the default): the loop as before, the code of the kernels before the parameter existed.
// (Measured no faster on the H100: cuflash/families/sm90_fwd.py PV_OVERLAP's note.)
template <bool kIssueFirst, int kLastWait, bool kRotate = false, int kStages, bool kPair, class Turn, int kS, int kO,
          class IssueS, class IssuePv, class SoftmaxS, class ToP, class RescaleO, class Draw, class FirstLanded,
          class RescaleFirst, class AfterLastPv>
__device__ __forceinline__ void sm90_consume_blocks(const Sm90FwdBars<kStages, kPair>& bar, const Turn& turn, int kv_iter,
                                                    int n_blocks, bool last_tile, float (&s_flat)[kS],
                                                    float (&o_flat)[kO], IssueS&& issue_s, IssuePv&& issue_pv,
                                                    SoftmaxS&& softmax_s, ToP&& to_p, RescaleO&& rescale_o,
                                                    Draw&& draw, FirstLanded&& first_landed,
                                                    RescaleFirst&& rescale_first, AfterLastPv&& after_last_pv) {
    auto phase = [&](int j) { return u32((kv_iter + j) / kStages) & 1; };
    auto slot_of = [&](int j) { return (kv_iter + j) % kStages; };
    // j = 0 (the last K/V block): S, softmax; O is still zero, so no P V and no rescale
    if constexpr (kIssueFirst) {
        turn.begin();
        mbarrier_wait(bar.k_full(slot_of(0)), phase(0));
        reg_fence(s_flat);
        reg_fence(o_flat);
        wgmma_fence();
        issue_s(slot_of(0));
        turn.end();
    }
    draw(0);
    wgmma_wait<0>();
    first_landed();
    softmax_s(slot_of(0), 0);
    if constexpr (!kRotate) to_p(0);
    // kRotate: block jj's finish, once its softmax has run (jj >= 1: P_{jj-1} V_{jj-1} was issued)
    auto finish = [&](int jj) {
        wgmma_wait<0>();                   // P_{jj-1} V_{jj-1} is in O (jj = 0: no group in flight)
        reg_fence(o_flat);
        if (jj > 0) {
            bar.release(bar.v_empty(slot_of(jj - 1)), kv_iter + jj - 1);   // V_{jj-1}'s slot may be refilled
            rescale_o();
        }
        to_p(jj);
    };

    for (int j = 1; j < n_blocks; ++j) {
        const int slot = slot_of(j), prev = slot_of(j - 1);
        if constexpr (kRotate) finish(j - 1);
        turn.begin();
        mbarrier_wait(bar.k_full(slot), phase(j));
        // reg_fence keeps the reads of the old S (packed into P_{j-1}) and the rescale
        // of O above the wgmma; wgmma_fence orders those register writes before its reads.
        reg_fence(s_flat);
        reg_fence(o_flat);
        wgmma_fence();
        issue_s(slot);
        rescale_first(true);
        mbarrier_wait(bar.v_full(prev), phase(j - 1));
        issue_pv(prev);
        turn.end();
        draw(j);
        wgmma_wait<1>();                   // S_j is ready; P_{j-1} V_{j-1} may still run
        softmax_s(slot, j);
        if constexpr (!kRotate) {
            wgmma_wait<0>();                   // P_{j-1} V_{j-1} is in O
            reg_fence(o_flat);
            bar.release(bar.v_empty(prev), kv_iter + j - 1);    // V_{j-1}'s slot may be refilled
            rescale_o();
            to_p(j);
        }
    }
    if constexpr (kRotate) finish(n_blocks - 1);
    // end: the last block's O += P V (the tile's final turn)
    const int last = slot_of(n_blocks - 1);
    turn.begin();
    mbarrier_wait(bar.v_full(last), phase(n_blocks - 1));
    rescale_first(false);
    reg_fence(o_flat);
    wgmma_fence();
    issue_pv(last);
    after_last_pv();
    turn.end(last_tile);
    wgmma_wait<kLastWait>();
    reg_fence(o_flat);
    bar.release(bar.v_empty(last), kv_iter + n_blocks - 1);
}

// The register epilogue of one warp's rows of tile `at`: O = acc · o_factor(half, l_row) (1 / l
// and the kernel's factors; l_row = quad_sum(l), the row's whole sum) stored straight from
// registers, two columns (4 bytes) per store, skipping rows past seqlen_q and columns past
// head_dim; LSE = m · lse_scale() + log l by the quad's first thread. Thread (g, t) holds rows
// warp_row0 + g + 8·half of O's 64 x kOCols accumulator tile, columns 8·nt + 2t + e (sm90_fwd.cu:
// the accumulator layout). A row with no visible key (l = 0) stores O = 0 and LSE = +inf.
// kVarlen: the rows of sequence seq (varlen.cuh), else seq is seq_span<false>'s constants.
// Why the pointers and row bound are computed here from p and the factors come as callables, not
// as values: with them computed by the caller, nvcc 13.0 placed the address and scale arithmetic
// elsewhere (d256: a 64-bit address rebuilt at each of the 64 stores); evaluated where each kernel
// had them, the SASS is the kernels' own.
template <class Out, int kOCols, bool kVarlen, class Params, class OFactor, class LseScale>
__device__ __forceinline__ void sm90_store_o_lse(const Params& p, const Sm90Tile& at, const SeqSpan& seq,
                                                 const float (&o_acc)[1][kOCols / 8][4], const float (&m)[1][2],
                                                 const float (&l)[1][2], OFactor&& o_factor, LseScale&& lse_scale,
                                                 int warp_row0, int g, int t) {
    // kVarlen: rows from the sequence's first (o_batch_stride is 0), LSE (nheads, total_q)
    u16* o_gmem = static_cast<u16*>(p.o) + at.batch * p.o_batch_stride + at.head * p.o_head_stride
                  + static_cast<i64>(seq.q_start) * p.o_row_stride;
    float* lse_gmem = p.lse + lse_offset<kVarlen>(p, at.batch, at.head, seq);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float l_row = quad_sum(l[0][half]);
        const float inv_l = o_factor(half, l_row);
        const int r = warp_row0 + g + 8 * half;
        if (r < (kVarlen ? seq.seqlen_q : p.seqlen_q)) {
            u16* o_row = o_gmem + r * p.o_row_stride;
#pragma unroll
            for (int nt = 0; nt < kOCols / 8; ++nt) {
                const int col = nt * 8 + 2 * t;
                if (col < p.head_dim)
                    *reinterpret_cast<u32*>(o_row + col) =
                        pack2<Out>(o_acc[0][nt][2 * half] * inv_l, o_acc[0][nt][2 * half + 1] * inv_l);
            }
            if (t == 0) lse_gmem[r] = softmax_lse(m[0][half], l_row, lse_scale());
        }
    }
}

}  // namespace cuflash
