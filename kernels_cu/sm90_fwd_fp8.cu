// sm90_fwd_fp8.cu: FlashAttention forward for Hopper (sm_90a) with FP8 (e4m3) Q, K, V: sm90_fwd's
// algorithm and schedule (read its header first: producer warpgroup and TMA ring, consumer
// warpgroups with setmaxnreg, FA3's intra-warpgroup pipeline, pingpong, persistent tiles; the
// same mbarriers, phases and turns), with the FP8 differences of FA3's paper, section 3.3:
//
//   O = softmax(Q Kᵀ · scale · dq · dk) V · dv,   LSE = log Σ_j exp(S_ij · scale · dq · dk)
//
// where Q, K, V are the stored e4m3 values and dq, dk, dv their fp32 descale factors
// (params.q_descale ..., one per (batch, kv head)).
//   * S = Q Kᵀ by wgmma e4m3 (k = 32 per instruction), accumulated in fp32. The descales of Q
//     and K multiply every score, so they fold into the exp2 scale (scale_log2 · dq · dk) and
//     into the LSE's scale: no pass over S.
//   * P (fp32 in [0, 1]) is rounded to e4m3 for O += P V (wgmma e4m3, A from registers) as
//     256 · P (FA3's offset of 8 in exp2): e4m3's smallest subnormal is 2^-9, so unscaled
//     weights below ~2^-10 would round to zero; scaled, only those below 2^-18 do, and 256 · P
//     <= 256 stays under e4m3's 448. The row sum l adds the unscaled fp32 P, as the bf16
//     kernel does.
//   * dv / 256 multiplies O once, in the epilogue, with 1 / l (exact: powers of two aside from
//     dv).
//   * FP8 wgmma reads both shared-memory operands K-major only: for P V the reduction dim is
//     the key, so V is read as Vᵀ (head_dim rows x keys, keys contiguous). cuflash writes Vᵀ
//     with a second kernel of the family launched just before this one (sm90_fwd_fp8_prepare,
//     at the end of this file: a memory-bound tile transpose through shared memory, one read
//     and one write of V's bytes, small next to the seqlen_q x seqlen_k work at long
//     sequences), instead of FA3's in-kernel transpose by the producer (ldmatrix.trans + byte
//     permutes + stmatrix). The prepare kernel also expands the three descales.
//   * The S accumulator layout is not the fp8 A-fragment layout: per k32 step a thread holds
//     keys {2t, 2t+1, 8+2t, 9+2t} (+16) of its rows, while the A fragment wants k = 4t..4t+3
//     (+16). FA3 permutes bytes between threads; here the copy that transposes V also reorders
//     the keys inside each group of 16 (position 4t + i holds key PERM16[4t + i] =
//     {2t, 2t+1, 8+2t, 9+2t}[i]), so that the thread's own accumulators, in order, are its A
//     fragment: P goes to registers with two cvts per register and no shuffle. The reduction
//     over keys is the same sum in another order.
//
// Shared memory (base aligned to 1024 bytes): every tile in 128-byte swizzled rows as TMA
// writes them (TMA box inner extent 128 bytes = 128 e4m3):
//   q_smem [kChunks][BM][128 B], k_smem [kStages][kChunks][BN][128 B] (kChunks = head_dim / 128
//   rounded up; head dim 64 uses half of each row, TMA zero-fills the rest),
//   v_smem [kStages][kHeadDim][BN = 128 B] (Vᵀ), then the mbarriers as in sm90_fwd.
//
// Template parameters (cuflash/families/sm90_fwd_fp8.py Sm90FwdFp8Config is the host mirror):
//   kBM        64 · kConsumers query rows
//   kBN        keys of a K/V block: 128 (one 128-byte row of Vᵀ; S's wgmma n)
//   kStages, kConsumers, kPingpong, kPersistent, kCausal: as sm90_fwd
//   kHeadDim   64, 128 or 256 (the real head dim may be smaller: zero-filled columns / rows)
//   Out        bf16 output (fp32 LSE)
//
// sm90_fwd_fp8_prepare<kKeys, kCols> (role "prepare", 128 threads, static shared memory): one
// CTA per kKeys keys x kCols head-dim columns of one (batch, kv head) of V; writes that tile of
// Vᵀ (PERM16 key order, zero keys past seqlen_k) and, CTA 0 only, the expanded descales.
#include "ptx.cuh"
#include "ptx_sm90.cuh"
#include "ptx_sm90_fp8.cuh"
#include "params_sm90_fp8.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "sm90_fwd_common.cuh"

