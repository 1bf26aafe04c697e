// fa2_fwd.cu: FlashAttention-2 forward, exact attention on tensor cores (sm_80 and newer).
//
//   O = softmax(Q Kᵀ · scale, causal mask) V,   LSE = log Σ_j exp(S_ij)   (per query row)
//
// One CTA computes one Q block Q_i (Br query rows) of one (head, batch): Q_i stays in shared
// memory, the K_j / V_j blocks (Bc keys each) stream through a `kStages`-deep cp.async ring,
// and each warp keeps its own 16·kMTiles rows of S, P and O in registers. The softmax is
// online (running row max m and row sum l, softmax.cuh) and the division by l is delayed to
// the end. The products are gemm.cuh's warp-level tiles, the mask is mask.cuh's.
//
// Layouts: see FwdParams in params.cuh. Shared memory rows are padded by 8 elements
// (16 bytes) so that the 8 row addresses of every ldmatrix fall into different banks.
//
// Template parameters (cuflash/families/fa2_fwd.py FwdConfig is the host-side mirror; it
// validates the same rules before compiling):
//   kBr       rows of the Q block: a multiple of 16·kWarps (64, 128)
//   kBc       keys of a K/V block: a multiple of 16 (32, 64, 128)
//   kWarps    warps per CTA (4, 8); each warp owns kBr / kWarps whole query rows
//   kStages   K/V blocks in flight in shared memory, >= 2 (2, 3)
//   kHeadDim  head dim the kernel is built for: a multiple of 16, <= 256; the real head dim
//             (params.head_dim) may be smaller, the extra columns are zero-filled
//   Elem      bf16 or fp16 (tags from ptx.cuh); accumulation is always fp32
//   kCausal   bottom-right aligned causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q
//   kVarlen   variable-length batch (varlen.cuh): blockIdx.z is a sequence of cu_seqlens_q/k,
//             the grid is sized for the longest; Q blocks past a sequence's end exit at once
//   kDropout  attention dropout (philox.cuh): O accumulates P ∘ Z, with Z the keep mask of
//             (params.rng_state, batch·nheads + head, row, column), and the epilogue divides by
//             l (1 - p) (O = (P ∘ Z / (1 - p)) V / l); l and LSE stay undropped
//   kWindow   sliding window (params.window_left / window_right, -1 unbounded; mask.cuh BandMask):
//             K/V blocks outside the band are skipped on both sides
//   kSoftcap  scores capped: softcap·tanh(scale·S / softcap) (score.cuh)
//   kAlibi    ALiBi bias -slope·|i + seqlen_k - seqlen_q - j| (params.alibi_slopes; score.cuh)
#include "ptx.cuh"
#include "params.cuh"
#include "tile.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "varlen.cuh"
#include "philox.cuh"

namespace cuflash {

template <int kBr, int kBc, int kWarps, int kStages, int kHeadDim>
struct FwdShape {
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kMTiles = kBr / (16 * kWarps);  // 16-row mma tiles per warp
    static constexpr int kNTilesS = kBc / 8;             // 8-column tiles of S (and P) per row
    static constexpr int kNTilesO = kHeadDim / 8;        // 8-column tiles of O per row
    static constexpr int kPitch = kHeadDim + 8;          // shared-memory row pitch, elements
    static constexpr int kQTile = kBr * kPitch;          // elements of one Q tile in smem
    static constexpr int kKVTile = kBc * kPitch;         // elements of one K (or V) tile

    static_assert(kWarps >= 1 && kWarps <= 16, "warps must be in 1..16");
    static_assert(kBr % (16 * kWarps) == 0,
                  "Br must be a multiple of 16 * warps: each warp owns whole 16-row mma tiles");
    static_assert(kBc % 16 == 0, "Bc must be a multiple of 16 (P is the A operand of k16 mma)");
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256,
                  "kHeadDim must be a multiple of 16, at most 256");
    static_assert(kStages >= 2, "stages must be >= 2: one K/V block computed while the next loads");
};

