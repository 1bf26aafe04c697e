// fa2_fwd_paged.cu: FlashAttention-2 forward of a variable-length batch over a paged K/V cache
// (flash-attn's flash_attn_varlen_func with block_table), sm_80 and newer.
//
// The algorithm, tiling, shared-memory layout and register layout are fa2_fwd.cu's (read its
// header first); only where K_j and V_j come from differs. Sequence b's keys live in pages of
// page_block_size rows: key j is row j % page_block_size of page block_table[b, j /
// page_block_size] of k and v, (num_pages, page_block_size, nheads_kv, head_dim) (params_paged.cuh).
// A page size that is a multiple of Bc (flash-attn's 256, say) costs one look-up per K/V tile;
// any other size works too, each key row of a tile looking up its own page (a tile may straddle
// pages). Page ids and table entries are clamped, so a
// bad block table reads a wrong page of the cache, never memory outside it.
// Its own family (cuflash/families/fa2_fwd_paged.py) with its own params struct, so fa2_fwd's
// code, its tuned entries and its fast paths are untouched.
//
// Template parameters: kBr, kBc, kWarps, kStages, kHeadDim, Elem, kCausal, kWindow, kSoftcap,
// kAlibi as in fa2_fwd.cu (always a variable-length batch: kVarlen there; no dropout).
// fa2_fwd.cu for FwdShape and the headers (tile, gemm, mask, score, softmax, varlen)
#include "fa2_fwd.cu"
#include "params_paged.cuh"

namespace cuflash {

// K_j and V_j (kRows keys from key0 on) of one sequence into shared memory: row r of both
// tiles is key key0 + r, read from its page (k_head, v_head: the cache at this K/V head; one
// page for the whole tile when page_block_size is a multiple of kRows, as key0 is of kRows);
// rows >= keys_valid and columns >= head_dim are zero-filled (tile.cuh's thread layout: a
// thread keeps one 16-byte column chunk and walks rows in steps of kRowsPerPass).
template <int kRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void load_paged_kv_g2s(u16* k_tile, u16* v_tile, const u16* k_head,
                                                  const u16* v_head, const int* pages,
                                                  const FwdPagedParams& p, int key0, int keys_valid,
                                                  int tid) {
    if (p.page_block_size % kRows == 0) {  // pages of whole tiles (flash-attn's sizes): one look-up
        const int entry = min(key0 / p.page_block_size, p.block_table_cols - 1);
        const i64 page = min(max(pages[entry], 0), p.num_pages - 1);
        const i64 in_page = key0 - (key0 / p.page_block_size) * p.page_block_size;
        load_tile_g2s<kRows, kHeadDim, kPitch, kThreads>(
            k_tile, k_head + page * p.k_batch_stride + in_page * p.k_row_stride, p.k_row_stride,
            keys_valid, p.head_dim, tid);
        load_tile_g2s<kRows, kHeadDim, kPitch, kThreads>(
            v_tile, v_head + page * p.v_batch_stride + in_page * p.v_row_stride, p.v_row_stride,
            keys_valid, p.head_dim, tid);
        return;
    }
    // any other page size: each row looks its page up
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    constexpr int kRowsPerPass = kThreads / kLanesPerRow;
    static_assert(kThreads % kLanesPerRow == 0, "a CTA must cover whole rows per pass");
    const int row = tid / kLanesPerRow, col = (tid % kLanesPerRow) * 8;
    if (col >= kHeadDim) return;  // lanes past the last chunk of a non-power-of-2 head dim
    const bool col_valid = col < p.head_dim;
    const u32 k_dst = smem_u32(k_tile + row * kPitch + col), v_dst = smem_u32(v_tile + row * kPitch + col);
#pragma unroll
    for (int pass = 0; pass * kRowsPerPass < kRows; ++pass) {
        const int r = row + pass * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || r < kRows) {
            const bool valid = col_valid && r < keys_valid;
            const u16* k_src = k_head;  // zero-filled rows read nothing (cp.async src-size 0)
            const u16* v_src = v_head;
            if (valid) {
                const int key = key0 + r;
                const int entry = min(key / p.page_block_size, p.block_table_cols - 1);
                const i64 page = min(max(pages[entry], 0), p.num_pages - 1);
                const i64 in_page = key - (key / p.page_block_size) * p.page_block_size;
                k_src = k_head + page * p.k_batch_stride + in_page * p.k_row_stride + col;
                v_src = v_head + page * p.v_batch_stride + in_page * p.v_row_stride + col;
            }
            cp_async_16(k_dst + pass * kRowsPerPass * kPitch * 2, k_src, valid);
            cp_async_16(v_dst + pass * kRowsPerPass * kPitch * 2, v_src, valid);
        }
    }
}

template <int kBr, int kBc, int kWarps, int kStages, int kHeadDim, class Elem, bool kCausal,
          bool kWindow = false, bool kSoftcap = false, bool kAlibi = false>