namespace cuflash {

template <int kBM, int kBN, int kStages, int kConsumers, int kHeadDim>
struct Sm90FwdFp8Shape {
    static constexpr int kThreads = (kConsumers + 1) * 128;
    static constexpr int kChunks = (kHeadDim + 127) / 128;  // 128-byte swizzle atoms per Q / K row
    static constexpr int kQChunkBytes = kBM * 128;
    static constexpr int kKChunkBytes = kBN * 128;
    static constexpr int kQBytes = kChunks * kQChunkBytes;   // TMA's byte count: zero fill included
    static constexpr int kKBytes = kChunks * kKChunkBytes;
    static constexpr int kVBytes = kHeadDim * kBN;           // Vᵀ_j: kHeadDim rows of kBN bytes
    static constexpr int kKOffset = kQBytes;
    static constexpr int kVOffset = kKOffset + kStages * kKBytes;
    static constexpr int kBarOffset = kVOffset + kStages * kVBytes;
    static constexpr int kBarriers = 2 + 4 * kStages;
    static constexpr int kSmemBytes = kBarOffset + 8 * kBarriers + 1024;
    static constexpr int kProducerRegs = kConsumers == 1 ? 56 : kConsumers == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kConsumers == 1 ? 256 : kConsumers == 2 ? 240 : 160;