template <int kBr, int kBc, int kWarps, int kStages, int kHeadDim, class Elem, bool kCausal,
          bool kVarlen = false, bool kDropout = false, bool kWindow = false, bool kSoftcap = false,
          bool kAlibi = false>
__global__ void __launch_bounds__(kWarps * 32)
fa2_fwd(const FwdParams p) {
    using Shape = FwdShape<kBr, kBc, kWarps, kStages, kHeadDim>;
    using Mask = BandMask<kCausal, kWindow>;  // the mask kind (mask.cuh)
    constexpr int kThreads = Shape::kThreads, kMTiles = Shape::kMTiles;
    constexpr int kNTilesS = Shape::kNTilesS, kNTilesO = Shape::kNTilesO;
    constexpr int kPitch = Shape::kPitch;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* q_smem = reinterpret_cast<u16*>(smem_raw);        // [Br][kPitch]
    u16* k_smem = q_smem + Shape::kQTile;                   // [kStages][Bc][kPitch]
    u16* v_smem = k_smem + kStages * Shape::kKVTile;        // [kStages][Bc][kPitch]

    // Heaviest Q blocks (the last ones, under a causal mask) are scheduled first.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int head_kv = head / (p.nheads / p.nheads_kv);   // GQA / MQA: heads share K/V
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;                   // mma fragment coordinates
    const int row0 = m_block * kBr;                         // first query row of Q_i
    const int warp_row0 = warp * kMTiles * 16;              // this warp's rows within Q_i

    // This sequence's rows and lengths (varlen.cuh; fixed lengths: 0, 0, seqlen_q, seqlen_k).
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    if (kVarlen && row0 >= seq.seqlen_q) return;  // a Q block past this sequence's end
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const u16* q_gmem = static_cast<const u16*>(p.q) + batch * p.q_batch_stride
                        + head * p.q_head_stride + (seq.q_start + row0) * p.q_row_stride;
    const u16* k_gmem = static_cast<const u16*>(p.k) + batch * p.k_batch_stride
                        + head_kv * p.k_head_stride + seq.k_start * p.k_row_stride;
    const u16* v_gmem = static_cast<const u16*>(p.v) + batch * p.v_batch_stride
                        + head_kv * p.v_head_stride + seq.k_start * p.v_row_stride;
    u16* o_gmem = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride
                  + (seq.q_start + row0) * p.o_row_stride;
    float* lse_gmem = p.lse + lse_offset<kVarlen>(p, batch, head, seq) + row0;
    const int rows_valid = min(kBr, seqlen_q - row0);

    // K/V blocks this Q block needs, [n_block_min, n_blocks): causal, the last row of Q_i sees
    // keys up to row0 + kBr - 1 + seqlen_k - seqlen_q; under a window the first row sees none
    // before row0 + seqlen_k - seqlen_q - left; blocks outside are skipped entirely.
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    const int n_blocks = mask.template kv_block_end<kBr, kBc>(row0);
    const int n_block_min = mask.template kv_block_begin<kBr, kBc>(row0);
    const int n_iters = n_blocks - n_block_min;
    const ScoreMod<kSoftcap, kAlibi> score(p.softcap_in, p.softcap_out, p.alibi_slopes,
                                           p.alibi_batch_stride, batch, head, p.softmax_scale,
                                           seqlen_q, seqlen_k);
    if (kWindow ? n_iters <= 0 : n_blocks == 0) {  // a window's band may miss every key
        // Every row of Q_i is fully masked (seqlen_q > seqlen_k under the causal mask):
        // O = 0 and LSE = +inf, flash-attn's convention (the backward then recomputes P = 0).
        for (int c = tid; c < rows_valid * (kHeadDim / 8); c += kThreads) {
            const int r = c / (kHeadDim / 8), col = (c % (kHeadDim / 8)) * 8;
            if (col < p.head_dim)
                *reinterpret_cast<u32x4*>(o_gmem + r * p.o_row_stride + col) = u32x4{0, 0, 0, 0};
        }
        for (int r = tid; r < rows_valid; r += kThreads) lse_gmem[r] = pos_inf();
        return;
    }

    // K_j / V_j of the i-th iteration: blocks run from the last to the first, so the few
    // blocks that need a mask (the ragged end, the causal diagonal) come first and the
    // unmasked bulk follows.
    auto load_kv = [&](int iter) {
        const int n_block = n_blocks - 1 - iter, slot = iter % kStages;
        const i64 key0 = static_cast<i64>(n_block) * kBc;
        const int keys_valid = seqlen_k - n_block * kBc;  // one bound for both tiles
        load_tile_g2s<kBc, kHeadDim, kPitch, kThreads>(
            k_smem + slot * Shape::kKVTile, k_gmem + key0 * p.k_row_stride, p.k_row_stride,
            keys_valid, p.head_dim, tid);
        load_tile_g2s<kBc, kHeadDim, kPitch, kThreads>(
            v_smem + slot * Shape::kKVTile, v_gmem + key0 * p.v_row_stride, p.v_row_stride,
            keys_valid, p.head_dim, tid);
    };

    // Prologue: Q_i, then the first kStages - 1 K/V blocks, one commit group each.
    load_tile_g2s<kBr, kHeadDim, kPitch, kThreads>(q_smem, q_gmem, p.q_row_stride, rows_valid,
                                                  p.head_dim, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_iters) load_kv(s);
        cp_async_commit();  // committed even when empty, so group counting stays uniform
    }

    // Per-thread state. Thread (g, t) of a warp holds rows g and g + 8 of each mma tile:
    // index [mt][half] means row warp_row0 + 16·mt + g + 8·half (o_acc: [mt][nt][2·half + e],
    // columns 8·nt + 2t + e).
    float o_acc[kMTiles][kNTilesO][4];
    float m[kMTiles][2];  // running row max of the raw scores S (not yet scaled)
    float l[kMTiles][2];  // running row sum of P, this thread's columns only
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTilesO; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    softmax_init(m, l);
    Dropout dropout{};  // kDropout: this launch's keep mask and scale
    if constexpr (kDropout)
        dropout = Dropout::load(p.rng_state, p.dropout_threshold, p.dropout_scale);

    // Each lane's ldmatrix.x4 address inside a 16x16 block of 16-bit elements, as a byte
    // offset from the tile's start (one register each; the loops add compile-time offsets).
    // Lane l points at row (l % 8) of 8x8 matrix (l / 8); register i receives matrix i.
    constexpr int kRowBytes = kPitch * 2;
    // A operand (Q): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    const u32 q_lane = smem_u32(q_smem) + (warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes
                       + (lane >> 4) * 16;
    // B operand of S = Q Kᵀ (K rows are keys): (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), ...
    const u32 k_lane = smem_u32(k_smem) + ((lane & 7) + (lane >> 4) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;
    // B operand of O = P V, transposed (V rows are keys): (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), ...
    const u32 v_lane = smem_u32(v_smem) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;

    for (int iter = 0; iter < n_iters; ++iter) {
        const int n_block = n_blocks - 1 - iter, slot = iter % kStages;

        // K_j, V_j (and Q_i at iter 0) have landed once at most kStages - 2 newer groups are
        // in flight. The barrier also tells every warp that all warps are done with the slot
        // of iteration iter - 1, which the prefetch (further down) overwrites.
        cp_async_wait<kStages - 2>();
        __syncthreads();

        // ---- S = Q_i K_jᵀ  (kMTiles·16 x Bc per warp, fp32) ----
        float s_acc[kMTiles][kNTilesS][4];
        // A = this warp's rows of Q_i, B = the rows (keys) of K_j, reduced over the head dim
        gemm_rows_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(
            s_acc, q_lane, k_lane + slot * Shape::kKVTile * 2);

        // ---- score modifiers (softcap, ALiBi), then the mask: only the ragged last block and
        // the blocks on the band's edges ----
        score.apply(s_acc, row0 + warp_row0, n_block * kBc, g, t);
        if (mask.template needs_mask<kBc, kBr>(row0, n_block))
            mask.apply(s_acc, row0 + warp_row0, n_block * kBc, g, t, neg_inf());

        // ---- online softmax: m_new = max(m, rowmax S); P = exp(S - m_new); rescale l, O ----
        softmax_update(s_acc, o_acc, m, l, p.scale_log2);

        // ---- dropout (Algorithm 2): P ∘ Z feeds O (1 / (1 - p) waits for the epilogue), while
        // l summed the undropped P above, so LSE is plain attention's and the backward
        // recomputes the same P ----
        if constexpr (kDropout)
            dropout.zero_dropped(s_acc, batch * p.nheads + head, row0 + warp_row0, n_block * kBc, g, t);

        // ---- O += P V_j: P goes from the S accumulators straight into A fragments ----
        // p_frag[mt][kk] is the A operand of keys 16kk..16kk+15 (gemm.cuh: pack_a_frags).
        // Packing all of it first frees the fp32 S registers.
        u32 p_frag[kMTiles][kBc / 16][4];
        pack_a_frags<kMTiles, kBc / 16, Elem>(p_frag, s_acc);
        // Prefetch K/V for iteration iter + kStages - 1 into the slot freed by iter - 1. It is
        // issued here, once the fp32 S registers are dead, because its address arithmetic
        // would otherwise push the O + S accumulators into spills (ptxas -v, head dim 128).
        if (iter + kStages - 1 < n_iters) load_kv(iter + kStages - 1);
        cp_async_commit();

        // B = V_j read transposed (its rows are keys, the reduction dimension of P V)
        gemm_frags_x_rows_t<kMTiles, kNTilesO, kBc / 16, kRowBytes, Elem>(
            o_acc, p_frag, v_lane + slot * Shape::kKVTile * 2);
    }
    cp_async_wait<0>();  // only empty groups remain; leave none in flight at exit

    // ---- epilogue: O = acc / l (delayed normalization), LSE = m·scale + log l ----
    // Each warp stages its own rows of O through its own rows of q_smem (no other warp reads
    // them), then writes 16-byte chunks to global memory: only warp-level sync is needed.
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // l = 0: every key of this row is masked; O = 0 and LSE = +inf (see above).
            const float l_row = quad_sum(l[mt][half]);
            float inv_l = softmax_inv_l(l_row);
            if constexpr (kDropout) inv_l *= dropout.scale;   // O = (P ∘ Z) V / (l (1 - p))
            const int r = warp_row0 + mt * 16 + g + 8 * half;
#pragma unroll
            for (int nt = 0; nt < kNTilesO; ++nt)
                *reinterpret_cast<u32*>(q_smem + r * kPitch + nt * 8 + 2 * t) =
                    pack2<Elem>(o_acc[mt][nt][2 * half] * inv_l, o_acc[mt][nt][2 * half + 1] * inv_l);
            if (t == 0 && r < rows_valid)
                lse_gmem[r] = softmax_lse(m[mt][half], l_row, p.softmax_scale);
        }
    __syncwarp();
    constexpr int kChunks = kHeadDim / 8;
#pragma unroll
    for (int c = lane; c < kMTiles * 16 * kChunks; c += 32) {
        const int r = warp_row0 + c / kChunks, col = (c % kChunks) * 8;
        if (r < rows_valid && col < p.head_dim)
            *reinterpret_cast<u32x4*>(o_gmem + r * p.o_row_stride + col) =
                *reinterpret_cast<const u32x4*>(q_smem + r * kPitch + col);
    }
}

}  // namespace cuflash