__global__ void __launch_bounds__(kWarps * 32)
fa2_fwd_paged(const FwdPagedParams p) {
    using Shape = FwdShape<kBr, kBc, kWarps, kStages, kHeadDim>;
    using Mask = BandMask<kCausal, kWindow>;
    constexpr int kThreads = Shape::kThreads, kMTiles = Shape::kMTiles;
    constexpr int kNTilesS = Shape::kNTilesS, kNTilesO = Shape::kNTilesO;
    constexpr int kPitch = Shape::kPitch;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* q_smem = reinterpret_cast<u16*>(smem_raw);        // [Br][kPitch]
    u16* k_smem = q_smem + Shape::kQTile;                   // [kStages][Bc][kPitch]
    u16* v_smem = k_smem + kStages * Shape::kKVTile;        // [kStages][Bc][kPitch]

    const int m_block = gridDim.x - 1 - blockIdx.x;         // heaviest Q blocks first
    const int head = blockIdx.y, batch = blockIdx.z;
    const int head_kv = head / (p.nheads / p.nheads_kv);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int row0 = m_block * kBr;
    const int warp_row0 = warp * kMTiles * 16;

    // This sequence's queries (rows of q) and number of keys (in its pages).
    const SeqSpan seq = seq_span<true>(p, batch);
    if (row0 >= seq.seqlen_q) return;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const u16* q_gmem = static_cast<const u16*>(p.q) + head * p.q_head_stride
                        + (seq.q_start + row0) * p.q_row_stride;
    const u16* k_head = static_cast<const u16*>(p.k) + head_kv * p.k_head_stride;
    const u16* v_head = static_cast<const u16*>(p.v) + head_kv * p.v_head_stride;
    const int* pages = p.block_table + static_cast<i64>(batch) * p.block_table_stride;
    u16* o_gmem = static_cast<u16*>(p.o) + head * p.o_head_stride + (seq.q_start + row0) * p.o_row_stride;
    float* lse_gmem = p.lse + lse_offset<true>(p, batch, head, seq) + row0;
    const int rows_valid = min(kBr, seqlen_q - row0);

    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    const int n_blocks = mask.template kv_block_end<kBr, kBc>(row0);
    const int n_block_min = mask.template kv_block_begin<kBr, kBc>(row0);
    const int n_iters = n_blocks - n_block_min;
    const ScoreMod<kSoftcap, kAlibi> score(p.softcap_in, p.softcap_out, p.alibi_slopes,
                                           p.alibi_batch_stride, batch, head, p.softmax_scale,
                                           seqlen_q, seqlen_k);
    if (kWindow ? n_iters <= 0 : n_blocks == 0) {  // no visible key: O = 0, LSE = +inf
        for (int c = tid; c < rows_valid * (kHeadDim / 8); c += kThreads) {
            const int r = c / (kHeadDim / 8), col = (c % (kHeadDim / 8)) * 8;
            if (col < p.head_dim)
                *reinterpret_cast<u32x4*>(o_gmem + r * p.o_row_stride + col) = u32x4{0, 0, 0, 0};
        }
        for (int r = tid; r < rows_valid; r += kThreads) lse_gmem[r] = pos_inf();
        return;
    }

    // K_j / V_j of the i-th iteration (last block first, as fa2_fwd), each row from its page
    auto load_kv = [&](int iter) {
        const int n_block = n_blocks - 1 - iter, slot = iter % kStages;
        load_paged_kv_g2s<kBc, kHeadDim, kPitch, kThreads>(
            k_smem + slot * Shape::kKVTile, v_smem + slot * Shape::kKVTile, k_head, v_head, pages, p,
            n_block * kBc, seqlen_k - n_block * kBc, tid);
    };

    load_tile_g2s<kBr, kHeadDim, kPitch, kThreads>(q_smem, q_gmem, p.q_row_stride, rows_valid,
                                                  p.head_dim, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_iters) load_kv(s);
        cp_async_commit();
    }

    float o_acc[kMTiles][kNTilesO][4];
    float m[kMTiles][2];
    float l[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTilesO; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    softmax_init(m, l);

    constexpr int kRowBytes = kPitch * 2;
    const u32 q_lane = smem_u32(q_smem) + (warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes
                       + (lane >> 4) * 16;
    const u32 k_lane = smem_u32(k_smem) + ((lane & 7) + (lane >> 4) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;
    const u32 v_lane = smem_u32(v_smem) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;

    for (int iter = 0; iter < n_iters; ++iter) {
        const int n_block = n_blocks - 1 - iter, slot = iter % kStages;
        cp_async_wait<kStages - 2>();
        __syncthreads();

        // ---- S = Q_i K_jᵀ, score modifiers, the mask on the edge blocks, online softmax ----
        float s_acc[kMTiles][kNTilesS][4];
        gemm_rows_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(
            s_acc, q_lane, k_lane + slot * Shape::kKVTile * 2);
        score.apply(s_acc, row0 + warp_row0, n_block * kBc, g, t);
        if (mask.template needs_mask<kBc, kBr>(row0, n_block))
            mask.apply(s_acc, row0 + warp_row0, n_block * kBc, g, t, neg_inf());
        softmax_update(s_acc, o_acc, m, l, p.scale_log2);

        // ---- O += P V_j (the prefetch of K/V goes out once the fp32 S registers are dead) ----
        u32 p_frag[kMTiles][kBc / 16][4];
        pack_a_frags<kMTiles, kBc / 16, Elem>(p_frag, s_acc);
        if (iter + kStages - 1 < n_iters) load_kv(iter + kStages - 1);
        cp_async_commit();
        gemm_frags_x_rows_t<kMTiles, kNTilesO, kBc / 16, kRowBytes, Elem>(
            o_acc, p_frag, v_lane + slot * Shape::kKVTile * 2);
    }
    cp_async_wait<0>();

    // ---- epilogue: O = acc / l, LSE = m·scale + log l (as fa2_fwd.cu) ----
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float l_row = quad_sum(l[mt][half]);
            const float inv_l = softmax_inv_l(l_row);
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