    static_assert(kConsumers >= 1 && kConsumers <= 3, "consumers must be 1, 2 or 3");
    static_assert(kBM == 64 * kConsumers, "BM must be 64 * consumers: each consumer warpgroup owns 64 rows");
    static_assert(kBN == 128, "BN must be 128: one 128-byte swizzled row of V transposed (keys)");
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim must be 64, 128 or 256");
    static_assert(kStages >= 2, "stages must be >= 2");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the H100's 227 KB");
};

// Vᵀ_j as the producer loads it: one box of kHeadDim rows (head-dim columns of V) x kBN keys (the
// prepare kernel's Vᵀ, keys innermost), keys key0.. of (head, batch); kBytes: the box's bytes.
template <int kBytes_>
struct Sm90VtTile {
    static constexpr int kBytes = kBytes_;
    static __device__ __forceinline__ void load(u32 dst, const void* map, u32 full, int key0, int head, int batch) {
        tma_load_4d(dst, map, full, key0, 0, head, batch);
    }
};

template <int kBM, int kBN, int kStages, int kConsumers, bool kPingpong, bool kPersistent, int kHeadDim,
          class Out, bool kCausal>
__global__ void __launch_bounds__((kConsumers + 1) * 128, 1)
sm90_fwd_fp8(const __grid_constant__ Sm90FwdFp8Params p) {
    using Shape = Sm90FwdFp8Shape<kBM, kBN, kStages, kConsumers, kHeadDim>;
    using Mask = CausalMask<kCausal>;
    constexpr int kChunks = Shape::kChunks;
    // the producer's tiles: Q_i and K_j as kChunks boxes of 128 e4m3 columns, Vᵀ_j one box
    using QTile = Sm90RowTile<kChunks, 128, Shape::kQChunkBytes>;
    using KTile = Sm90RowTile<kChunks, 128, Shape::kKChunkBytes>;
    using VTile = Sm90VtTile<Shape::kVBytes>;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 q_smem = smem;
    const u32 k_smem = smem + Shape::kKOffset;
    const u32 v_smem = smem + Shape::kVOffset;
    const Sm90FwdBars<kStages> bar{smem + Shape::kBarOffset};
    static_assert(!kPingpong || kConsumers >= 2, "pingpong needs two or three consumer warpgroups");

    const int tid = threadIdx.x, warpgroup = tid / 128;
    const int m_blocks = (p.seqlen_q + kBM - 1) / kBM;
    const int n_tiles = m_blocks * p.nheads * p.batch;
    const Mask mask(p.seqlen_q, p.seqlen_k);
    auto kv_blocks = [&](int tile) {
        return mask.template kv_block_end<kBM, kBN>(Sm90Tile(tile, m_blocks, p.nheads).m_block * kBM);
    };

    if (tid == 0) {
        prefetch_tensormap(&p.tma_q);
        prefetch_tensormap(&p.tma_k);
        prefetch_tensormap(&p.tma_v);
        bar.init_q(kConsumers * 128);
        bar.init_ring(kConsumers * 128);
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---- producer: sm90_fwd's, with Vᵀ tiles (rank 4: keys, head dim, kv head, batch) ----
        setmaxnreg_dec<Shape::kProducerRegs>();
        if (tid == 0) {
            int kv_iter = 0, q_iter = 0;
            for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
                const Sm90Tile at(tile, m_blocks, p.nheads);
                const int head_kv = at.head / (p.nheads / p.nheads_kv);
                const int n_blocks = kv_blocks(tile);
                if (n_blocks == 0) continue;
                sm90_load_q<QTile>(q_smem, bar.q_full(), bar.q_empty(), q_iter, &p.tma_q, at.m_block * kBM, at.head,
                                   at.batch);
                ++q_iter;
                // the tile's K/V blocks from the last, into the ring
                sm90_fill_kv<KTile, VTile>(bar, kv_iter, n_blocks, [&](int j) { return (n_blocks - 1 - j) * kBN; },
                                           k_smem, v_smem, &p.tma_k, &p.tma_v, head_kv, at.batch);
            }
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<Shape::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int warp = (tid / 32) % 4, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    // Descriptors, all K-major with the 128-byte swizzle: this warpgroup's 64 rows of Q_i, slot
    // 0's K_j, and slot 0's Vᵀ_j (kHeadDim rows of 128 keys: wgmma's N x K).
    const u64 q_desc = smem_desc_sw128(q_smem + wg * 64 * 128, 16, 1024);
    const u64 k_desc = smem_desc_sw128(k_smem, 16, 1024);
    const u64 v_desc = smem_desc_sw128(v_smem, 16, 1024);
    const Pingpong<kPingpong, kConsumers> turn(wg);

    float o_acc[1][kHeadDim / 8][4];
    float m[1][2];
    float l[1][2];
    float (&o_flat)[kHeadDim / 2] = reinterpret_cast<float (&)[kHeadDim / 2]>(o_acc);
    float s_acc[1][kBN / 8][4];
    float (&s_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(s_acc);
    u32 p_frag[kBN / 32][4];                               // P_{j-1} as e4m3 A fragments (k32 steps)
    float alpha[1][2];

    // S_j = Q_i K_jᵀ: k32 steps of 32 bytes inside a 128-byte chunk, only the kHeadDim columns.
    auto issue_s = [&](int slot) {
        const u64 slot_off = u64(slot * Shape::kKBytes) >> 4;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) {
            const u64 q_off = u64((kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32) >> 4;
            const u64 k_off = u64((kk / 4) * Shape::kKChunkBytes + (kk % 4) * 32) >> 4;
            WgmmaE4m3<kBN>::ss(s_flat, q_desc + q_off, k_desc + slot_off + k_off, kk > 0);
        }
        wgmma_commit();
    };
    // O += P_{j-1} V_{j-1}: keys 32kk..32kk+31 are bytes 32kk.. of every Vᵀ row.
    auto issue_pv = [&](int slot) {
        const u64 slot_off = u64(slot * Shape::kVBytes) >> 4;
#pragma unroll
        for (int kk = 0; kk < kBN / 32; ++kk)
            WgmmaE4m3<kHeadDim>::rs(o_flat, p_frag[kk], v_desc + slot_off + (u64(kk * 32) >> 4), 1);
        wgmma_commit();
    };
    // P (fp32, S accumulator layout) -> e4m3 A fragments. k32 step kk covers the accumulator
    // column tiles 4kk..4kk+3; with Vᵀ's keys reordered (header), register r of the fragment is
    // row g (r even) or g + 8 (r odd) of tiles 4kk + 2·(r / 2) and 4kk + 2·(r / 2) + 1, in order.
    // P is packed as kPScale · P (header: e4m3's range); the epilogue divides it out.
    constexpr float kPScale = 256.f;
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < kBN / 32; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float (&a)[4] = s_acc[0][4 * kk + 2 * (r / 2)];
                const float (&b)[4] = s_acc[0][4 * kk + 2 * (r / 2) + 1];
                const int h = 2 * (r % 2);
                p_frag[kk][r] = pack4_e4m3(kPScale * a[h], kPScale * a[h + 1], kPScale * b[h],
                                           kPScale * b[h + 1]);
            }
    };

    int kv_iter = 0, q_iter = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const Sm90Tile at(tile, m_blocks, p.nheads);
        const int wg_row0 = at.m_block * kBM + wg * 64;
        const int warp_row0 = wg_row0 + warp * 16;
        const int n_blocks = kv_blocks(tile);
        // the tile's descales: one per (batch, kv head)
        const int dsc = at.batch * p.nheads_kv + at.head / (p.nheads / p.nheads_kv);
        const float qk_descale = p.q_descale[dsc] * p.k_descale[dsc];
        const float scale_log2 = p.scale_log2 * qk_descale;
#pragma unroll
        for (int nt = 0; nt < kHeadDim / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[0][nt][e] = 0.f;
        softmax_init(m, l);

        if (n_blocks > 0) {
            bool last_tile = true;
            for (int next = tile + gridDim.x; next < n_tiles && last_tile; next += gridDim.x)
                last_tile = kv_blocks(next) == 0;
            auto softmax_s = [&](int slot, int j) {
                const int n_block = n_blocks - 1 - j;
                reg_fence(s_flat);
                mbarrier_arrive(bar.k_empty(slot));
                if (j == n_blocks - 1) mbarrier_arrive(bar.q_empty());
                if (mask.template needs_mask<kBN>(wg_row0, n_block))
                    mask.apply(s_acc, warp_row0, n_block * kBN, g, t, neg_inf());
                softmax_step(s_acc, m, l, scale_log2, alpha);
            };
            if (q_iter == 0) turn.start();
            mbarrier_wait(bar.q_full(), q_iter & 1);
            // sm90_fwd's steps without its features
            sm90_consume_blocks<true, 0>(bar, turn, kv_iter, n_blocks, last_tile, s_flat, o_flat, issue_s, issue_pv,
                                         softmax_s, [&](int) { pack_p(); }, [&]() { softmax_rescale(o_acc, alpha); },
                                         Sm90Skip{}, Sm90Skip{}, Sm90Skip{}, Sm90Skip{});
            kv_iter += n_blocks;
            ++q_iter;
        }

        // ---- epilogue: O = acc · dv / (256 · l), LSE = m · scale · dq · dk + log l ----
        const float v_descale = p.v_descale[dsc] * (1.f / kPScale);
        sm90_store_o_lse<Out, kHeadDim, false>(p, at, seq_span<false>(p, at.batch), o_acc, m, l,
                                               [&](int, float l_row) { return softmax_inv_l(l_row) * v_descale; },
                                               [&]() { return p.softmax_scale * qk_descale; }, warp_row0, g, t);
    }
}

// ---- the prepare kernel: Vᵀ and the descales, in the launch's workspace ----
//
// Vᵀ[b][h][col][16 grp + pos] = V[b][16 grp + PERM16[pos]][h][col] for keys < seqlen_k, 0 for
// the padding keys up to vt_keys (seqlen_k rounded up to 16); PERM16[4 i + j] = {2i, 2i + 1,
// 8 + 2i, 9 + 2i}[j] (the header's P fragment order).
// One CTA: kKeys keys x kCols columns. Load: 16-byte rows pieces of V (coalesced along the
// head dim, the caller's strides) into shared memory, key-major. Store: each thread builds the
// 16-byte pieces of 4 Vᵀ rows (4 consecutive columns) for one group of 16 keys from 16 shared
// words (one per key, PERM16 order) with byte permutes; the 8 groups of a warp's lanes write
// 128 contiguous bytes of each row (coalesced).
// Shared layout: word (key / 16) · kGroupWords + (key % 16) · kRowWords + w, with 4 words of
// padding after every 16 keys: in the store phase a warp reads, per step, the same key of 8
// groups x 4 consecutive words, which lands in 32 distinct banks (kGroupWords = 4 mod 32).
template <int kKeys, int kCols>
__global__ void __launch_bounds__(128)
sm90_fwd_fp8_prepare(const __grid_constant__ Sm90FwdFp8Params p) {
    constexpr int kThreads = 128;
    constexpr int kRowWords = kCols / 4;
    constexpr int kGroupWords = 16 * kRowWords + 4;
    constexpr int kGroups = kKeys / 16;
    constexpr int kPieces = kCols / 16;                     // 16-byte pieces per V row of the tile
    static_assert(kKeys == 128 && kCols == 64, "the thread mapping below assumes 128 keys x 64 columns");
    static_assert(kGroups * (kCols / 4) == kThreads, "one thread per (key group, 4 columns)");
    static_assert(kGroupWords % 32 == 4, "the padding that makes the store phase conflict-free");
    __shared__ __align__(16) u32 tile[kGroups * kGroupWords];

    const int tid = threadIdx.x;
    const int key_tiles = (p.vt_keys + kKeys - 1) / kKeys;
    const int col_tiles = (p.head_dim + kCols - 1) / kCols;
    int cta = blockIdx.x;
    const int key0 = (cta % key_tiles) * kKeys;
    cta /= key_tiles;
    const int col0 = (cta % col_tiles) * kCols;
    const int bh = cta / col_tiles;                          // batch * nheads_kv + kv head
    const int b = bh / p.nheads_kv, h = bh % p.nheads_kv;

    // the descales, (batch, nheads_kv) fp32 each: the caller's (per tensor or per (batch, kv
    // head), by descale_per_head bit 0 / 1 / 2), or 1 where none was given (null pointer)
    if (blockIdx.x == 0) {
        const int n = p.batch * p.nheads_kv;
        for (int i = tid; i < n; i += kThreads) {
            p.q_descale[i] = p.q_descale_in ? p.q_descale_in[(p.descale_per_head & 1) ? i : 0] : 1.f;
            p.k_descale[i] = p.k_descale_in ? p.k_descale_in[(p.descale_per_head & 2) ? i : 0] : 1.f;
            p.v_descale[i] = p.v_descale_in ? p.v_descale_in[(p.descale_per_head & 4) ? i : 0] : 1.f;
        }
    }

    // ---- load: V[b, key0 .. +kKeys, h, col0 .. +kCols] -> tile (zeros past seqlen_k) ----
    const unsigned char* v = static_cast<const unsigned char*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
    // 16-byte loads need 16-byte aligned pieces: contiguous columns, aligned address and strides
    const bool vec = p.v_col_stride == 1 &&
                     ((reinterpret_cast<unsigned long long>(p.v) | static_cast<unsigned long long>(
                         p.v_batch_stride | p.v_row_stride | p.v_head_stride)) & 15) == 0;
#pragma unroll
    for (int it = tid; it < kKeys * kPieces; it += kThreads) {
        const int key = it / kPieces, piece = it % kPieces;
        const int col = col0 + 16 * piece;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (key0 + key < p.seqlen_k && col < p.head_dim) {
            const unsigned char* src = v + static_cast<i64>(key0 + key) * p.v_row_stride;
            if (vec) {
                x = *reinterpret_cast<const uint4*>(src + col);
            } else {
                u32 w[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    w[q] = 0u;
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        w[q] |= u32(src[(col + 4 * q + j) * p.v_col_stride]) << (8 * j);
                }
                x = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
        *reinterpret_cast<uint4*>(&tile[(key / 16) * kGroupWords + (key % 16) * kRowWords + 4 * piece]) = x;
    }
    __syncthreads();

    // ---- store: thread (w, grp) writes Vᵀ rows col0 + 4w .. +3, keys key0 + 16 grp .. +15 ----
    const int grp = tid % kGroups, w = tid / kGroups;
    const int col = col0 + 4 * w, key = key0 + 16 * grp;
    if (col >= p.head_dim || key >= p.vt_keys) return;      // head_dim and vt_keys: multiples of 16 and 4
    const u32* g = &tile[grp * kGroupWords + w];
    uint4 out[4];                                            // out[j]: Vᵀ row col + j
    u32* o32 = reinterpret_cast<u32*>(out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {                            // PERM16 positions 4i .. 4i + 3
        const u32 a = g[(2 * i) * kRowWords], bb = g[(2 * i + 1) * kRowWords];
        const u32 c = g[(8 + 2 * i) * kRowWords], d = g[(9 + 2 * i) * kRowWords];
        const u32 ab_lo = __byte_perm(a, bb, 0x5140), ab_hi = __byte_perm(a, bb, 0x7362);  // a0 b0 a1 b1 | a2 b2 a3 b3
        const u32 cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
        o32[0 * 4 + i] = __byte_perm(ab_lo, cd_lo, 0x5410);  // column byte 0 of keys a, b, c, d
        o32[1 * 4 + i] = __byte_perm(ab_lo, cd_lo, 0x7632);
        o32[2 * 4 + i] = __byte_perm(ab_hi, cd_hi, 0x5410);
        o32[3 * 4 + i] = __byte_perm(ab_hi, cd_hi, 0x7632);
    }
    unsigned char* vt = static_cast<unsigned char*>(p.vt) +
                        (static_cast<i64>(bh) * p.head_dim + col) * p.vt_keys + key;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4*>(vt + static_cast<i64>(j) * p.vt_keys) = out[j];
}

}  // namespace cuflash
