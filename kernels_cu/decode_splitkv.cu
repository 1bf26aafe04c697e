// decode_splitkv.cu: flash-decoding for flash_attn_with_kvcache (sm_80 and newer): a few query
// rows attend to a long KV cache, which is read once, as fast as memory allows.
//
//   O = softmax(Q Kᵀ · scale [softcap, ALiBi, causal / window mask]) V,  LSE = log Σ_j exp(S_ij)
//
// Three kernels, launched in this order on one stream (cuflash/families/decode_splitkv.py):
//   decode_append   (only when k, v are given) writes the new keys and values into the cache at
//                   cache_seqlens[b] (k rotated when rotary is on) and the rotated q into q_rot.
//   decode_splitkv  one CTA per (split, KV head · row block, batch). The query heads that share
//                   a KV head are packed as the rows of one Q tile (GQA packing: row r of the
//                   group·seqlen_q packed rows is query i = r / group of head hkv·group + r % group),
//                   so each K/V byte is read by one CTA only. The CTA's share of the row's keys
//                   (a split) streams through a kStages-deep cp.async ring of K/V blocks of kBlockN
//                   keys; each warp takes kWarpN keys of every block (S = Q K_wᵀ and O += P V_w on
//                   mma.sync m16n8k16, its own online softmax), and the warps merge their (m, l, O)
//                   through shared memory at the end. With one split it writes O and LSE; with
//                   more it writes fp32 O / l and LSE of its split into the workspace; with the
//                   fused combine (kFusedCombine) the last CTA of the (batch, KV head, row block)
//                   to finish then merges the group's splits as decode_combine does.
//   decode_splitkv_tma  (sm_90, the config's tma) decode_splitkv's work with a producer warp that
//                   streams the K/V blocks by TMA into a ring of full / empty mbarriers, so the
//                   other warps only compute and every ring slot can be in flight (see its comment).
//   decode_combine  (num_splits > 1, no fused combine) flash-decoding's LSE merge: per row, the
//                   splits' partial outputs weighted by exp(lse_s - lse), and the row's LSE (the regs
//                   kernel's early_merge: its first partial-O loads before the LSE loads).
//
// Keys: row b's cache holds logical keys j = 0 .. keys_b - 1 at cache positions start_b + j, with
// start_b = cache_leftpad[b] (0), keys_b = cache_seqlens[b] + seqlen_new - start_b; masks are
// bottom-right aligned per row (query i's diagonal key is i + keys_b - seqlen_q). Paged caches
// map position pos to page block_table[b][pos / page_size], row pos % page_size: the address is
// computed per key row, so any page size works (a multiple of 16 keeps a 16-key mma tile in one
// page when leftpad is 0, which the host requires for nothing). Values read on the device
// (lengths, block ids, cache rows) are clamped into range: a bad value gives a wrong answer,
// never an out-of-bounds read.
//
// Layouts: DecodeParams in params_decode.cuh. Shared-memory rows are padded by 8 elements so
// the 8 row addresses of an ldmatrix fall into different banks.
//
// Template parameters (cuflash/families/decode_splitkv.py DecodeConfig mirrors and validates them):
//   kWarps    warps per CTA (2, 4, 8); the CTA's K/V block is kBlockN = kWarps · kWarpN keys
//   kWarpN    keys per warp per block: a multiple of 16 (16, 32)
//   kStages   K/V blocks in flight in shared memory, >= 2
//   kMTiles   16-row mma tiles of packed query rows per CTA (1, 2): group · seqlen_q rows need
//             ceil(rows / (16 · kMTiles)) row blocks, each reading the K/V again
//   kHeadDim  compile-time head dim, a multiple of 16 <= 256 (the real one may be smaller)
//   Elem      bf16 or fp16; accumulation in fp32
//   kFusedCombine  (num_splits > 1) no decode_combine launch: the last CTA of each (batch, KV head,
//             row block) to finish, found by an atomic count in p.split_counters, merges the
//             group's splits itself and resets the count to 0 (false: the plain kernel)
//   kPagePrefetch  paged caches: the page ids of a K/V block's rows are read from block_table one
//             block ahead, into registers, so the block's cp.asyncs wait on no table read (false:
//             a table read per key row, before its cp.async)
//   kL2Prefetch  0, 64, 128 or 256: the whole K/V blocks' cp.asyncs carry an L2 prefetch-size hint
//             of that many bytes (a key row of d 128 in bf16 is 256 bytes): on a miss the L2 asks
//             the DRAM for the whole aligned segment at once (0: no hint, the plain kernel)
//   kPageGather  paged caches: each thread reads the page ids of all its rows of a K/V block from
//             block_table first, then issues the block's cp.asyncs (false: a table read per key
//             row, right before its cp.async); with kPagePrefetch, the prefetch wins
//   kWarpLoads  each warp loads the kWarpN key rows of K and V that it alone reads, so the ring
//             needs no CTA barrier per block: a warp waits for its own cp.async groups and its
//             own lanes (__syncwarp), and the warps stream independently (false: the CTA loads
//             every block together, one __syncthreads per block)
//   kLean     each warp keeps Q's mma fragments in registers (read from shared memory once, not
//             per block) and rescales O only when a row's running max grew in the block (false:
//             the plain loop)
//   kBulk     (sm_90) 0: K/V rows by 16-byte cp.asyncs; 1: each whole key row of a whole K/V block
//             by one cp.async.bulk (the copy engine: one request per 256-byte row at d 128, not 16
//             per thread), completing on the ring slot's mbarrier (kStages of them after the
//             ring); 2: as 1 with an L2 evict-first policy on those copies. A block with rows
//             past the row's end (or a head dim below kHeadDim) still takes the zero-filling
//             cp.asyncs; its slot's barrier then gets a plain arrival, so every slot's phase
//             flips once per block either way
//   kEarlyMerge  (kFusedCombine) the merging CTA issues its first batch of partial-O loads before
//             the splits' LSE loads, overlapping the two L2 round trips (combine_row's kEarly)
//   kRingFill  when the cp.async loop's ring slots are filled. 0: the prologue loads kStages - 1
//             blocks; iteration i loads block i + kStages - 1 into the slot iteration i - 1 read
//             (at i = 0 the ring's last slot, still empty), between P's packing and O += P V.
//             So the last slot's block is requested only after block 0 arrived. 1: the prologue
//             fills every slot (the first kStages blocks all requested at the kernel's start);
//             iteration 0 loads nothing, iteration i >= 1 the same block as with 0 at the same
//             place. 2: as 1, with each iteration's load issued right after its barrier, before S
//             (the slot is free from there on). A split of few blocks (1 x 8k: 4 per CTA) has
//             3 of them requested at once, not 2
//   kDynamic  (kRingFill >= 1; no kBulk, kPagePrefetch or kWarpLoads) 0: a split's K/V blocks are
//             one run of the row's blocks (the row's blocks in num_splits equal runs). 1 (with
//             kFusedCombine): the splits of a (batch, KV head, row block) group share its blocks
//             dynamically: split s's prologue takes the group's blocks s, s + num_splits, ...
//             (counted from the top), and each later block is claimed, one at a time, from the
//             group's claim counter (an atomic add by thread 0, one iteration before its load,
//             into a smem ring of 2·kStages block ids read after a barrier); a CTA stops at its
//             first claim past the group's blocks. A CTA that streams faster takes more blocks,
//             so the group's CTAs end together (a static split ends with its slowest CTA). The
//             last CTA of the group (the fused combine's count) sets the claim counter back to 0
//             (split_counters' second half). A group of fewer than kClaimMinBlocks blocks per
//             split (the row's keys, known on the device only) takes the equal runs of 0 instead,
//             through the same ring of ids. 2: the same interleaved order without claims: split
//             s takes the group's blocks s, s + num_splits, s + 2·num_splits, ... (the splits
//             sweep the row's keys side by side, as the claims do, each with a fixed share)
//   kLightFence  (kFusedCombine) the count of finished splits without a fence per thread: the CTA's
//             barrier, then thread 0's acq_rel atomic (release cumulativity over the barrier, as
//             CUTLASS's stream-K semaphore), and on the merging CTA thread 0's acquire then the
//             barrier (false: __threadfence by every thread on both sides)
#include "ptx.cuh"
#include "ptx_decode.cuh"
#include "params_decode.cuh"
#include "tile.cuh"
#include "gemm.cuh"
#include "softmax.cuh"

namespace cuflash {

struct alignas(8) u32x2 { u32 x, y; };
struct alignas(16) f32x4 { float x, y, z, w; };  // no vector_types.h: cuflash includes no system header

template <class Elem>
__device__ __forceinline__ u16 to_elem(float x) { return static_cast<u16>(pack2<Elem>(x, 0.f) & 0xffffu); }

template <int kWarps, int kWarpN, int kStages, int kMTiles, int kHeadDim>
struct DecodeShape {
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kBlockN = kWarps * kWarpN;      // keys per K/V block (the ring's unit)
    static constexpr int kRows = 16 * kMTiles;           // packed query rows per CTA
    static constexpr int kNTilesS = kWarpN / 8;          // 8-key tiles of a warp's S
    static constexpr int kNTilesO = kHeadDim / 8;        // 8-column tiles of O
    static constexpr int kPitch = kHeadDim + 8;          // shared-memory row pitch, elements
    static constexpr int kQTile = kRows * kPitch;        // elements
    static constexpr int kKVTile = kBlockN * kPitch;     // elements of one K (or V) block
    static constexpr int kSmemRing = 2 * kStages * kKVTile * 2;                 // bytes
    // The warps' merge (O, m, l per warp) overlays the ring. Its fp32 O rows are padded by 8 words
    // where the ring has room: then the rows g = 0..3 of a warp's 64-bit fragment stores start in
    // banks 8 apart and the stores are conflict-free (unpadded, every row starts in bank 0).
    static constexpr int kMergePitch =
        kWarps * kRows * (kHeadDim + 8 + 2) * 4 <= kSmemRing ? kHeadDim + 8 : kHeadDim;  // words
    static constexpr int kSmemMerge = kWarps * kRows * (kMergePitch + 2) * 4;
    static constexpr int kSmemBytes = kQTile * 2 + kSmemRing;

    static_assert(kWarps >= 1 && kWarps <= 16, "warps must be in 1..16");
    static_assert(kWarpN % 16 == 0 && kWarpN > 0, "keys per warp must be a multiple of 16 (P is a k16 A operand)");
    static_assert(kMTiles >= 1 && kMTiles <= 2, "1 or 2 row tiles of 16 packed query rows");
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "kHeadDim must be a multiple of 16, at most 256");
    static_assert(kStages >= 2, "stages must be >= 2: one K/V block computed while the next loads");
    static_assert(kSmemMerge <= kSmemRing, "the warps' merge area overlays the K/V ring");
};

// Where a row's lengths come from: device arrays (may be null), clamped so that no later
// address leaves the cache: 0 <= start <= end <= capacity - seqlen_new.
struct RowKeys {
    int start, end, keys;  // keys = end + seqlen_new - start
    __device__ __forceinline__ RowKeys(const DecodeParams& p, int b) {
        end = p.cache_seqlens ? p.cache_seqlens[b] : p.cache_seqlen_fixed;
        end = min(max(end, 0), p.capacity - p.seqlen_new);
        start = p.cache_leftpad ? min(max(p.cache_leftpad[b], 0), end) : 0;
        keys = end + p.seqlen_new - start;
    }
    // the same, its reads kept after the loads issued before it in program order (ld_ordered_s32)
    __device__ __forceinline__ RowKeys(const DecodeParams& p, int b, bool /*ordered*/) {
        end = p.cache_seqlens ? ld_ordered_s32(p.cache_seqlens + b) : p.cache_seqlen_fixed;
        end = min(max(end, 0), p.capacity - p.seqlen_new);
        start = p.cache_leftpad ? min(max(ld_ordered_s32(p.cache_leftpad + b), 0), end) : 0;
        keys = end + p.seqlen_new - start;
    }
};

// Element offsets of cache position `pos` of batch row b in k_cache and v_cache (head 0).
// Paged: the page id from block_table, clamped to the cache's pages; else the cache row
// cache_batch_idx[b] (default b), clamped to the cache's rows.
__device__ __forceinline__ void cache_offsets(const DecodeParams& p, int b, int pos, i64& k_off, i64& v_off) {
    if (p.block_table) {
        int page = p.block_table[b * p.block_table_stride + pos / p.page_size];
        page = min(max(page, 0), p.num_pages - 1);
        const int row = pos % p.page_size;
        k_off = page * p.k_batch_stride + row * p.k_row_stride;
        v_off = page * p.v_batch_stride + row * p.v_row_stride;
    } else {
        int row_b = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
        row_b = min(max(row_b, 0), p.num_pages - 1);
        k_off = row_b * p.k_batch_stride + static_cast<i64>(pos) * p.k_row_stride;
        v_off = row_b * p.v_batch_stride + static_cast<i64>(pos) * p.v_row_stride;
    }
}

// ---- decode_append: k, v into the cache (k rotated), q rotated into q_rot ----------------------
// grid (CTAs, batch), 128 threads; the CTAs stride over the tokens. Token t of row b goes to cache
// position end_b + t; query i rotates at position end_b + i (causal / local) or end_b.
// Rotary pairs: interleaved (2c, 2c + 1), else (c, c + rotary_dim / 2), frequency c; columns
// from rotary_dim on pass through. Rotation in fp32, rounded once to Elem.
template <class Elem>
__device__ __forceinline__ void rotate_row(u16* dst, const u16* src, const u16* cos_row, const u16* sin_row,
                                           int head_dim, int rotary_dim, bool interleaved, int tid, int threads) {
    const int half = rotary_dim / 2;
    for (int c = tid; c < half + head_dim - rotary_dim; c += threads) {
        if (c < half) {
            const int i0 = interleaved ? 2 * c : c, i1 = interleaved ? 2 * c + 1 : c + half;
            const float a = to_float<Elem>(src[i0]), b = to_float<Elem>(src[i1]);
            const float cs = to_float<Elem>(cos_row[c]), sn = to_float<Elem>(sin_row[c]);
            dst[i0] = to_elem<Elem>(a * cs - b * sn);
            dst[i1] = to_elem<Elem>(a * sn + b * cs);
        } else {
            const int i = rotary_dim + (c - half);
            dst[i] = src[i];
        }
    }
}

//   kPdl  (sm_90) launched as a programmatic dependent of the stream's previous kernel: waits for it
//         before any read or write (grid_dependency_wait), then lets the main kernel be scheduled
template <int kHeadDim, class Elem, bool kPdl = false>
__global__ void __launch_bounds__(128)
decode_append(const DecodeParams p) {
    if constexpr (kPdl) {
        grid_dependency_wait();   // the previous kernel may still read the cache rows this one writes
        launch_dependents();
    }
    const int b = blockIdx.y, tid = threadIdx.x;
    const RowKeys rk(p, b);
    const int tokens = max(p.seqlen_new, p.rotary_dim ? p.seqlen_q : 0);
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const u16* cos_base = static_cast<const u16*>(p.rotary_cos);
        const u16* sin_base = static_cast<const u16*>(p.rotary_sin);
        if (t < p.seqlen_new) {
            const int pos = rk.end + t;
            i64 k_off, v_off;
            cache_offsets(p, b, pos, k_off, v_off);
            const u16* kn = static_cast<const u16*>(p.k_new) + b * p.kn_batch_stride + t * p.kn_row_stride;
            const u16* vn = static_cast<const u16*>(p.v_new) + b * p.vn_batch_stride + t * p.vn_row_stride;
            u16* kc = static_cast<u16*>(p.k_cache) + k_off;
            u16* vc = static_cast<u16*>(p.v_cache) + v_off;
            for (int h = 0; h < p.nheads_kv; ++h) {
                if (p.rotary_dim)
                    rotate_row<Elem>(kc + h * p.k_head_stride, kn + h * p.kn_head_stride,
                                     cos_base + pos * p.rotary_row_stride, sin_base + pos * p.rotary_row_stride,
                                     p.head_dim, p.rotary_dim, p.rotary_interleaved, tid, 128);
                else
                    for (int c = tid; c < p.head_dim; c += 128) kc[h * p.k_head_stride + c] = kn[h * p.kn_head_stride + c];
                for (int c = tid; c < p.head_dim; c += 128) vc[h * p.v_head_stride + c] = vn[h * p.vn_head_stride + c];
            }
        }
        if (p.rotary_dim && t < p.seqlen_q) {
            const int pos = min(rk.end + (p.rotary_q_per_row ? t : 0), p.capacity - 1);  // cos / sin hold capacity rows
            const u16* q = static_cast<const u16*>(p.q) + b * p.q_batch_stride + t * p.q_row_stride;
            u16* qr = static_cast<u16*>(p.q_rot) + (static_cast<i64>(b) * p.seqlen_q + t) * p.nheads * p.head_dim;
            for (int h = 0; h < p.nheads; ++h)
                rotate_row<Elem>(qr + h * p.head_dim, q + h * p.q_head_stride, cos_base + pos * p.rotary_row_stride,
                                 sin_base + pos * p.rotary_row_stride, p.head_dim, p.rotary_dim,
                                 p.rotary_interleaved, tid, 128);
        }
    }
}

// ---- the LSE merge of one row's splits (flash-decoding), by one warp -------------------------
// Row R = (b·nheads + h)·seqlen_q + i:  lse = log Σ_s exp(lse_s),  O = Σ_s exp(lse_s - lse) · O_s.
// Splits without keys have lse_s = -inf and are skipped (their O_s is never read, nor written).
// A row without any key gets O = 0 and LSE = +inf, flash-attn's convention. kL2Only: the
// partials were written by other CTAs of the running kernel (fused combine): read them from L2.
template <bool kL2Only>
__device__ __forceinline__ float load_partial(const float* addr) {
    if constexpr (kL2Only) return ld_cg_f32(addr);
    else return *addr;
}
template <bool kL2Only>
__device__ __forceinline__ f32x4 load_partial4(const float* addr) {
    if constexpr (kL2Only) {
        float v[4];
        ld_cg_f32x4(v, addr);
        return f32x4{v[0], v[1], v[2], v[3]};
    } else {
        return *reinterpret_cast<const f32x4*>(addr);
    }
}

// Latency, not bandwidth, bounds a row's merge (a few KB): lane l loads lse_s of the splits
// s = l + 32·k (k < 4: num_splits <= 128) once, in parallel, and keeps its weights in registers.
// The O_s loads then go in batches of kLoadBatch splits: every load of a batch is issued before
// the first is used (one L2 round trip per batch, not per split: H100, 1 x 8k, 16 splits, the
// combine took 6.3 us when each split's load waited for the previous one's sum). A split whose
// weight is 0 (no keys, its O_s never written) is not loaded; the predicate is warp-uniform.
// kEarly: the first batch of O_s loads (the first 16 splits of the first column pass) is issued
// before the LSE loads (they depend on the split count only, not on the weights), so the two
// L2 round trips overlap (false: the LSE first, then the O_s batches).
// combine_pieces merges n_pieces partials of one row: piece s's LSE at lse_at(s), its O at o_at(s)
// (a float pointer to the row's head_dim_rounded values); kPerLane · 32 pieces at most. combine_row
// below is the same merge over the splits of decode_splitkv's workspace (split s of row R at s · rows + R),
// kept as its own copy: written as a call of this one, ptxas schedules the default decode kernels
// differently (session 21, cuobjdump sm_90a), and those kernels are the measured ones. Only the stream-K
// kernel (off by default) calls combine_pieces; fold the two together when the defaults are re-timed.
template <int kHeadDim, class Elem, bool kL2Only, bool kEarly = false, int kPerLane = 4, class LseAt, class OAt>
__device__ __forceinline__ void combine_pieces(const DecodeParams& p, int row_id, int lane, int n_pieces,
                                               LseAt&& lse_at, OAt&& o_at) {
    constexpr int kLoadBatch = 16;  // O_s loads in flight per lane
    constexpr int kQuads = kHeadDim / 4;
    const int qi = row_id % p.seqlen_q, h = (row_id / p.seqlen_q) % p.nheads, b = row_id / (p.seqlen_q * p.nheads);
    f32x4 x_early[kEarly ? kLoadBatch : 1];
    if constexpr (kEarly) {
        const int col = lane * 4;
        const bool mine = lane < kQuads && col < p.head_dim;
#pragma unroll
        for (int i = 0; i < kLoadBatch; ++i)
            x_early[i] = i < n_pieces && mine ? load_partial4<kL2Only>(o_at(i) + col) : f32x4{0.f, 0.f, 0.f, 0.f};
        __threadfence_block();  // keeps ptxas from sinking them below the LSE loads
    }
    float lse_lane[kPerLane];
    float lse_max = neg_inf();
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        const int s = lane + 32 * k;
        lse_lane[k] = s < n_pieces ? load_partial<kL2Only>(lse_at(s)) : neg_inf();
        lse_max = fmaxf(lse_max, lse_lane[k]);
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, d));
    float sum = 0.f;
    if (lse_max != neg_inf())
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) sum += expf(lse_lane[k] - lse_max);  // exp(-inf) = 0
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    const float lse = sum > 0.f ? lse_max + logf(sum) : pos_inf();
    if (lane == 0 && p.lse != nullptr) p.lse[row_id] = lse;  // nullptr: the caller wants no LSE
    float wt_lane[kPerLane];  // exp(lse_s - lse): 0 for a split without keys, and for all when none has
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) wt_lane[k] = sum > 0.f ? expf(lse_lane[k] - lse) : 0.f;

    u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride;
    // Columns: 4 per lane per pass. Every lane runs every pass, so the weight shuffles below
    // always have the whole warp (head dims under 128 leave lanes without columns: they shuffle,
    // and neither load nor store).
#pragma unroll
    for (int q0 = 0; q0 < kQuads; q0 += 32) {
        const int col = (q0 + lane) * 4;
        const bool mine = q0 + lane < kQuads && col < p.head_dim;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            if (32 * k >= n_pieces) break;
            const int n = min(32, n_pieces - 32 * k);
            for (int i0 = 0; i0 < n; i0 += kLoadBatch) {
                float wt[kLoadBatch];
                f32x4 x[kLoadBatch];
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i)  // the batch's weights (0 past the splits)
                    wt[i] = i0 + i < n ? __shfl_sync(0xffffffffu, wt_lane[k], (i0 + i) & 31) : 0.f;
                // the batch's loads, back to back: predicated on the split's existence only (not
                // on its weight, which would tie each load to its shuffle); a split without keys
                // loads its unwritten partial, which the weight 0 then discards by a select
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i)
                    x[i] = kEarly && q0 == 0 && k == 0 && i0 == 0 ? x_early[kEarly ? i : 0]   // loaded already
                         : i0 + i < n && mine ? load_partial4<kL2Only>(o_at(32 * k + i0 + i) + col)
                                              : f32x4{0.f, 0.f, 0.f, 0.f};
                // ptxas sinks each load to just before its use (2-3 in flight); no load moves below
                // a fence, so all of the batch's are issued before the first is waited for
                __threadfence_block();
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i) {  // then their sum
                    if (wt[i] == 0.f) continue;
                    acc[0] += wt[i] * x[i].x; acc[1] += wt[i] * x[i].y;
                    acc[2] += wt[i] * x[i].z; acc[3] += wt[i] * x[i].w;
                }
            }
        }
        if (mine)
            *reinterpret_cast<u32x2*>(o + col) = u32x2{pack2<Elem>(acc[0], acc[1]), pack2<Elem>(acc[2], acc[3])};
    }
}


template <int kHeadDim, class Elem, bool kL2Only, bool kEarly = false>
__device__ __forceinline__ void combine_row(const DecodeParams& p, int row_id, int lane) {
    constexpr int kPerLane = 4;     // 128 splits at most (DecodeConfig / flash-attn's limit)
    constexpr int kLoadBatch = 16;  // O_s loads in flight per lane
    constexpr int kQuads = kHeadDim / 4;
    const int rows_all = p.batch * p.nheads * p.seqlen_q;
    const int qi = row_id % p.seqlen_q, h = (row_id / p.seqlen_q) % p.nheads, b = row_id / (p.seqlen_q * p.nheads);
    const float* o_s = p.o_partial + static_cast<i64>(row_id) * p.head_dim_rounded;
    const i64 split_stride = static_cast<i64>(rows_all) * p.head_dim_rounded;
    f32x4 x_early[kEarly ? kLoadBatch : 1];
    if constexpr (kEarly) {
        const int col = lane * 4;
        const bool mine = lane < kQuads && col < p.head_dim;
#pragma unroll
        for (int i = 0; i < kLoadBatch; ++i)
            x_early[i] = i < p.num_splits && mine ? load_partial4<kL2Only>(o_s + i * split_stride + col)
                                                  : f32x4{0.f, 0.f, 0.f, 0.f};
        __threadfence_block();  // keeps ptxas from sinking them below the LSE loads
    }
    const float* lse_s = p.lse_partial + row_id;
    float lse_lane[kPerLane];
    float lse_max = neg_inf();
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        const int s = lane + 32 * k;
        lse_lane[k] = s < p.num_splits ? load_partial<kL2Only>(lse_s + static_cast<i64>(s) * rows_all) : neg_inf();
        lse_max = fmaxf(lse_max, lse_lane[k]);
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, d));
    float sum = 0.f;
    if (lse_max != neg_inf())
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) sum += expf(lse_lane[k] - lse_max);  // exp(-inf) = 0
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    const float lse = sum > 0.f ? lse_max + logf(sum) : pos_inf();
    if (lane == 0 && p.lse != nullptr) p.lse[row_id] = lse;  // nullptr: the caller wants no LSE
    float wt_lane[kPerLane];  // exp(lse_s - lse): 0 for a split without keys, and for all when none has
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) wt_lane[k] = sum > 0.f ? expf(lse_lane[k] - lse) : 0.f;

    u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride;
    // Columns: 4 per lane per pass. Every lane runs every pass, so the weight shuffles below
    // always have the whole warp (head dims under 128 leave lanes without columns: they shuffle,
    // and neither load nor store).
#pragma unroll
    for (int q0 = 0; q0 < kQuads; q0 += 32) {
        const int col = (q0 + lane) * 4;
        const bool mine = q0 + lane < kQuads && col < p.head_dim;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            if (32 * k >= p.num_splits) break;
            const int n = min(32, p.num_splits - 32 * k);
            for (int i0 = 0; i0 < n; i0 += kLoadBatch) {
                float wt[kLoadBatch];
                f32x4 x[kLoadBatch];
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i)  // the batch's weights (0 past the splits)
                    wt[i] = i0 + i < n ? __shfl_sync(0xffffffffu, wt_lane[k], (i0 + i) & 31) : 0.f;
                // the batch's loads, back to back: predicated on the split's existence only (not
                // on its weight, which would tie each load to its shuffle); a split without keys
                // loads its unwritten partial, which the weight 0 then discards by a select
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i)
                    x[i] = kEarly && q0 == 0 && k == 0 && i0 == 0 ? x_early[kEarly ? i : 0]   // loaded already
                         : i0 + i < n && mine ? load_partial4<kL2Only>(o_s + (32 * k + i0 + i) * split_stride + col)
                                              : f32x4{0.f, 0.f, 0.f, 0.f};
                // ptxas sinks each load to just before its use (2-3 in flight); no load moves below
                // a fence, so all of the batch's are issued before the first is waited for
                __threadfence_block();
#pragma unroll
                for (int i = 0; i < kLoadBatch; ++i) {  // then their sum
                    if (wt[i] == 0.f) continue;
                    acc[0] += wt[i] * x[i].x; acc[1] += wt[i] * x[i].y;
                    acc[2] += wt[i] * x[i].z; acc[3] += wt[i] * x[i].w;
                }
            }
        }
        if (mine)
            *reinterpret_cast<u32x2*>(o + col) = u32x2{pack2<Elem>(acc[0], acc[1]), pack2<Elem>(acc[2], acc[3])};
    }
}

// ---- the consumer side shared by both loops (cp.async and Hopper) -----------------------------
// A thread's packed query rows: index [mt][half] is packed row 16·mt + g + 8·half of the CTA; its
// visible key range [row_lo, row_hi) and ALiBi slope (scaled into the raw-score units).
template <int kMTiles>
struct DecodeRows {
    int row_lo[kMTiles][2], row_hi[kMTiles][2];
    float row_slope[kMTiles][2];
    float inv_scale;        // 1 / softmax_scale: softcap and ALiBi work in raw-score units
    bool scores_transform;  // softcap or ALiBi on
    __device__ __forceinline__ DecodeRows(const DecodeParams& p, int b, int hkv, int r0, int g, int keys, int offset) {
        inv_scale = 1.f / p.softmax_scale;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int pr = r0 + mt * 16 + g + 8 * half, qi = pr / p.group;
                row_lo[mt][half] = p.window_left >= 0 ? qi + offset - p.window_left : 0;
                row_hi[mt][half] = p.window_right >= 0 ? min(keys, qi + offset + p.window_right + 1) : keys;
                const int h = min(hkv * p.group + pr % p.group, p.nheads - 1);
                row_slope[mt][half] = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] * inv_scale : 0.f;
            }
        scores_transform = p.softcap > 0.f || p.alibi_slopes != nullptr;
    }
};

// One warp's share of one K/V block: S = Q K_wᵀ (kRows x kWarpN), softcap / ALiBi, the mask (only
// on edge blocks: the ragged end, causal / window edges), the online softmax and O += P V_w.
// q_lane, k_lane, v_lane: the ldmatrix lane addresses of Q and of this warp's rows of the slot's K
// and V; block0: the block's first key (the warp's is block0 + warp·kWarpN); edge: the block needs
// the element-wise mask; before_pv() runs between P's packing and O += P V (the cp.async loop
// issues its prefetch there, so the copies overlap the last MMAs). Both loops run this one body
// (kernels compiled from it differ from the two copies it replaced by instruction scheduling
// only: same registers, same instructions ±1%). kLean (the cp.async loop's option): Q's
// fragments come from registers (q_frag, read once per CTA; else Q is re-read from shared memory
// per block, q_lane) and O is rescaled only when some row's running max grew in this block
// (a warp vote; the max settles after a few blocks, and alpha is exp2(0) = 1 otherwise).
template <int kMTiles, int kWarpN, int kHeadDim, int kRowBytes, class Elem, bool kLean = false, class QFrag = int,
          class BeforePV>
__device__ __forceinline__ void attend_block(const DecodeParams& p, const DecodeRows<kMTiles>& rows, int r0,
                                             int g, int t, int offset, int block0, int warp, bool edge, u32 q_lane, u32 k_lane,
                                             u32 v_lane, float (&o_acc)[kMTiles][kHeadDim / 8][4],
                                             float (&m)[kMTiles][2], float (&l)[kMTiles][2], BeforePV&& before_pv,
                                             const QFrag& q_frag = 0) {
    constexpr int kNTilesS = kWarpN / 8, kNTilesO = kHeadDim / 8;
    // ---- S = Q K_wᵀ (kRows x kWarpN per warp) ----
    float s_acc[kMTiles][kNTilesS][4];
    if constexpr (kLean)
        gemm_frags_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(s_acc, q_frag, k_lane);
    else
        gemm_rows_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(s_acc, q_lane, k_lane);

    const int key0 = block0 + warp * kWarpN;  // this warp's first key

    // ---- softcap, ALiBi (in raw-score units: the softmax multiplies by scale later) ----
    if (rows.scores_transform) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s_acc[mt][nt][e] * p.softmax_scale;
                    if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
                    const int half = e / 2;
                    const int qi = (r0 + mt * 16 + g + 8 * half) / p.group;
                    const int key = key0 + nt * 8 + 2 * t + (e & 1);
                    s_acc[mt][nt][e] = x * rows.inv_scale
                                       - rows.row_slope[mt][half] * fabsf(float(qi + offset - key));
                }
    }
    // ---- mask: the ragged end, causal / window edges; the bulk skips it ----
    if (edge) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + nt * 8 + 2 * t + (e & 1);
                    if (key < rows.row_lo[mt][e / 2] || key >= rows.row_hi[mt][e / 2]) s_acc[mt][nt][e] = neg_inf();
                }
    }

    // ---- online softmax, then O += P V_w ----
    if constexpr (kLean) {
        float m_old[kMTiles][2], alpha[kMTiles][2];
        bool grew = false;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) m_old[mt][half] = m[mt][half];
        softmax_step(s_acc, m, l, p.scale_log2, alpha);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) grew |= m[mt][half] != m_old[mt][half];
        if (__any_sync(0xffffffffu, grew)) softmax_rescale(o_acc, alpha);  // warp-uniform branch
    } else {
        softmax_update(s_acc, o_acc, m, l, p.scale_log2);
    }
    u32 p_frag[kMTiles][kWarpN / 16][4];
    pack_a_frags<kMTiles, kWarpN / 16, Elem>(p_frag, s_acc);
    before_pv();
    gemm_frags_x_rows_t<kMTiles, kNTilesO, kWarpN / 16, kRowBytes, Elem>(o_acc, p_frag, v_lane);
}

// The second half of the warps' merge, after every warp wrote its (m, l, O) into merge_smem
// (o_merge [kWarps][kRows][kMergePitch] unnormalized O, then m_merge and l_merge [kWarps][kRows])
// and a barrier: per row r < rows_valid and 4 columns col < head_dim, O = Σ_w exp(scale·(m_w - M))
// O_w and l = Σ_w exp(..) l_w go to store(r, col, O, 1 / l, M, l).
template <int kWarps, int kRows, int kHeadDim, int kMergePitch, int kThreads, class Store>
__device__ __forceinline__ void merge_rows(const DecodeParams& p, const float* merge_smem, int tid, int rows_valid,
                                           Store&& store) {
    const float* o_merge = merge_smem;
    const float* m_merge = o_merge + kWarps * kRows * kMergePitch;
    const float* l_merge = m_merge + kWarps * kRows;
    constexpr int kQuads = kHeadDim / 4;  // 4 columns per thread per step
    for (int c = tid; c < kRows * kQuads; c += kThreads) {
        const int r = c / kQuads, col = (c % kQuads) * 4;
        if (r >= rows_valid || col >= p.head_dim) continue;
        // row max over the warps, then each warp's weight exp(scale·(m_w - M)); -inf: no keys
        float m_row = neg_inf();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m_row = fmaxf(m_row, m_merge[w * kRows + r]);
        const float m_scaled = m_row == neg_inf() ? 0.f : m_row * p.scale_log2;
        float l_row = 0.f, o4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float wt = exp2_approx(m_merge[w * kRows + r] * p.scale_log2 - m_scaled);
            l_row += wt * l_merge[w * kRows + r];
            const f32x4 x = *reinterpret_cast<const f32x4*>(o_merge + (w * kRows + r) * kMergePitch + col);
            o4[0] += wt * x.x; o4[1] += wt * x.y; o4[2] += wt * x.z; o4[3] += wt * x.w;
        }
        store(r, col, o4, softmax_inv_l(l_row), m_row, l_row);
    }
}

// The warps' merge: each warp saw other keys of the same rows. Every warp writes its (m, l, O)
// into merge_smem (o_merge [kWarps][kRows][kMergePitch] unnormalized O, m_merge / l_merge
// [kWarps][kRows]; it overlays the K/V ring, which the caller made free); sync() (the consumers'
// barrier); then per row r < rows_valid and 4 columns col < head_dim, O = Σ_w exp(scale·(m_w - M))
// O_w and l = Σ_w exp(..) l_w go to store(r, col, O, 1 / l, M, l).
template <class Shape, int kMergePitch, class Sync, class Store>
__device__ __forceinline__ void merge_warps(const DecodeParams& p, float* merge_smem,
                                            const float (&o_acc)[Shape::kRows / 16][Shape::kNTilesO][4],
                                            const float (&m)[Shape::kRows / 16][2], const float (&l)[Shape::kRows / 16][2],
                                            int tid, int warp, int g, int t, int rows_valid, Sync&& sync, Store&& store) {
    constexpr int kWarps = Shape::kThreads / 32, kRows = Shape::kRows, kMTiles = kRows / 16;
    constexpr int kNTilesO = Shape::kNTilesO, kHeadDim = Shape::kNTilesO * 8;
    float* o_merge = merge_smem;
    float* m_merge = o_merge + kWarps * kRows * kMergePitch;
    float* l_merge = m_merge + kWarps * kRows;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + g + 8 * half;
            const float l_row = quad_sum(l[mt][half]);
            if (t == 0) {
                m_merge[warp * kRows + r] = m[mt][half];  // m is uniform across the quad
                l_merge[warp * kRows + r] = l_row;
            }
            float* o_row = o_merge + (warp * kRows + r) * kMergePitch;
#pragma unroll
            for (int nt = 0; nt < kNTilesO; ++nt) {
                o_row[nt * 8 + 2 * t] = o_acc[mt][nt][2 * half];
                o_row[nt * 8 + 2 * t + 1] = o_acc[mt][nt][2 * half + 1];
            }
        }
    sync();
    merge_rows<kWarps, kRows, kHeadDim, kMergePitch, Shape::kThreads>(p, merge_smem, tid, rows_valid, store);
}

// The warps' merge and the CTA's output: each warp saw other keys of the same rows. Every warp
// writes its (m, l, O) into merge_smem (o_merge [kWarps][kRows][kMergePitch] unnormalized O,
// m_merge / l_merge [kWarps][kRows]; it overlays the K/V ring, which the caller made free);
// sync() (the consumers' barrier); then per row and 4 columns, O = Σ_w exp(scale·(m_w - M)) O_w /
// Σ_w exp(..) l_w into o and lse (one split) or the split's fp32 partial (several).
template <class Shape, class Elem, class Sync>
__device__ __forceinline__ void merge_warps_store(const DecodeParams& p, float* merge_smem,
                                                  const float (&o_acc)[Shape::kRows / 16][Shape::kNTilesO][4],
                                                  const float (&m)[Shape::kRows / 16][2], const float (&l)[Shape::kRows / 16][2],
                                                  int tid, int warp, int g, int t, int b, int hkv, int r0, int rows_valid,
                                                  int split, Sync&& sync) {
    constexpr int kWarps = Shape::kThreads / 32, kRows = Shape::kRows, kMTiles = kRows / 16;
    constexpr int kNTilesO = Shape::kNTilesO, kHeadDim = Shape::kNTilesO * 8;
    constexpr int kMergePitch = Shape::kMergePitch;
    float* o_merge = merge_smem;
    float* m_merge = o_merge + kWarps * kRows * kMergePitch;
    float* l_merge = m_merge + kWarps * kRows;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + g + 8 * half;
            const float l_row = quad_sum(l[mt][half]);
            if (t == 0) {
                m_merge[warp * kRows + r] = m[mt][half];  // m is uniform across the quad
                l_merge[warp * kRows + r] = l_row;
            }
            float* o_row = o_merge + (warp * kRows + r) * kMergePitch;
#pragma unroll
            for (int nt = 0; nt < kNTilesO; ++nt) {
                o_row[nt * 8 + 2 * t] = o_acc[mt][nt][2 * half];
                o_row[nt * 8 + 2 * t + 1] = o_acc[mt][nt][2 * half + 1];
            }
        }
    sync();

    const bool direct = p.num_splits == 1;
    const int rows_all = p.batch * p.nheads * p.seqlen_q;
    constexpr int kQuads = kHeadDim / 4;  // 4 columns per thread per step
    for (int c = tid; c < kRows * kQuads; c += Shape::kThreads) {
        const int r = c / kQuads, col = (c % kQuads) * 4;
        if (r >= rows_valid || col >= p.head_dim) continue;
        // row max over the warps, then each warp's weight exp(scale·(m_w - M)); -inf: no keys
        float m_row = neg_inf();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m_row = fmaxf(m_row, m_merge[w * kRows + r]);
        const float m_scaled = m_row == neg_inf() ? 0.f : m_row * p.scale_log2;
        float l_row = 0.f, o4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float wt = exp2_approx(m_merge[w * kRows + r] * p.scale_log2 - m_scaled);
            l_row += wt * l_merge[w * kRows + r];
            const f32x4 x = *reinterpret_cast<const f32x4*>(o_merge + (w * kRows + r) * kMergePitch + col);
            o4[0] += wt * x.x; o4[1] += wt * x.y; o4[2] += wt * x.z; o4[3] += wt * x.w;
        }
        const float inv_l = softmax_inv_l(l_row);
        const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
        const int row_id = (b * p.nheads + h) * p.seqlen_q + qi;
        if (direct) {
            u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride + col;
            *reinterpret_cast<u32x2*>(o) = u32x2{pack2<Elem>(o4[0] * inv_l, o4[1] * inv_l),
                                                 pack2<Elem>(o4[2] * inv_l, o4[3] * inv_l)};
            if (col == 0 && p.lse != nullptr) p.lse[row_id] = softmax_lse(m_row, l_row, p.softmax_scale);
        } else {
            float* o = p.o_partial + (static_cast<i64>(split) * rows_all + row_id) * p.head_dim_rounded + col;
            *reinterpret_cast<f32x4*>(o) = f32x4{o4[0] * inv_l, o4[1] * inv_l, o4[2] * inv_l, o4[3] * inv_l};
            if (col == 0)
                p.lse_partial[static_cast<i64>(split) * rows_all + row_id] =
                    l_row == 0.f ? neg_inf() : m_row * p.softmax_scale + logf(l_row);
        }
    }
}

// ---- decode_splitkv_tma: the Hopper loop (sm_90), a producer warp streams K/V by TMA ------------
// Warps 0 .. kWarps - 1 consume as the cp.async loop does (S = Q K_wᵀ, online softmax, O += P V_w
// on their kWarpN keys of each block, then the merge); warp kWarps is the producer. Ring slot s
// holds one K block and one V block; full[s] completes when TMA has delivered their bytes (the
// producer announces them with arrive.expect_tx), empty[s] when every consumer warp has read
// the slot (kWarps · 32 arrivals, one per thread after its last ldmatrix of the slot). Waiters
// test the phase parity, which flips each wrap of the ring: iteration i uses slot i % kStages in
// phase (i / kStages) & 1. So all kStages blocks can be in flight at once (the cp.async loop keeps
// kStages - 1), and no consumer thread issues loads.
// One thread on each side of every edge: producer lane 0 both announces a slot's bytes and
// issues all of its copies, and each consumer thread releases its own reads. (With one arrival
// per warp after a __syncwarp, compute-sanitizer racecheck did not order lanes 1..31's ring reads
// before the producer's next copies into the slot: it reported the bulk copies below against the
// consumers' ldmatrix reads and V zero fills, H100 session 13.)
//
// Rows: contiguous caches, one box of kBlockN keys per K (V) block at cache row start + n·kBlockN
// of cache row cache_batch_idx[b] (rows past the capacity arrive as zeros). Paged caches, boxes of
// p.tma_box_rows keys (a divisor of page_size and kBlockN): producer lane k reads the page id of
// box k (all boxes' table reads in flight at once), lane 0 issues the K and V boxes; a box that
// would cross a page (only with a cache_leftpad that is not a multiple of the box) goes by one
// 1-D bulk copy per key row instead, whose page ids lane r reads. Boxes past the row's keys are
// not loaded. Rows past the row's keys hold stale cache or stale ring data: their
// scores are masked to -inf (P = 0) and each consumer warp zeros its own such V rows before
// O += P V reads them (0 · NaN would not be 0).
template <int kWarps, int kWarpN, int kStages, int kMTiles, int kHeadDim, class Elem>
__global__ void __launch_bounds__(kWarps * 32 + 32, 1)
decode_splitkv_tma(const __grid_constant__ DecodeTmaParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap();  // TMA and mbarrier transactions need sm_90; the host never launches this kernel below it
#else
    using Shape = DecodeShape<kWarps, kWarpN, kStages, kMTiles, kHeadDim>;
    constexpr int kConsumers = Shape::kThreads;  // consumer threads; the producer warp follows
    constexpr int kBlockN = Shape::kBlockN, kRows = Shape::kRows;
    constexpr int kNTilesO = Shape::kNTilesO, kPitch = Shape::kPitch;
    constexpr int kRowBytes = kPitch * 2;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    static_assert(kHeadDim + 8 <= 256, "a TMA box row (head dim + 8 padding columns) holds at most 256 elements");
    static_assert(kBlockN <= 256, "a TMA box holds at most 256 keys");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* q_smem = reinterpret_cast<u16*>(smem_raw);       // [kRows][kPitch]
    u16* k_smem = q_smem + Shape::kQTile;                  // [kStages][kBlockN][kPitch]
    u16* v_smem = k_smem + kStages * Shape::kKVTile;       // [kStages][kBlockN][kPitch]
    const u32 bars = smem_u32(smem_raw + Shape::kSmemBytes);  // full[kStages], empty[kStages] (8 bytes each)
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (kStages + s); };

    const int split = blockIdx.x, b = blockIdx.z;
    const int hkv = blockIdx.y / p.row_blocks, r0 = (blockIdx.y % p.row_blocks) * kRows;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int rows_valid = min(kRows, p.group * p.seqlen_q - r0);
    const RowKeys rk(p, b);
    const int keys = rk.keys, offset = keys - p.seqlen_q;  // query i's diagonal key: i + offset

    // The visible keys and this split's blocks, as in decode_splitkv's cp.async loop.
    const int qi_lo = r0 / p.group, qi_hi = (r0 + rows_valid - 1) / p.group;
    int key_lo = 0, key_hi = keys, full_lo = 0, full_hi = keys;
    if (p.window_left >= 0) {
        key_lo = max(0, qi_lo + offset - p.window_left);
        full_lo = max(0, qi_hi + offset - p.window_left);
    }
    if (p.window_right >= 0) {
        key_hi = min(keys, qi_hi + offset + p.window_right + 1);
        full_hi = min(keys, qi_lo + offset + p.window_right + 1);
    }
    const int n_blocks_row = (keys + kBlockN - 1) / kBlockN;
    const int per_split = (n_blocks_row + p.num_splits - 1) / p.num_splits;
    const int n_begin = max(split * per_split, key_lo / kBlockN);
    const int n_end = min(min(n_blocks_row, (split + 1) * per_split),
                          key_hi <= 0 ? 0 : (key_hi + kBlockN - 1) / kBlockN);
    const int n_iters = max(n_end - n_begin, 0);

    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(full(s), 1);
            mbarrier_init(empty(s), kConsumers);  // every consumer thread releases its reads
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the barriers are initialized before anyone waits on them

    // ---- producer warp: blocks n_end - 1, n_end - 2, ... into slots 0, 1, ... ----
    if (warp == kWarps) {
        if (lane == 0) {
            prefetch_tensormap(&p.tma_k);
            prefetch_tensormap(&p.tma_v);
        }
        int row_b = p.cache_batch_idx ? p.cache_batch_idx[b] : b;  // contiguous: the cache row
        row_b = min(max(row_b, 0), p.num_pages - 1);
        const int box = p.tma_box_rows;
        const u16* k_cache = static_cast<const u16*>(p.k_cache) + hkv * p.k_head_stride;
        const u16* v_cache = static_cast<const u16*>(p.v_cache) + hkv * p.v_head_stride;
        const int* table = p.block_table + b * p.block_table_stride;
        for (int iter = 0; iter < n_iters; ++iter) {
            const int n = n_end - 1 - iter, slot = iter % kStages;
            if (iter >= kStages) mbarrier_wait(empty(slot), ((iter / kStages) - 1) & 1);  // slot read
            const u32 k_dst = smem_u32(k_smem + slot * Shape::kKVTile);
            const u32 v_dst = smem_u32(v_smem + slot * Shape::kKVTile);
            const int j0 = n * kBlockN;  // the block's first key (j0 < keys)
            if (!p.block_table) {
                if (lane == 0) {
                    mbarrier_arrive_expect_tx(full(slot), 2 * kBlockN * kRowBytes);
                    tma_load_4d(k_dst, &p.tma_k, full(slot), 0, rk.start + j0, hkv, row_b);
                    tma_load_4d(v_dst, &p.tma_v, full(slot), 0, rk.start + j0, hkv, row_b);
                }
                continue;
            }
            // paged: lane k reads the page of box k (rows j0 + k·box ..), if it starts before the
            // row's end; lane 0 announces the block's bytes and issues every copy
            const int n_boxes = min(kBlockN / box, (keys - j0 + box - 1) / box);
            int page = 0, in_page = 0;
            bool whole = false;
            u32 bytes = 0;
            if (lane < n_boxes) {
                const int pos0 = rk.start + j0 + lane * box;  // < capacity: a table entry in use
                page = min(max(table[pos0 / p.page_size], 0), p.num_pages - 1);
                in_page = pos0 % p.page_size;
                whole = in_page + box <= p.page_size;
                bytes = 2 * box * (whole ? kRowBytes : kHeadDim * 2);
            }
#pragma unroll
            for (int d = 16; d >= 1; d /= 2) bytes += __shfl_xor_sync(0xffffffffu, bytes, d);
            if (lane == 0) mbarrier_arrive_expect_tx(full(slot), bytes);
            for (u32 todo = __ballot_sync(0xffffffffu, lane < n_boxes && whole); todo; todo &= todo - 1) {
                const int k = __ffs(todo) - 1;
                const int pg = __shfl_sync(0xffffffffu, page, k), row = __shfl_sync(0xffffffffu, in_page, k);
                if (lane == 0) {
                    tma_load_4d(k_dst + k * box * kRowBytes, &p.tma_k, full(slot), 0, row, hkv, pg);
                    tma_load_4d(v_dst + k * box * kRowBytes, &p.tma_v, full(slot), 0, row, hkv, pg);
                }
            }
            // boxes across a page boundary: one bulk copy per key row; lane i reads the page of
            // row r0 + i, lane 0 issues
            for (u32 todo = __ballot_sync(0xffffffffu, lane < n_boxes && !whole); todo; todo &= todo - 1) {
                const int k = __ffs(todo) - 1;
                for (int r0 = 0; r0 < box; r0 += 32) {
                    // rows past the row's keys may lie past the table's used entries: the column
                    // and the page id are clamped, the row is masked by the consumers
                    const int pos = rk.start + j0 + k * box + r0 + lane;
                    const int pg = r0 + lane < box
                        ? min(max(table[min(pos / p.page_size, static_cast<int>(p.block_table_stride) - 1)], 0),
                              p.num_pages - 1)
                        : 0;
                    const int prow = pos % p.page_size;
                    for (int i = 0; i < min(32, box - r0); ++i) {
                        const int pg_i = __shfl_sync(0xffffffffu, pg, i), prow_i = __shfl_sync(0xffffffffu, prow, i);
                        if (lane == 0) {
                            const u32 dst = (k * box + r0 + i) * kRowBytes;
                            bulk_load_1d(k_dst + dst, k_cache + pg_i * p.k_batch_stride + prow_i * p.k_row_stride,
                                         kHeadDim * 2, full(slot));
                            bulk_load_1d(v_dst + dst, v_cache + pg_i * p.v_batch_stride + prow_i * p.v_row_stride,
                                         kHeadDim * 2, full(slot));
                        }
                    }
                }
            }
        }
        return;  // its copies complete on the full barriers, which the consumers wait for
    }

    // ---- consumer warps ----
    // Q tile (cp.async, as the cp.async loop): packed row r is query (r0 + r) / group of head
    // hkv·group + (r0 + r) % group.
    const u16* q_base = static_cast<const u16*>(p.q_rot ? p.q_rot : p.q);
    const i64 qh_stride = p.q_rot ? p.head_dim : p.q_head_stride;
    const i64 qr_stride = p.q_rot ? static_cast<i64>(p.nheads) * p.head_dim : p.q_row_stride;
    const i64 qb_stride = p.q_rot ? qr_stride * p.seqlen_q : p.q_batch_stride;
    for (int c = tid; c < kRows * kChunks; c += kConsumers) {
        const int r = c / kChunks, col = (c % kChunks) * 8;
        const bool valid = r < rows_valid && col < p.head_dim;
        const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
        const u16* src = valid ? q_base + b * qb_stride + qi * qr_stride + h * qh_stride + col : q_base;
        cp_async_16(smem_u32(q_smem + r * kPitch + col), src, valid);
    }
    cp_async_commit();

    const DecodeRows<kMTiles> rows(p, b, hkv, r0, g, keys, offset);

    float o_acc[kMTiles][kNTilesO][4];
    float m[kMTiles][2], l[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTilesO; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    softmax_init(m, l);

    const u32 q_lane = smem_u32(q_smem) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;
    const u32 k_lane = smem_u32(k_smem) + (warp * kWarpN + (lane & 7) + (lane >> 4) * 8) * kRowBytes
                       + ((lane >> 3) & 1) * 16;
    const u32 v_lane = smem_u32(v_smem) + (warp * kWarpN + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes
                       + (lane >> 4) * 16;

    cp_async_wait<0>();
    named_barrier_sync(1, kConsumers);  // Q landed (every consumer thread's chunks)

    for (int iter = 0; iter < n_iters; ++iter) {
        const int n = n_end - 1 - iter, slot = iter % kStages;
        mbarrier_wait(full(slot), (iter / kStages) & 1);  // block n's K and V landed
        const int key0 = n * kBlockN + warp * kWarpN;     // this warp's first key
        const bool ragged = key0 + kWarpN > keys;          // rows past the row's keys
        if (ragged) {
            u16* v_rows = v_smem + slot * Shape::kKVTile + warp * kWarpN * kPitch;
            for (int i = lane; i < kWarpN * kChunks; i += 32) {
                const int r = i / kChunks, col = (i % kChunks) * 8;
                if (key0 + r >= keys) *reinterpret_cast<f32x4*>(v_rows + r * kPitch + col) = f32x4{0.f, 0.f, 0.f, 0.f};
            }
            __syncwarp();
        }
        attend_block<kMTiles, kWarpN, kHeadDim, kRowBytes, Elem>(
            p, rows, r0, g, t, offset, n * kBlockN, warp, n * kBlockN < full_lo || (n + 1) * kBlockN > full_hi, q_lane,
            k_lane + slot * Shape::kKVTile * 2, v_lane + slot * Shape::kKVTile * 2, o_acc, m, l, [] {});
        // This thread is done with the slot; its zeros (generic proxy) are ordered before the
        // producer's copies (async proxy) rewrite it.
        if (ragged) fence_proxy_async_smem();
        mbarrier_arrive(empty(slot));
    }
    named_barrier_sync(1, kConsumers);  // every consumer is done with the ring: the merge overlays it
    merge_warps_store<Shape, Elem>(p, reinterpret_cast<float*>(k_smem), o_acc, m, l, tid, warp, g, t, b, hkv, r0,
                                   rows_valid, split, [] { named_barrier_sync(1, kConsumers); });
#endif
}

// ---- decode_splitkv: one split of one KV head's packed query rows -----------------------------
template <int kWarps, int kWarpN, int kStages, int kMTiles, int kHeadDim, class Elem,
          bool kFusedCombine = false, bool kPagePrefetch = false, int kL2Prefetch = 0,
          bool kWarpLoads = false, bool kPageGather = false, bool kLean = false, int kBulk = 0,
          bool kEarlyMerge = false, int kRingFill = 0, int kDynamic = 0, bool kLightFence = false>
__global__ void __launch_bounds__(kWarps * 32)
decode_splitkv(const DecodeParams p) {
    using Shape = DecodeShape<kWarps, kWarpN, kStages, kMTiles, kHeadDim>;
    constexpr int kThreads = Shape::kThreads, kBlockN = Shape::kBlockN, kRows = Shape::kRows;
    constexpr int kNTilesO = Shape::kNTilesO, kPitch = Shape::kPitch;
    constexpr int kRowBytes = kPitch * 2;
    static_assert(kBulk >= 0 && kBulk <= 2, "kBulk: 0 (cp.async), 1 (bulk rows), 2 (bulk rows, evict-first)");
    static_assert(!kBulk || (!kWarpLoads && !kPagePrefetch && !kPageGather),
                  "the bulk rows are the CTA's loads: no warp_loads, page_prefetch or page_gather");
    static_assert(kRingFill >= 0 && kRingFill <= 2, "kRingFill: 0 (kStages - 1 blocks ahead), 1 (all slots), 2 (1, loads before S)");
    static_assert(kDynamic >= 0 && kDynamic <= 2, "kDynamic: 0 (equal runs), 1 (claims), 2 (interleaved)");
    static_assert(!kDynamic || (kRingFill && !kBulk && !kPagePrefetch && !kWarpLoads),
                  "kDynamic: its prologue fills the ring; no bulk, no page prefetch, no warp loads (the block ids "
                  "need the CTA's barrier)");
    static_assert(kDynamic != 1 || kFusedCombine, "kDynamic 1: the fused combine's last CTA resets the claim counter");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* q_smem = reinterpret_cast<u16*>(smem_raw);       // [kRows][kPitch]
    u16* k_smem = q_smem + Shape::kQTile;                  // [kStages][kBlockN][kPitch]
    u16* v_smem = k_smem + kStages * Shape::kKVTile;       // [kStages][kBlockN][kPitch]
    // kBulk: one mbarrier per ring slot after the ring, its phase flips once per block loaded
    const u32 ring_bars = smem_u32(smem_raw + Shape::kSmemBytes);
    // kDynamic: the block ids of loads j = 0, 1, ... at claim_ids[j % (2·kStages)] (-1: none left)
    int* claim_ids = reinterpret_cast<int*>(smem_raw + Shape::kSmemBytes);
    auto ring_bar = [&](int slot) { return ring_bars + 8u * slot; };

    const int split = blockIdx.x, b = blockIdx.z;
    const int hkv = blockIdx.y / p.row_blocks, r0 = (blockIdx.y % p.row_blocks) * kRows;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int rows_valid = min(kRows, p.group * p.seqlen_q - r0);
    const RowKeys rk(p, b);
    const int keys = rk.keys, offset = keys - p.seqlen_q;  // query i's diagonal key: i + offset

    // Keys that some row of this CTA sees, [key_lo, key_hi), and that every row sees,
    // [full_lo, full_hi): the blocks inside the latter skip the element-wise mask.
    const int qi_lo = r0 / p.group, qi_hi = (r0 + rows_valid - 1) / p.group;
    int key_lo = 0, key_hi = keys, full_lo = 0, full_hi = keys;
    if (p.window_left >= 0) {
        key_lo = max(0, qi_lo + offset - p.window_left);
        full_lo = max(0, qi_hi + offset - p.window_left);
    }
    if (p.window_right >= 0) {
        key_hi = min(keys, qi_hi + offset + p.window_right + 1);
        full_hi = min(keys, qi_lo + offset + p.window_right + 1);
    }
    // This split's K/V blocks: the row's blocks in num_splits equal runs (per row, on the
    // device: the grid depends on shapes only), narrowed to the visible keys.
    const int n_blocks_row = (keys + kBlockN - 1) / kBlockN;
    const int per_split = (n_blocks_row + p.num_splits - 1) / p.num_splits;
    const int n_begin = max(split * per_split, key_lo / kBlockN);
    const int n_end = min(min(n_blocks_row, (split + 1) * per_split),
                          key_hi <= 0 ? 0 : (key_hi + kBlockN - 1) / kBlockN);
    const int n_iters = max(n_end - n_begin, 0);
    // kDynamic: the group's blocks [g_lo, g_hi), taken from the top: the c-th is g_hi - 1 - c
    const int g_lo = key_lo / kBlockN, g_hi = min(n_blocks_row, key_hi <= 0 ? 0 : (key_hi + kBlockN - 1) / kBlockN);
    const int g_blocks = max(g_hi - g_lo, 0);
    auto group_block = [&](int c) { return c < g_blocks ? g_hi - 1 - c : -1; };
    // kDynamic 1: the claims where the group has at least kClaimMinBlocks blocks per split (uniform
    // over the group's CTAs). H100, session 20 (bf16 d 128 32:8 heads, 16 splits, CUDA graphs):
    // claims against equal runs at 64 blocks per split (1 x 128k) 184.0 / 191.0 us, at 32 (1 x 64k)
    // 97.2 / 98.2, but at 16 (1 x 32k) 53.6 / 53.0 and at 4 (1 x 8k) 17.0 / 15.1.
    constexpr int kClaimMinBlocks = 32;
    const bool claims = kDynamic == 1 && p.num_splits > 1 && g_blocks >= kClaimMinBlocks * p.num_splits;
    // the block id of load j without claims: kDynamic 2's interleaved order, else the equal runs
    auto fixed_block = [&](int j) {
        if constexpr (kDynamic == 2) return group_block(j * p.num_splits + split);
        else return j < n_iters ? n_end - 1 - j : -1;
    };

    // Q tile: packed row r is query i = (r0 + r) / group of head hkv·group + (r0 + r) % group.
    const u16* q_base = static_cast<const u16*>(p.q_rot ? p.q_rot : p.q);
    const i64 qh_stride = p.q_rot ? p.head_dim : p.q_head_stride;
    const i64 qr_stride = p.q_rot ? static_cast<i64>(p.nheads) * p.head_dim : p.q_row_stride;
    const i64 qb_stride = p.q_rot ? qr_stride * p.seqlen_q : p.q_batch_stride;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    for (int c = tid; c < kRows * kChunks; c += kThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 8;
        const bool valid = r < rows_valid && col < p.head_dim;
        const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
        const u16* src = valid ? q_base + b * qb_stride + qi * qr_stride + h * qh_stride + col : q_base;
        cp_async_16(smem_u32(q_smem + r * kPitch + col), src, valid);
    }
    cp_async_commit();

    // K/V block n into ring slot `slot`: kLanesPerRow threads per key row, one 16-byte chunk
    // each; the row's cache address is computed per row (paged: one block_table read). The
    // loaders: the whole CTA over the block's kBlockN rows, or (kWarpLoads) each warp over its
    // own kWarpN rows.
    constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    constexpr int kLoaders = kWarpLoads ? 32 : kThreads;       // threads that share a block's rows
    constexpr int kLoadRows = kWarpLoads ? kWarpN : kBlockN;    // rows they load
    constexpr int kRowsPerPass = kLoaders / kLanesPerRow;
    static_assert(kLoaders % kLanesPerRow == 0, "the loaders must cover whole rows per pass");
    const int ld_tid = kWarpLoads ? lane : tid;
    const int ld_row = (kWarpLoads ? warp * kWarpN : 0) + ld_tid / kLanesPerRow;
    const int ld_col = (ld_tid % kLanesPerRow) * 8;
    const u16* k_cache = static_cast<const u16*>(p.k_cache) + hkv * p.k_head_stride + ld_col;
    const u16* v_cache = static_cast<const u16*>(p.v_cache) + hkv * p.v_head_stride + ld_col;
    // Contiguous caches: the row's base once (cp.async's memory clobber would reload
    // cache_batch_idx[b] per key row otherwise); paged ones look the page up per key row.
    i64 k_row0 = 0, v_row0 = 0;
    if (!p.block_table) cache_offsets(p, b, 0, k_row0, v_row0);
    // kPagePrefetch: page_of[pass] is the page of this thread's row of pass `pass` of the next
    // block to load (the ring loads blocks n_end - 1, n_end - 2, ...: always one block lower).
    // The table reads of block n - 1 are issued right after block n's cp.asyncs and consumed
    // one load later, so no cp.async waits on a dependent global load.
    constexpr int kPasses = (kLoadRows + kRowsPerPass - 1) / kRowsPerPass;
    int page_of[kPagePrefetch ? kPasses : 1];
    auto fetch_pages = [&](int n) {
        if (ld_col >= kHeadDim) return;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int row = ld_row + pass * kRowsPerPass, j = n * kBlockN + row;
            page_of[pass] = n >= 0 && (kWarpLoads || row < kBlockN) && j < keys
                            ? p.block_table[b * p.block_table_stride + (rk.start + j) / p.page_size] : 0;
        }
    };
    if constexpr (kPagePrefetch)
        if (p.block_table && n_end > n_begin) fetch_pages(n_end - 1);
    if constexpr (kBulk) {  // the slots' barriers, set up before the prologue's loads use them
        if (tid == 0) {
            for (int s = 0; s < kStages; ++s) mbarrier_init(ring_bar(s), 1);
            fence_mbarrier_init();
        }
        __syncthreads();
    }
    auto load_kv = [&](int n, int slot) {
        if constexpr (kBulk) {
            // A whole block: thread 0 announces its bytes (one arrival), then thread i copies key
            // rows i, i + kThreads, ... of K and V, one bulk copy each, completing as
            // transactions on the slot's barrier (the tx-count may dip below zero before the
            // announcement lands: the phase cannot complete before thread 0's arrival).
            const int key0 = n * kBlockN;
            if (key0 + kBlockN <= keys && p.head_dim >= kHeadDim) {
                if (tid == 0) mbarrier_arrive_expect_tx(ring_bar(slot), 2 * kBlockN * kHeadDim * 2);
                const u16* k_base = static_cast<const u16*>(p.k_cache) + hkv * p.k_head_stride;
                const u16* v_base = static_cast<const u16*>(p.v_cache) + hkv * p.v_head_stride;
                u64 policy = 0;
                if constexpr (kBulk == 2) policy = l2_policy_evict_first();
#pragma unroll
                for (int r = tid; r < kBlockN; r += kThreads) {
                    i64 k_off, v_off;
                    if (p.block_table) {
                        cache_offsets(p, b, rk.start + key0 + r, k_off, v_off);
                    } else {
                        k_off = k_row0 + static_cast<i64>(rk.start + key0 + r) * p.k_row_stride;
                        v_off = v_row0 + static_cast<i64>(rk.start + key0 + r) * p.v_row_stride;
                    }
                    const u32 k_dst = smem_u32(k_smem + slot * Shape::kKVTile + r * kPitch);
                    const u32 v_dst = smem_u32(v_smem + slot * Shape::kKVTile + r * kPitch);
                    if constexpr (kBulk == 2) {
                        bulk_load_1d_hint(k_dst, k_base + k_off, kHeadDim * 2, ring_bar(slot), policy);
                        bulk_load_1d_hint(v_dst, v_base + v_off, kHeadDim * 2, ring_bar(slot), policy);
                    } else {
                        bulk_load_1d(k_dst, k_base + k_off, kHeadDim * 2, ring_bar(slot));
                        bulk_load_1d(v_dst, v_base + v_off, kHeadDim * 2, ring_bar(slot));
                    }
                }
                return;
            }
            // a block with rows past the end: the zero-filling cp.asyncs below (the consumers
            // wait for their group too); the slot's phase completes on this arrival
            if (tid == 0) mbarrier_arrive(ring_bar(slot));
        }
        if (ld_col >= kHeadDim) return;
        const int key0 = n * kBlockN;
        const bool whole = key0 + kBlockN <= keys && p.head_dim >= kHeadDim;
        const u32 k_dst = smem_u32(k_smem + slot * Shape::kKVTile + ld_row * kPitch + ld_col);
        const u32 v_dst = smem_u32(v_smem + slot * Shape::kKVTile + ld_row * kPitch + ld_col);
        // kPageGather: this block's page ids, one per pass, all read before its first cp.async
        // (cp.async's memory clobber keeps a table read written between two copies behind the
        // first: one dependent round trip per pass otherwise)
        int gathered[kPageGather ? kPasses : 1];
        if constexpr (kPageGather)
            if (p.block_table) {
#pragma unroll
                for (int pass = 0; pass < kPasses; ++pass) {
                    const int row = ld_row + pass * kRowsPerPass, j = key0 + row;
                    gathered[pass] = (kWarpLoads || row < kBlockN) && j < keys
                                     ? p.block_table[b * p.block_table_stride + (rk.start + j) / p.page_size] : 0;
                }
            }
#pragma unroll
        for (int pass = 0; pass * kRowsPerPass < kLoadRows; ++pass) {
            const int row = ld_row + pass * kRowsPerPass;
            if (kLoadRows % kRowsPerPass != 0 && row >= kBlockN) break;
            const int j = key0 + row;
            const bool valid = whole || (j < keys && ld_col < p.head_dim);
            i64 k_off = 0, v_off = 0;
            if (valid) {
                if ((kPagePrefetch || kPageGather) && p.block_table) {
                    const int id = kPageGather ? gathered[kPageGather ? pass : 0] : page_of[kPagePrefetch ? pass : 0];
                    const int page = min(max(id, 0), p.num_pages - 1);
                    const int pos = rk.start + j, prow = pos % p.page_size;
                    k_off = page * p.k_batch_stride + prow * p.k_row_stride;
                    v_off = page * p.v_batch_stride + prow * p.v_row_stride;
                } else if (p.block_table) {
                    cache_offsets(p, b, rk.start + j, k_off, v_off);
                } else {
                    k_off = k_row0 + static_cast<i64>(rk.start + j) * p.k_row_stride;
                    v_off = v_row0 + static_cast<i64>(rk.start + j) * p.v_row_stride;
                }
            }
            const u32 off = pass * kRowsPerPass * kRowBytes;
            if (whole) {
                cp_async_16_l2<kL2Prefetch>(k_dst + off, k_cache + k_off);
                cp_async_16_l2<kL2Prefetch>(v_dst + off, v_cache + v_off);
            } else {
                cp_async_16(k_dst + off, k_cache + k_off, valid);
                cp_async_16(v_dst + off, v_cache + v_off, valid);
            }
        }
        if constexpr (kPagePrefetch)
            if (p.block_table && n - 1 >= n_begin) fetch_pages(n - 1);  // the next block it loads
    };
    // The prologue: blocks n_end - 1, n_end - 2, ... into slots 0, 1, ...: kStages - 1 of them, or
    // (kRingFill) every slot; kDynamic: the group's blocks split, split + num_splits, ... (from the top)
    constexpr int kPrologue = kRingFill ? kStages : kStages - 1;
#pragma unroll
    for (int s = 0; s < kPrologue; ++s) {
        if constexpr (kDynamic) {
            const int n = claims ? group_block(s * p.num_splits + split) : fixed_block(s);
            if (n >= 0) load_kv(n, s);
            if (tid == 0) claim_ids[s] = n;  // read after the loop's barriers
        } else {
            if (s < n_iters) load_kv(n_end - 1 - s, s);
        }
        cp_async_commit();  // committed even when empty, so group counting stays uniform
    }
    // kDynamic 1: the group's claim counter (split_counters' second half; read only with claims)
    int* claim_counter = p.split_counters + static_cast<i64>(gridDim.z) * gridDim.y + static_cast<i64>(b) * gridDim.y
                         + blockIdx.y;

    const DecodeRows<kMTiles> rows(p, b, hkv, r0, g, keys, offset);

    float o_acc[kMTiles][kNTilesO][4];
    float m[kMTiles][2], l[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTilesO; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    softmax_init(m, l);

    // ldmatrix lane addresses (as fa2_fwd.cu): Q as the A operand, this warp's kWarpN rows of K_j
    // as the B operand of S = Q Kᵀ, and of V_j read transposed for O += P V.
    const u32 q_lane = smem_u32(q_smem) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;
    const u32 k_lane = smem_u32(k_smem) + (warp * kWarpN + (lane & 7) + (lane >> 4) * 8) * kRowBytes
                       + ((lane >> 3) & 1) * 16;
    const u32 v_lane = smem_u32(v_smem) + (warp * kWarpN + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes
                       + (lane >> 4) * 16;
    u32 q_frag[kLean ? kMTiles : 1][kLean ? kHeadDim / 16 : 1][4];  // kLean: Q's A fragments, read once

    for (int iter = 0; kDynamic || iter < n_iters; ++iter) {
        int n = n_end - 1 - iter;
        const int slot = iter % kStages;
        // Block n (and Q at iter 0) landed once at most kStages - 2 newer groups are in flight
        // (kRingFill: kStages - 1 at iteration 0, whose prologue committed one block more and
        // which commits none); the barrier also frees the slot of iteration iter - 1 for the
        // prefetch below. kWarpLoads: a warp's rows are its own (loaded and read by its lanes
        // only), so its lanes' barrier is enough, but for Q, which every thread loaded: the
        // CTA's at iteration 0.
        if (kRingFill && iter == 0) cp_async_wait<kStages - 1>();
        else cp_async_wait<kStages - 2>();
        if constexpr (kBulk) mbarrier_wait(ring_bar(slot), (iter / kStages) & 1);  // its bulk rows
        if (!kWarpLoads || iter == 0) __syncthreads();
        else __syncwarp();
        int next_id = -1;  // kDynamic: thread 0's block id for load iter + kStages, stored at the end
        if constexpr (kDynamic) {
            n = claim_ids[iter % (2 * kStages)];  // written kStages iterations ago (or by the prologue)
            if (n < 0) break;                     // CTA-uniform: no block left for this split
            if (tid == 0 && claim_ids[(iter + kStages - 1) % (2 * kStages)] >= 0)
                next_id = claims ? group_block(atomicAdd(claim_counter, 1) + kPrologue * p.num_splits)
                                 : fixed_block(iter + kStages);
        }
        if constexpr (kLean)
            if (iter == 0) load_a_frags<kMTiles, kHeadDim / 16, kRowBytes>(q_frag, q_lane);  // Q landed
        // Prefetch block n - (kStages - 1) into the slot freed by iteration iter - 1 (every warp, or
        // with kWarpLoads every lane of this warp, passed the barrier), between P's packing and
        // O += P V, or (kRingFill 2) here, before S. kRingFill: iteration 0 has none (the
        // prologue loaded it) and commits no group.
        auto prefetch = [&] {
            if (kRingFill && iter == 0) return;
            if constexpr (kDynamic) {
                const int nn = claim_ids[(iter + kStages - 1) % (2 * kStages)];  // thread 0 wrote it last iteration
                if (nn >= 0) load_kv(nn, (iter + kStages - 1) % kStages);
            } else {
                if (iter + kStages - 1 < n_iters) load_kv(n - (kStages - 1), (iter + kStages - 1) % kStages);
            }
            cp_async_commit();
        };
        if constexpr (kRingFill == 2) prefetch();
        attend_block<kMTiles, kWarpN, kHeadDim, kRowBytes, Elem, kLean>(
            p, rows, r0, g, t, offset, n * kBlockN, warp, n * kBlockN < full_lo || (n + 1) * kBlockN > full_hi,
            q_lane, k_lane + slot * Shape::kKVTile * 2, v_lane + slot * Shape::kKVTile * 2, o_acc, m, l, [&] {
                if constexpr (kRingFill != 2) prefetch();
            }, q_frag);
        if constexpr (kDynamic)  // an entry last read kStages iterations ago; the next barrier publishes it
            if (tid == 0) claim_ids[(iter + kStages) % (2 * kStages)] = next_id;
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: the merge area overlays it
    merge_warps_store<Shape, Elem>(p, reinterpret_cast<float*>(k_smem), o_acc, m, l, tid, warp, g, t, b, hkv, r0,
                                   rows_valid, split, [] { __syncthreads(); });

    if constexpr (kFusedCombine) {
        if (p.num_splits == 1) return;
        // ---- the last split of this (batch, KV head, row block) to finish merges the group ----
        // Release: every thread's partial stores are visible GPU-wide before thread 0 counts
        // the CTA done (the threadfence-reduction pattern; the atomic is acq_rel on top).
        // kLightFence: the CTA barrier, then thread 0's acq_rel atomic alone (a release is
        // cumulative over the writes the barrier ordered before it, as CUTLASS's stream-K
        // semaphore relies on): no thread waits on its own stores' fence.
        if constexpr (!kLightFence) __threadfence();
        __syncthreads();
        int* last_flag = reinterpret_cast<int*>(q_smem);  // the Q tile is read no more
        if (tid == 0) {
            int* counter = p.split_counters + (static_cast<i64>(b) * gridDim.y + blockIdx.y);
            const bool last = atom_add_acq_rel_gpu(counter, 1) == p.num_splits - 1;
            // every split has counted: back to 0 for the next call (and the next graph replay);
            // kDynamic: every split has made its last claim too
            if (last) {
                *counter = 0;
                if (claims) *claim_counter = 0;
            }
            *last_flag = last;
        }
        __syncthreads();
        if (!*last_flag) return;
        // Acquire: the other splits' partials, read below from L2 (ld.global.cg), not a stale L1.
        // kLightFence: thread 0's acquire, then the barrier, orders them.
        if constexpr (!kLightFence) __threadfence();
        for (int r = warp; r < rows_valid; r += kWarps) {
            const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
            combine_row<kHeadDim, Elem, true, kEarlyMerge>(p, (b * p.nheads + h) * p.seqlen_q + qi, lane);
        }
    }
}

// ---- decode_splitkv_stream: every group's K/V blocks as one stream over the CTAs (stream-K) -----
// The (batch, KV head, row block) groups' K/V blocks, group after group (b, then hkv, then the row
// block: the fused combine's group index), make one list of W items; CTA c of C takes items
// [c·W/C, (c+1)·W/C). So every CTA of the grid (C = SMs x resident CTAs) streams the same number of
// blocks, whatever the group count (the split kernel gives each group the same number of CTAs:
// 8 groups x 16 splits leave 4 of 132 SMs idle, and each CTA streams 1/128 of the keys, not 1/132).
// A CTA's range crosses group boundaries: a run of one group's blocks (a segment) starts with a
// fresh (m, l, O) and that group's Q tile, and ends with the warps' merge, which overlays the ring
// slot the segment's last block used (free until the next iteration's load). A segment that holds
// its whole group writes O and LSE; only the first and the last segment of a range can be part of
// a group, and they write an fp32 partial (O / l, LSE) into workspace slot 2c (the range's first
// segment) or 2c + 1 (its last), kRows rows of head_dim_rounded. The group's pieces are those of
// CTAs owner(first item) .. owner(last item); the last of them to count itself done (split_counters,
// the fused combine's counter per group, reset by it) merges them (combine_pieces).
// Keys: the visible range of every row is [0, keys) (the host runs this kernel without windows,
// and with causal masks only at seqlen_q 1), so a batch row's groups all have its ceil(keys /
// kBlockN) blocks; a block's keys come from the top (the ragged block first), as in decode_splitkv.
// Per batch row (at most kStreamMaxBatch) the CTA keeps in shared memory its items' prefix, keys,
// first cache position and cache row; the loader and the compute side each walk the items with a
// cursor. The Q tiles: kStages buffers, segment k in buffer k % kStages, loaded with the
// segment's first block (the loader runs kStages - 1 items ahead: at most kStages segments live).
// Rows without keys (O = 0, LSE = +inf) are written by CTA b % grid. With fewer items than CTAs,
// C = W CTAs take one item each (every range holds an item, so a group's pieces are those of the
// CTAs from its first item's owner to its last's).
constexpr int kStreamMaxBatch = 128;
constexpr int kStreamPerLane = 5;  // the merge of a group's pieces: 160 at most (STREAM_MAX_CTAS)

template <int kWarps, int kWarpN, int kStages, int kMTiles, int kHeadDim, class Elem, int kL2Prefetch>
__global__ void __launch_bounds__(kWarps * 32)
decode_splitkv_stream(const DecodeParams p) {
    using Shape = DecodeShape<kWarps, kWarpN, kStages, kMTiles, kHeadDim>;
    constexpr int kThreads = Shape::kThreads, kBlockN = Shape::kBlockN, kRows = Shape::kRows;
    constexpr int kNTilesO = Shape::kNTilesO, kPitch = Shape::kPitch;
    constexpr int kRowBytes = kPitch * 2;
    constexpr int kSlot = 2 * Shape::kKVTile;  // elements of one ring slot: the K block, then the V block
    // the warps' merge overlays one ring slot: fp32 O rows padded by 4 words where that fits (rows g
    // of a warp's 64-bit fragment stores then start 4 banks apart: 2-way conflicts; unpadded, all
    // in bank 0: 8-way; H200 ncu, 1 x 32k: 197k conflicts against 461 for decode_splitkv)
    constexpr int kMergePitch = kWarps * kRows * (kHeadDim + 4 + 2) * 4 <= kSlot * 2 ? kHeadDim + 4 : kHeadDim;
    static_assert(kWarps * kRows * (kMergePitch + 2) * 4 <= kSlot * 2, "the warps' merge overlays one ring slot");
    constexpr int kChunks = kHeadDim / 8;      // 16-byte chunks per row
    constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    constexpr int kRowsPerPass = kThreads / kLanesPerRow;
    static_assert(kThreads % kLanesPerRow == 0, "the loaders must cover whole rows per pass");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* ring = reinterpret_cast<u16*>(smem_raw);                       // [kStages][K, V][kBlockN][kPitch]
    u16* q_smem = ring + kStages * kSlot;                                // [kStages][kRows][kPitch]
    int* row_prefix = reinterpret_cast<int*>(q_smem + kStages * Shape::kQTile);  // [kStreamMaxBatch + 1]
    int* row_keys = row_prefix + kStreamMaxBatch + 1;
    int* row_start = row_keys + kStreamMaxBatch;
    int* row_cache = row_start + kStreamMaxBatch;
    int* last_flag = row_cache + kStreamMaxBatch;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int per_row = p.nheads_kv * p.row_blocks;  // groups per batch row
    if (warp == 0) {  // each batch row's keys, and the prefix of items over the rows (a warp scan)
        int carry = 0;
        if (lane == 0) row_prefix[0] = 0;
        for (int b0 = 0; b0 < p.batch; b0 += 32) {
            const int b = b0 + lane;
            int items = 0;
            if (b < p.batch) {
                const RowKeys rk(p, b);
                items = (rk.keys + kBlockN - 1) / kBlockN * per_row;
                row_keys[b] = rk.keys;
                row_start[b] = rk.start;
                const int row_b = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
                row_cache[b] = min(max(row_b, 0), p.num_pages - 1);
            }
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int x = __shfl_up_sync(0xffffffffu, items, d);
                if (lane >= d) items += x;
            }
            if (b < p.batch) row_prefix[b + 1] = carry + items;
            carry += __shfl_sync(0xffffffffu, items, 31);
        }
    }
    __syncthreads();

    // the ranges: C = min(grid, W) CTAs (so that no range is empty), [c·W/C, (c+1)·W/C) each
    const int total = row_prefix[p.batch], ctas = min(static_cast<int>(gridDim.x), total), c = blockIdx.x;
    const int w_begin = c < ctas ? static_cast<int>(static_cast<i64>(c) * total / ctas) : 0;
    const int w_end = c < ctas ? static_cast<int>(static_cast<i64>(c + 1) * total / ctas) : 0;
    const int n_items = w_end - w_begin;
    // the CTA whose range holds item w: the last c with c·W/C <= w
    auto owner = [&](int w) { return static_cast<int>((static_cast<i64>(w + 1) * ctas + total - 1) / total) - 1; };

    // rows without keys: O = 0, LSE = +inf (flash-attn's convention), by CTA b % grid
    for (int b = c; b < p.batch; b += gridDim.x) {
        if (row_keys[b] > 0) continue;
        for (int i = tid; i < p.nheads * p.seqlen_q * (p.head_dim / 2); i += kThreads) {
            const int col = 2 * (i % (p.head_dim / 2)), hq = i / (p.head_dim / 2), h = hq % p.nheads, qi = hq / p.nheads;
            u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride + col;
            *reinterpret_cast<u32*>(o) = 0u;
            if (col == 0 && p.lse != nullptr) p.lse[(b * p.nheads + h) * p.seqlen_q + qi] = pos_inf();
        }
    }
    if (n_items <= 0) return;

    // A cursor on the items: batch row b, group gl of the row (hkv · row_blocks + row block), block j
    // of the group (from the top: block blocks - 1 - j), and the row's blocks, keys, first position.
    struct Cursor { int b, gl, j, blocks, keys, start; };
    auto set_row = [&](Cursor& cu, int b) {
        cu.b = b;
        cu.keys = row_keys[b];
        cu.start = row_start[b];
        cu.blocks = (cu.keys + kBlockN - 1) / kBlockN;
    };
    auto next_group = [&](Cursor& cu) {  // to the next group's first block (one exists)
        cu.j = 0;
        if (++cu.gl < per_row) return;
        cu.gl = 0;
        int b = cu.b + 1;
        while (row_keys[b] <= 0) ++b;  // rows without keys have no items
        set_row(cu, b);
    };
    Cursor first;
    {   // item w_begin: the last row whose prefix is <= it (binary search)
        int lo = 0, hi = p.batch - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (row_prefix[mid] <= w_begin) lo = mid;
            else hi = mid - 1;
        }
        set_row(first, lo);
        const int local = w_begin - row_prefix[lo];
        first.gl = local / first.blocks;
        first.j = local % first.blocks;
    }

    // ---- the loader: items in order, kStages - 1 ahead of the compute side ----
    // Its group's state is set once per group (set_group): the head's K / V base (contiguous: at
    // the cache row's first position) and its next block n (counting down to 0).
    const int ld_row = tid / kLanesPerRow, ld_col = (tid % kLanesPerRow) * 8;
    const u16* q_base = static_cast<const u16*>(p.q_rot ? p.q_rot : p.q);
    const i64 qh_stride = p.q_rot ? p.head_dim : p.q_head_stride;
    const i64 qr_stride = p.q_rot ? static_cast<i64>(p.nheads) * p.head_dim : p.q_row_stride;
    const i64 qb_stride = p.q_rot ? qr_stride * p.seqlen_q : p.q_batch_stride;
    Cursor ld = first;
    int ld_n = 0, ld_hkv = 0, ld_seg = 0;
    const u16* ld_k = nullptr;
    const u16* ld_v = nullptr;
    auto set_group = [&] {
        ld_hkv = ld.gl / p.row_blocks;
        ld_n = ld.blocks - 1 - ld.j;
        ld_k = static_cast<const u16*>(p.k_cache) + ld_hkv * p.k_head_stride + ld_col;
        ld_v = static_cast<const u16*>(p.v_cache) + ld_hkv * p.v_head_stride + ld_col;
        if (!p.block_table) {
            ld_k += static_cast<i64>(row_cache[ld.b]) * p.k_batch_stride + static_cast<i64>(ld.start) * p.k_row_stride;
            ld_v += static_cast<i64>(row_cache[ld.b]) * p.v_batch_stride + static_cast<i64>(ld.start) * p.v_row_stride;
        }
    };
    auto load_q = [&](int buf) {  // the loader's group's Q tile (packed rows) into buffer buf
        const int r0 = (ld.gl % p.row_blocks) * kRows;
        const int rows_valid = min(kRows, p.group * p.seqlen_q - r0);
        for (int i = tid; i < kRows * kChunks; i += kThreads) {
            const int r = i / kChunks, col = (i % kChunks) * 8;
            const bool valid = r < rows_valid && col < p.head_dim;
            const int pr = r0 + r, qi = pr / p.group, h = ld_hkv * p.group + pr % p.group;
            const u16* src = valid ? q_base + ld.b * qb_stride + qi * qr_stride + h * qh_stride + col : q_base;
            cp_async_16(smem_u32(q_smem + buf * Shape::kQTile + r * kPitch + col), src, valid);
        }
    };
    auto load_kv = [&](int slot) {  // block ld_n of the loader's group into ring slot `slot`
        if (ld_col >= kHeadDim) return;
        const int key0 = ld_n * kBlockN;
        const bool whole = key0 + kBlockN <= ld.keys && p.head_dim >= kHeadDim;
        const u32 k_dst = smem_u32(ring + slot * kSlot + ld_row * kPitch + ld_col);
        const u32 v_dst = k_dst + Shape::kKVTile * 2;
#pragma unroll
        for (int pass = 0; pass * kRowsPerPass < kBlockN; ++pass) {
            const int row = ld_row + pass * kRowsPerPass;
            if (kBlockN % kRowsPerPass != 0 && row >= kBlockN) break;
            const int j = key0 + row;
            const bool valid = whole || (j < ld.keys && ld_col < p.head_dim);
            i64 k_off = 0, v_off = 0;
            if (valid) {
                if (p.block_table) {
                    cache_offsets(p, ld.b, ld.start + j, k_off, v_off);
                } else {
                    k_off = static_cast<i64>(j) * p.k_row_stride;
                    v_off = static_cast<i64>(j) * p.v_row_stride;
                }
            }
            const u32 off = pass * kRowsPerPass * kRowBytes;
            if (whole) {
                cp_async_16_l2<kL2Prefetch>(k_dst + off, ld_k + k_off);
                cp_async_16_l2<kL2Prefetch>(v_dst + off, ld_v + v_off);
            } else {
                cp_async_16(k_dst + off, ld_k + k_off, valid);
                cp_async_16(v_dst + off, ld_v + v_off, valid);
            }
        }
    };
    int ld_next = 0, ld_slot = 0;  // items handed to the loader; the ring slot of the next
    auto load_next = [&] {         // the next item into its slot (with its group's Q tile when it starts a segment)
        if (ld_next < n_items) {
            bool starts = ld_next == 0;
            if (starts) {
                set_group();
            } else if (--ld_n < 0) {
                next_group(ld);
                set_group();
                ++ld_seg;
                starts = true;
            }
            if (starts) load_q(ld_seg % kStages);
            load_kv(ld_slot);
            ++ld_next;
            ld_slot = ld_slot + 1 == kStages ? 0 : ld_slot + 1;
        }
        cp_async_commit();  // committed even when empty, so group counting stays uniform
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) load_next();

    // ---- the compute side: segment after segment ----
    const u32 q_lane = smem_u32(q_smem) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;
    const u32 k_lane = smem_u32(ring) + (warp * kWarpN + (lane & 7) + (lane >> 4) * 8) * kRowBytes
                       + ((lane >> 3) & 1) * 16;
    const u32 v_lane = smem_u32(ring) + Shape::kKVTile * 2
                       + (warp * kWarpN + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;
    Cursor cu = first;
    int it = 0, slot = 0;
    for (int seg = 0; it < n_items; ++seg) {
        if (seg > 0) next_group(cu);
        const int hkv = cu.gl / p.row_blocks, r0 = (cu.gl % p.row_blocks) * kRows;
        const int keys = cu.keys, offset = keys - p.seqlen_q;  // query i's diagonal key: i + offset
        const int j0 = cu.j, seg_len = min(cu.blocks - j0, n_items - it);
        const DecodeRows<kMTiles> rows(p, cu.b, hkv, r0, g, keys, offset);
        float o_acc[kMTiles][kNTilesO][4];
        float m[kMTiles][2], l[kMTiles][2];
        zero_acc(o_acc);
        softmax_init(m, l);
        const u32 q_seg = q_lane + (seg % kStages) * Shape::kQTile * 2;
        int n = cu.blocks - 1 - j0;  // the item's block
        for (int k = 0; k < seg_len; ++k, --n) {
            // this item's block (and its segment's Q tile) landed; the barrier also frees the
            // slot of the item before for the load below
            cp_async_wait<kStages - 2>();
            __syncthreads();
            attend_block<kMTiles, kWarpN, kHeadDim, kRowBytes, Elem>(
                p, rows, r0, g, t, offset, n * kBlockN, warp, (n + 1) * kBlockN > keys, q_seg,
                k_lane + slot * kSlot * 2, v_lane + slot * kSlot * 2, o_acc, m, l, load_next);
            slot = slot + 1 == kStages ? 0 : slot + 1;
        }
        it += seg_len;
        cu.j = j0 + seg_len - 1;
        // ---- the segment ends: the warps' merge over its last item's slot, then O or the partial ----
        const int last_slot = slot == 0 ? kStages - 1 : slot - 1;
        __syncthreads();  // every warp is done with the slot
        const int rows_valid = min(kRows, p.group * p.seqlen_q - r0);
        const bool whole = j0 == 0 && j0 + seg_len == cu.blocks;  // the whole group in this segment
        const int piece_slot = 2 * c + (seg == 0 ? 0 : 1);
        const int b = cu.b;
        merge_warps<Shape, kMergePitch>(
            p, reinterpret_cast<float*>(ring + last_slot * kSlot), o_acc, m, l, tid, warp, g, t, rows_valid,
            [] { __syncthreads(); },
            [&](int r, int col, const float (&o4)[4], float inv_l, float m_row, float l_row) {
                const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
                if (whole) {
                    u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride + col;
                    *reinterpret_cast<u32x2*>(o) = u32x2{pack2<Elem>(o4[0] * inv_l, o4[1] * inv_l),
                                                         pack2<Elem>(o4[2] * inv_l, o4[3] * inv_l)};
                    if (col == 0 && p.lse != nullptr)
                        p.lse[(b * p.nheads + h) * p.seqlen_q + qi] = softmax_lse(m_row, l_row, p.softmax_scale);
                } else {
                    float* o = p.o_partial + (static_cast<i64>(piece_slot) * kRows + r) * p.head_dim_rounded + col;
                    *reinterpret_cast<f32x4*>(o) = f32x4{o4[0] * inv_l, o4[1] * inv_l, o4[2] * inv_l, o4[3] * inv_l};
                    if (col == 0)
                        p.lse_partial[piece_slot * kRows + r] = l_row == 0.f ? neg_inf() : m_row * p.softmax_scale + logf(l_row);
                }
            });
        if (whole) continue;  // the next item's barrier orders the merge's reads before the slot's next load
        // ---- a piece: the last of the group's CTAs to finish merges the pieces ----
        const int w_first = row_prefix[b] + cu.gl * cu.blocks;  // the group's first item
        const int c_first = owner(w_first), pieces = owner(w_first + cu.blocks - 1) - c_first + 1;
        __syncthreads();  // release: the partial stores, before thread 0's acq_rel count (kLightFence)
        if (tid == 0) {
            int* counter = p.split_counters + b * per_row + cu.gl;
            const bool last = atom_add_acq_rel_gpu(counter, 1) == pieces - 1;
            if (last) *counter = 0;  // every piece has counted: back to 0 for the next call
            *last_flag = last;
        }
        __syncthreads();
        if (!*last_flag) continue;  // acquire: thread 0's count, then the barrier (kLightFence)
        // piece s is CTA c_first + s's: its range's first segment (slot 2c), but for s = 0 the
        // last one (2c + 1) when that CTA's range began before the group
        const bool first_later = static_cast<int>(static_cast<i64>(c_first) * total / ctas) < w_first;
        for (int r = warp; r < rows_valid; r += kWarps) {
            const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
            combine_pieces<kHeadDim, Elem, true, true, kStreamPerLane>(
                p, (b * p.nheads + h) * p.seqlen_q + qi, lane, pieces,
                [&](int s) { return p.lse_partial + (2 * (c_first + s) + (s == 0 && first_later)) * kRows + r; },
                [&](int s) {
                    return p.o_partial
                           + (static_cast<i64>(2 * (c_first + s) + (s == 0 && first_later)) * kRows + r) * p.head_dim_rounded;
                });
        }
    }
}

// ---- decode_splitkv_regs' kCluster merge: the group's splits in one cluster ----------------------
// The CTAs of a cluster are the kCluster splits of one (batch, KV head, row block); each holds its
// split's normalized O (o_smem [kRows][kHeadDim]) and LSE (lse_smem [kRows], -inf: no keys) in its
// shared memory, written before a cluster barrier. CTA c (its rank) merges the columns
// kW · c .. kW · c + kW - 1 (kW = kHeadDim / kCluster) of every row, one warp per row, as
// combine_row does: lane l reads split s = l / (kW / 4)'s LSE and its 4 columns kW · c + 4 · (l % (kW / 4))
// from CTA s (one 16-byte DSMEM load; kHeadDim / 4 lanes in all), and the max, the sum of the
// weights and the weighted O are reduced over the split bits of the lane index (xor kW / 4 .. 16).
// The lanes of split 0 store the columns; CTA 0 stores the row's LSE.
template <int kHeadDim, class Elem, int kCluster, int kRows>
__device__ __forceinline__ void cluster_merge(const DecodeParams& p, const float* o_smem, const float* lse_smem, int b,
                                              int hkv, int r0, int rows_valid, int warp, int lane, int warps) {
    constexpr int kW = kHeadDim / kCluster, kLanes = kW / 4;  // columns of this CTA, lanes per split
    const u32 rank = cluster_ctarank();
    const int s = lane / kLanes, c = static_cast<int>(rank) * kW + 4 * (lane % kLanes);
    for (int r = warp; r < rows_valid; r += warps) {
        float lse_s = neg_inf(), x[4] = {0.f, 0.f, 0.f, 0.f};
        if (s < kCluster) {
            lse_s = ld_shared_cluster_f32(mapa_shared(smem_u32(lse_smem + r), static_cast<u32>(s)));
            ld_shared_cluster_f32x4(x, mapa_shared(smem_u32(o_smem + r * kHeadDim + c), static_cast<u32>(s)));
        }
        float lse_max = lse_s;
#pragma unroll
        for (int d = kLanes; d < 32; d *= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, d));
        float sum = lse_max == neg_inf() ? 0.f : expf(lse_s - lse_max);  // exp(-inf) = 0: a split without keys
#pragma unroll
        for (int d = kLanes; d < 32; d *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
        const float lse = sum > 0.f ? lse_max + logf(sum) : pos_inf();
        const float wt = sum > 0.f && lse_s != neg_inf() ? expf(lse_s - lse) : 0.f;
        float acc[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = wt == 0.f ? 0.f : wt * x[e];  // (a split without keys: O unset)
#pragma unroll
        for (int d = kLanes; d < 32; d *= 2)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], d);
        const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
        if (s == 0) {
            u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride + c;
            *reinterpret_cast<u32x2*>(o) = u32x2{pack2<Elem>(acc[0], acc[1]), pack2<Elem>(acc[2], acc[3])};
        }
        if (rank == 0 && lane == 0 && p.lse != nullptr) p.lse[(b * p.nheads + h) * p.seqlen_q + qi] = lse;
    }
}

// ---- decode_splitkv_regs: K and V straight into registers, no shared-memory ring ---------------
// decode_splitkv's work (one CTA per (split, KV head · row block, batch), the split's equal run of
// the row's blocks of kBlockN = kWarps · kWarpN keys, from the top) with each warp streaming its
// kWarpN keys of every block by 16-byte loads straight into registers, as cuDNN's decode kernel
// does: no cp.async, no shared-memory ring, no barrier until the warps' merge. The next block's
// loads are issued before the current block's math (two register sets), so every warp keeps a
// block of K and V in flight.
//
// The mma runs transposed, Sᵀ = K Qᵀ and Oᵀ += Vᵀ Pᵀ (m16n8k16): the keys and the head dim are
// the 16-row M side, the kRows = 8 · kRowTiles packed query rows (GQA packing as decode_splitkv)
// the 8-column N side. A decode CTA has a few query rows (4 at 32:8 heads), so N = 8 wastes half
// of what M = 16 rows of queries would, and Oᵀ takes kHeadDim / 4 registers per row tile.
//   Sᵀ: per 16-key tile, A = K (key g and g + 8 of lane (g, t)); the k order inside a k16 step is
//       free as long as Q's B fragment uses the same, so lane t takes the head-dim columns
//       32·i + 8·t .. + 7 (i < kHeadDim / 32) of its two keys: one 16-byte load each, 64
//       contiguous bytes of a key row per 4 lanes. Step c's A fragment is registers 2·(c % 2) and
//       + 1 of load c / 2 (pairs of columns), Q's B fragment the same pairs of Q's row g.
//   Pᵀ: Sᵀ's C fragment (key g / g + 8, query rows 2t, 2t + 1) packed to 16 bits is one 8 x 8
//       matrix per 8 keys; movmatrix.trans makes it Oᵀ's B fragment (keys 2t, 2t + 1, row g).
//   Vᵀ: A = Vᵀ (16 head-dim rows x 16 keys): lane (g, t) loads keys 2t, 2t + 1, 2t + 8, 2t + 9,
//       columns 64·h + 8·g .. + 7 of each (h < kHeadDim / 64; 128 contiguous bytes of a key row
//       per 8 lanes), and its list of columns u = 8·h + e (e < 8) gives m tile mt the rows
//       u = mt (fragment row g) and u = kHeadDim / 16 + mt (row g + 8). A register holds two keys
//       of one column: prmt pairs the halves of two keys' registers.
//   Oᵀ: lane (g, t) holds query rows 2t, 2t + 1 at its columns u (64·(u / 8) + 8·g + u % 8).
// The online softmax runs per query row over the keys: a row's 16 scores of a tile lie on the 8
// lanes of one t (keys g, g + 8), so its max is reduced over lanes 4, 8, 16 apart; l stays
// per lane until the end. O is rescaled only when some row's max grew (a warp vote).
// Keys past the row's end, and masked keys, read a clamped valid cache row (never out of bounds,
// always finite) and get P = 0. Paged caches: a 16-key tile spans at most two pages (page sizes
// are multiples of 16); its two page ids are read from block_table a block ahead, so no K/V load
// waits on a table read.
// The warps' merge (merge_rows) and the fused combine's count (kLightFence as decode_splitkv) end
// the CTA as in decode_splitkv. Needs the real head dim to equal kHeadDim (64 or 128).
//   kRowTiles  8-row tiles of packed query rows per CTA (1, 2)
//   kLoadHint  the K/V loads' cache hints (ld_kv_16: 0 plain, 1 L1::no_allocate + L2::256B, 2 also evict-first,
//              3 L1::no_allocate, 4 L2::256B, 5 evict-first)
//   kEarlyPrefetch  before cache_seqlens is read, the warp prefetches into L1 the rows of the
//              split's first block as it would be were the row full (keys = the capacity: then the
//              block is the same, and the loads after the length's round trip hit L1); contiguous
//              caches without cache_batch_idx, cache_leftpad or a left window only (false: none)
//   kAhead     (0: none; 2..) with each block's register loads, the warp prefetches the rows of the
//              block kAhead iterations later (its first kAhead blocks at the start), so a short
//              split's blocks are all requested from its start: contiguous whole blocks only
//   kAheadL1   kAhead's prefetches into L1 (true) or L2 (false)
//   kEarlyBlocks  (kEarlyPrefetch) how many of the split's top blocks it prefetches (1, 2, 3); with kOrder
//              1 or 2 the split's first blocks under the interleave instead (2: those after the block its
//              early loads hold), which do not depend on the row's length
//   kOrder     the split's blocks: 0 one run of the row's blocks, from the top down; 1 interleaved,
//              split s takes blocks s, s + splits, ... upwards (a split's first block does not
//              depend on the row's length); 2 as 1, and where that first block is known before
//              cache_seqlens arrives (contiguous caches without cache_batch_idx, cache_leftpad or
//              a left window) its loads are issued first, kept if the row holds the whole block
//   kCluster   (0: none) the group's splits are one thread-block cluster of kCluster CTAs (num_splits =
//              kCluster, launched with that cluster dimension: cuflash.launch): each CTA keeps its split's
//              normalized O and LSE in its shared memory, and after a cluster barrier CTA c merges
//              the columns kHeadDim / kCluster · c .. + kHeadDim / kCluster - 1 of every row from all
//              the splits' shared memory (distributed shared memory), so the merge makes no global
//              round trip, needs no count of finished splits and runs on every CTA at once (no
//              fused_combine)
//   kPageTable (paged caches; 0: none) the page ids the CTA reads, staged in shared memory once
//              (kPageIds entries): a block table row of at most kPageIds pages is read whole before
//              cache_seqlens arrives, a longer row's slice that the split reads (its top kPageIds pages)
//              after; then a block's page ids come from shared memory, so no K/V load waits on a
//              global table read queued behind the previous block's loads (ids outside the slice are
//              read from block_table as without). With kEarlyPrefetch, as soon as the ids are staged
//              each warp prefetches into L1 the rows of the kEarlyBlocks blocks after the two its
//              registers load first (the contiguous prefetch's deeper start, for pages; any kOrder)
//              2: as 1, the whole row staged always (the host checks that it fits kPageIds): every page id
//              comes from shared memory. Where an id may come from a global read, the block's loads wait
//              on it, and ptxas gives that read the K/V loads' scoreboard: so the K/V loads issued before
//              it are waited for too (sm_90a SASS, session 31)
//   kPdl       (sm_90; 0: none) launched as a programmatic dependent of the stream's previous kernel
//              (cuflash.launch): the CTA may start while that kernel still runs, so every thread waits for
//              it (grid_dependency_wait) before its first global read or write; before the wait only index
//              math and kEarlyPrefetch's rows as L2 prefetches (the L2 is the coherence point; an L1 line
//              fetched early could be stale), the L1 prefetch after it as without. The stream's next kernel
//              may be scheduled (launch_dependents) 1: right after the wait, 2: after the K/V loop; 3: as 1, and
//              the L2 prefetch before the wait without kEarlyPrefetch too (its blocks, kEarlyBlocks of them; no L1 prefetch)
//   kStaged    (0: none; 1..4; contiguous caches, paged ones run the plain loop) past its two register sets each
//              warp keeps kStaged more of its blocks in flight by 16-byte cp.asyncs into its own shared-memory
//              ring (each lane the chunks its registers take), read back into the register sets; no kAhead,
//              kOrder 2 or kCluster. Off in the heuristic: slower than the plain loop on the H100 (session 27)
//   kSpec      (0: none; 1, 2: kOrder 2 only) kOrder 2's early loads, then Q's, are issued before cache_seqlens and
//              cache_leftpad are read, and those reads stay after them (ld_ordered_s32): without it the compiler
//              hoists the length's load and its uses (the split's range) above the early loads, which then wait
//              for the length's round trip as the plain ones do. With kPdl the early loads still follow the wait:
//              the stream's previous kernel may write the cache (decode_append, or the caller's own kernel).
//              2: as 1, and the early loads' and Q's addresses (parameters only) are computed before that wait
//              (computed_before), so with kPdl the loads follow the wait at once
//   kPageShift (paged caches; 0: none) the page size is a power of two (the host checks): a position's page index
//              is a shift instead of a signed division by p.page_size (each a reciprocal and its fix-ups)
template <int kWarps, int kWarpN, int kRowTiles, int kHeadDim, class Elem, bool kFusedCombine, bool kLightFence,
          int kLoadHint, bool kEarlyPrefetch = false, int kAhead = 0, bool kAheadL1 = false, int kOrder = 0,
          int kEarlyBlocks = 1, int kCluster = 0, int kPageTable = 0, int kPdl = 0, int kStaged = 0, int kSpec = 0,
          int kPageShift = 0>
__global__ void __launch_bounds__(kWarps * 32)
decode_splitkv_regs(const DecodeParams p) {
    constexpr int kThreads = kWarps * 32, kBlockN = kWarps * kWarpN, kRows = 8 * kRowTiles;
    constexpr int kTiles = kWarpN / 16;       // 16-key tiles per warp per block
    constexpr int kKLoads = kHeadDim / 32;    // 16-byte K loads per key per lane
    constexpr int kVLoads = kHeadDim / 64;    // 16-byte V loads per key per lane
    constexpr int kKSteps = kHeadDim / 16;    // k16 steps of Sᵀ
    constexpr int kOTiles = kHeadDim / 16;    // 16-row m tiles of Oᵀ
    constexpr int kMergePitch = kHeadDim + 4; // words
    static_assert(kHeadDim == 64 || kHeadDim == 128, "decode_splitkv_regs: head dim 64 or 128");
    static_assert(kWarpN % 16 == 0 && kWarpN * kHeadDim <= 2048, "decode_splitkv_regs: 16-key tiles, two register sets of at most 64 registers");
    static_assert(kRowTiles == 1 || kRowTiles == 2, "1 or 2 row tiles of 8 packed query rows");
    static_assert(kAhead == 0 || (kAhead >= 2 && kAhead <= 8), "kAhead: 0 (none) or 2..8 blocks");
    static_assert(kOrder >= 0 && kOrder <= 2, "kOrder: 0, 1 or 2");
    static_assert(kEarlyBlocks >= 1 && kEarlyBlocks <= 3, "kEarlyBlocks: 1, 2 or 3");
    static_assert(kCluster == 0 || (!kFusedCombine && kCluster >= 2 && kCluster <= 16 && kHeadDim % (4 * kCluster) == 0),
                  "kCluster: 2..16 CTAs, each merging whole 4-column groups, without the fused combine");
    static_assert(kPageTable >= 0 && kPageTable <= 2, "kPageTable: 0 (none), 1 or 2");
    static_assert(kPdl >= 0 && kPdl <= 3, "kPdl: 0 (none), 1, 2 or 3");
    static_assert(kStaged >= 0 && kStaged <= 4 && (kStaged == 0 || (kAhead == 0 && kOrder != 2 && kCluster == 0)),
                  "kStaged: 0 (none) or 1..4 blocks, without kAhead, kOrder 2 or kCluster");
    static_assert(kSpec == 0 || ((kSpec == 1 || kSpec == 2) && kOrder == 2), "kSpec: 0 (none), 1 or 2, with kOrder 2");
    static_assert(kPageShift == 0 || kPageShift == 1, "kPageShift: 0 (none) or 1");
    constexpr int kPageIds = 2048;                  // kPageTable: staged page ids (8 KB)
    constexpr int kIdsPerThread = kPageIds / kThreads;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* merge_smem = reinterpret_cast<float*>(smem_raw);  // [kWarps][kRows][kMergePitch], m, l
    int* last_flag = reinterpret_cast<int*>(merge_smem + kWarps * kRows * (kMergePitch + 2));
    // kCluster: the split's normalized O [kRows][kHeadDim] and LSE [kRows], after the merge flag's 16 bytes
    float* cluster_o = reinterpret_cast<float*>(last_flag + 4);
    float* cluster_lse = cluster_o + kRows * kHeadDim;
    // kPageTable: the staged page ids, after the cluster's O and LSE (kCluster) or the merge flag
    int* page_ids = reinterpret_cast<int*>(cluster_o + (kCluster ? kRows * (kHeadDim + 1) : 0));

    const int split = blockIdx.x, b = blockIdx.z;
    const int hkv = blockIdx.y / p.row_blocks, r0 = (blockIdx.y % p.row_blocks) * kRows;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int rows_valid = min(kRows, p.group * p.seqlen_q - r0);
    // kStaged: each warp's kStaged ring slots of one K/V block, after the page ids (kPageTable) or the above;
    // lane l's 16-byte chunk c of a slot at [c][l] (kChunks chunks: its K loads, then its V loads)
    constexpr int kChunks = kTiles * (2 * kKLoads + 4 * kVLoads);
    u32x4* stage_ring = reinterpret_cast<u32x4*>(page_ids + (kPageTable ? kPageIds : 0)) + warp * kStaged * kChunks * 32 + lane;
    // kSpec: this lane's rows of the early block (`split`, tile 0: K key g, V key 2t) and of Q, from the
    // parameters only (kSpec 2: computed before the wait below)
    const u16* spec_k = nullptr;
    const u16* spec_v = nullptr;
    const u16* spec_q[kRowTiles];
    if constexpr (kSpec > 0) {
        const int row_b = min(b, p.num_pages - 1);
        const i64 pos0 = split * kBlockN + warp * kWarpN;
        spec_k = static_cast<const u16*>(p.k_cache) + row_b * p.k_batch_stride + hkv * p.k_head_stride
                 + (pos0 + g) * p.k_row_stride + 8 * t;
        spec_v = static_cast<const u16*>(p.v_cache) + row_b * p.v_batch_stride + hkv * p.v_head_stride
                 + (pos0 + 2 * t) * p.v_row_stride + 8 * g;
        const u16* q_base = static_cast<const u16*>(p.q_rot ? p.q_rot : p.q);
        const i64 qh_stride = p.q_rot ? p.head_dim : p.q_head_stride;
        const i64 qr_stride = p.q_rot ? static_cast<i64>(p.nheads) * p.head_dim : p.q_row_stride;
        const i64 qb_stride = p.q_rot ? qr_stride * p.seqlen_q : p.q_batch_stride;
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt) {
            const int pr = r0 + 8 * rt + g, qi = pr / p.group, h = hkv * p.group + pr % p.group;
            spec_q[rt] = q_base + b * qb_stride + qi * qr_stride + h * qh_stride + 8 * t;
        }
        if constexpr (kSpec == 2) {
            computed_before(spec_k);
            computed_before(spec_v);
#pragma unroll
            for (int rt = 0; rt < kRowTiles; ++rt) computed_before(spec_q[rt]);
        }
    }
    if constexpr (kPdl > 0) {
        if constexpr (kEarlyPrefetch || kPdl == 3) {
            // kEarlyPrefetch's rows (the block below) into L2 before the wait: an L1 line fetched before the
            // previous kernel has finished could be stale, an L2 line cannot (the L2 is the coherence point)
            if (!p.block_table && !p.cache_batch_idx && !p.cache_leftpad && p.window_left < 0) {
                constexpr int kLines = kHeadDim / 64;   // 128-byte lines per K (V) row
                const int n_blocks = p.capacity / kBlockN;
                const int per = (n_blocks + p.num_splits - 1) / p.num_splits;
                const int n = min(n_blocks, (split + 1) * per) - 1;
                const u16* kp = static_cast<const u16*>(p.k_cache) + b * p.k_batch_stride + hkv * p.k_head_stride;
                const u16* vp = static_cast<const u16*>(p.v_cache) + b * p.v_batch_stride + hkv * p.v_head_stride;
#pragma unroll
                for (int j = 0; j < kEarlyBlocks; ++j) {
                    const int blk = kOrder == 0 ? n - j : split + (j + (kOrder == 2 ? 1 : 0)) * p.num_splits;
                    if (kOrder == 0 ? blk < split * per : blk >= n_blocks) break;
#pragma unroll
                    for (int x = lane; x < kWarpN * kLines; x += 32) {   // the warp's kWarpN rows, lane by lane
                        const i64 pos = blk * kBlockN + warp * kWarpN + x / kLines;
                        prefetch_l2(kp + pos * p.k_row_stride + 64 * (x % kLines));
                        prefetch_l2(vp + pos * p.v_row_stride + 64 * (x % kLines));
                    }
                }
            }
        }
        grid_dependency_wait();   // q, the cache (appends), lengths, tables, workspace, counters, o: others' data
        if constexpr (kPdl == 1 || kPdl == 3) launch_dependents();
    }
    if constexpr (kEarlyPrefetch) {
        if (!p.block_table && !p.cache_batch_idx && !p.cache_leftpad && p.window_left < 0) {
            // the split's top block of a full row (keys = capacity, start 0): its rows into L1
            const int n_blocks = p.capacity / kBlockN;  // whole blocks only: no clamp
            const int per = (n_blocks + p.num_splits - 1) / p.num_splits;
            const int n = min(n_blocks, (split + 1) * per) - 1;
            const u16* kp = static_cast<const u16*>(p.k_cache) + b * p.k_batch_stride + hkv * p.k_head_stride + 8 * t;
            const u16* vp = static_cast<const u16*>(p.v_cache) + b * p.v_batch_stride + hkv * p.v_head_stride + 8 * g;
            // block n - j's rows of this warp (kEarlyBlocks > 1: the blocks after it, as the split's run goes down)
#pragma unroll
            for (int j = 0; j < kEarlyBlocks; ++j) {
                int pos0;
                if constexpr (kOrder == 0) {
                    if (n - j < split * per) break;
                    pos0 = (n - j) * kBlockN + warp * kWarpN;
                } else {
                    // kOrder 1, 2: the split's first blocks split, split + splits, ... (2: after the
                    // one its early loads hold), the same in every row that reaches them
                    const int blk = split + (j + (kOrder == 2 ? 1 : 0)) * p.num_splits;
                    if (blk >= n_blocks) break;
                    pos0 = blk * kBlockN + warp * kWarpN;
                }
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
#pragma unroll
                        for (int i = 0; i < kKLoads; i += 2)  // a 128-byte line holds two lanes' loads
                            prefetch_l1(kp + static_cast<i64>(pos0 + 16 * tile + g + 8 * q) * p.k_row_stride + 32 * i);
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
                    for (int q = 0; q < 4; ++q)
#pragma unroll
                        for (int h = 0; h < kVLoads; ++h)
                            prefetch_l1(vp + static_cast<i64>(pos0 + 16 * tile + 2 * t + (q & 1) + 8 * (q >> 1)) * p.v_row_stride
                                        + 64 * h);
            }
        }
    }
    // kSpec: Q's loads issued right after the early K/V loads (before cache_seqlens is read); the fragments
    // are taken from q_early where Q's B fragments are built below
    u32 q_early[kRowTiles][kKLoads][4];
    auto load_q_early = [&]() {
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int i = 0; i < kKLoads; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) q_early[rt][i][e] = 0u;
                ld_kv_16_if<0>(q_early[rt][i], spec_q[rt] + 32 * i, 8 * rt + g < rows_valid);
            }
    };
    // kOrder 2: block `split` (the split's first under kOrder's interleave when no left window
    // cuts the row) loaded before the length is known, into (k_e, v_e)
    u32 k_e[kTiles][2][kKLoads][4], v_e[kTiles][4][kVLoads][4];
    bool early = false;
    if constexpr (kOrder == 2) {
        early = !p.block_table && !p.cache_batch_idx && !p.cache_leftpad && p.window_left < 0
                && (split + 1) * kBlockN <= p.capacity;
        if constexpr (kSpec > 0) {   // the same rows from spec_k, spec_v, by predicated loads: no branch
            const u64 policy_e = kLoadHint == 2 || kLoadHint == 5 ? l2_policy_evict_first()
                                 : kLoadHint == 6 ? l2_policy_evict_last() : 0;
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
                for (int q = 0; q < 2; ++q)
#pragma unroll
                    for (int i = 0; i < kKLoads; ++i) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) k_e[tile][q][i][e] = 0u;
                        ld_kv_16_if<kLoadHint>(k_e[tile][q][i], spec_k + (16 * tile + 8 * q) * p.k_row_stride + 32 * i,
                                               early, policy_e);
                    }
#pragma unroll
                for (int q = 0; q < 4; ++q)
#pragma unroll
                    for (int h = 0; h < kVLoads; ++h) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) v_e[tile][q][h][e] = 0u;
                        ld_kv_16_if<kLoadHint>(v_e[tile][q][h],
                                               spec_v + (16 * tile + (q & 1) + 8 * (q >> 1)) * p.v_row_stride + 64 * h,
                                               early, policy_e);
                    }
            }
        } else if (early) {
            const u64 policy_e = kLoadHint == 2 || kLoadHint == 5 ? l2_policy_evict_first()
                                 : kLoadHint == 6 ? l2_policy_evict_last() : 0;
            const int row_b = min(b, p.num_pages - 1);
            const u16* kp = static_cast<const u16*>(p.k_cache) + row_b * p.k_batch_stride + hkv * p.k_head_stride + 8 * t;
            const u16* vp = static_cast<const u16*>(p.v_cache) + row_b * p.v_batch_stride + hkv * p.v_head_stride + 8 * g;
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile) {
                const i64 pos0 = split * kBlockN + warp * kWarpN + 16 * tile;
#pragma unroll
                for (int q = 0; q < 2; ++q)
#pragma unroll
                    for (int i = 0; i < kKLoads; ++i)
                        ld_kv_16<kLoadHint>(k_e[tile][q][i], kp + (pos0 + g + 8 * q) * p.k_row_stride + 32 * i, policy_e);
#pragma unroll
                for (int q = 0; q < 4; ++q)
#pragma unroll
                    for (int h = 0; h < kVLoads; ++h)
                        ld_kv_16<kLoadHint>(v_e[tile][q][h],
                                            vp + (pos0 + 2 * t + (q & 1) + 8 * (q >> 1)) * p.v_row_stride + 64 * h, policy_e);
            }
        }
    }
    if constexpr (kSpec > 0) load_q_early();   // Q too before the length's read (kSpec: ordered after these loads)
    // the page index of cache position pos >= 0 (kPageShift: a power-of-two page size, by a shift)
    const int page_shift = kPageShift ? __ffs(p.page_size) - 1 : 0;
    auto page_index = [&](int pos) { return kPageShift ? pos >> page_shift : pos / p.page_size; };
    // kPageTable: a block table row of at most kPageIds pages, read whole before cache_seqlens
    int row_ids[kIdsPerThread];
    const bool whole_table = kPageTable && p.block_table && (kPageTable == 2 || p.block_table_stride <= kPageIds);
    if constexpr (kPageTable > 0) {
        if (whole_table) {
            const int* row = p.block_table + b * p.block_table_stride;
#pragma unroll
            for (int i = 0; i < kIdsPerThread; ++i) {
                const int idx = tid + i * kThreads;
                row_ids[i] = idx < p.block_table_stride ? row[idx] : 0;
            }
        }
    }
    const RowKeys rk = kSpec > 0 ? RowKeys(p, b, true) : RowKeys(p, b);
    const int keys = rk.keys, offset = keys - p.seqlen_q;  // query i's diagonal key: i + offset

    // the visible keys of some row [key_lo, key_hi) and of every row [full_lo, full_hi) of the CTA,
    // and the split's blocks, as decode_splitkv
    const int qi_lo = r0 / p.group, qi_hi = (r0 + rows_valid - 1) / p.group;
    int key_lo = 0, key_hi = keys, full_lo = 0, full_hi = keys;
    if (p.window_left >= 0) {
        key_lo = max(0, qi_lo + offset - p.window_left);
        full_lo = max(0, qi_hi + offset - p.window_left);
    }
    if (p.window_right >= 0) {
        key_hi = min(keys, qi_hi + offset + p.window_right + 1);
        full_hi = min(keys, qi_lo + offset + p.window_right + 1);
    }
    const int n_blocks_row = (keys + kBlockN - 1) / kBlockN;
    const int per_split = (n_blocks_row + p.num_splits - 1) / p.num_splits;
    const int n_begin = max(split * per_split, key_lo / kBlockN);
    const int n_end = min(min(n_blocks_row, (split + 1) * per_split),
                          key_hi <= 0 ? 0 : (key_hi + kBlockN - 1) / kBlockN);
    // kOrder 1, 2: blocks n_first, n_first + splits, ... below n_stop
    const int n_stop = min(n_blocks_row, key_hi <= 0 ? 0 : (key_hi + kBlockN - 1) / kBlockN);
    const int n_lo = key_lo / kBlockN;
    const int n_first = n_lo + ((split - n_lo) % p.num_splits + p.num_splits) % p.num_splits;
    const int n_iters = kOrder ? (n_first < n_stop ? (n_stop - 1 - n_first) / p.num_splits + 1 : 0)
                               : max(n_end - n_begin, 0);

    // Qᵀ's B fragments: row tile rt, k16 step c: b0, b1 = Q[8·rt + g][the column pairs of step c]
    const u16* q_base = static_cast<const u16*>(p.q_rot ? p.q_rot : p.q);
    const i64 qh_stride = p.q_rot ? p.head_dim : p.q_head_stride;
    const i64 qr_stride = p.q_rot ? static_cast<i64>(p.nheads) * p.head_dim : p.q_row_stride;
    const i64 qb_stride = p.q_rot ? qr_stride * p.seqlen_q : p.q_batch_stride;
    u32 q_frag[kRowTiles][kKSteps][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt) {
        const int r = 8 * rt + g, pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
        const u16* q_row = q_base + b * qb_stride + qi * qr_stride + h * qh_stride + 8 * t;
#pragma unroll
        for (int i = 0; i < kKLoads; ++i) {
            u32 x[4] = {0u, 0u, 0u, 0u};
            if constexpr (kSpec > 0) {
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = q_early[rt][i][e];
            } else if (r < rows_valid) ld_kv_16<0>(x, q_row + 32 * i);
            q_frag[rt][2 * i][0] = x[0];
            q_frag[rt][2 * i][1] = x[1];
            q_frag[rt][2 * i + 1][0] = x[2];
            q_frag[rt][2 * i + 1][1] = x[3];
        }
    }
    // this lane's query rows 8·rt + 2t + j: visible keys and ALiBi slope (raw-score units)
    const float inv_scale = 1.f / p.softmax_scale;
    const bool scores_transform = p.softcap > 0.f || p.alibi_slopes != nullptr;
    int row_lo[kRowTiles][2], row_hi[kRowTiles][2], row_qi[kRowTiles][2];
    float row_slope[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int pr = r0 + 8 * rt + 2 * t + j, qi = pr / p.group;
            row_qi[rt][j] = qi;
            row_lo[rt][j] = p.window_left >= 0 ? qi + offset - p.window_left : 0;
            row_hi[rt][j] = p.window_right >= 0 ? min(keys, qi + offset + p.window_right + 1) : keys;
            const int h = min(hkv * p.group + pr % p.group, p.nheads - 1);
            row_slope[rt][j] = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] * inv_scale : 0.f;
        }

    // kPageTable: the row's table entries [ids_lo, ids_lo + ids_n) in page_ids (the whole row, or the
    // top kPageIds pages of the split's blocks), then one CTA barrier
    int ids_lo = 0, ids_n = 0;
    if constexpr (kPageTable > 0) {
        if (p.block_table) {
            if (whole_table) {
                ids_n = static_cast<int>(p.block_table_stride);
#pragma unroll
                for (int i = 0; i < kIdsPerThread; ++i)
                    if (tid + i * kThreads < ids_n) page_ids[tid + i * kThreads] = row_ids[i];
            } else {
                const int first = kOrder ? n_first : n_begin, stop = kOrder ? n_stop : n_end;
                if (stop > first) {
                    const int pg_hi = page_index(rk.start + min(stop * kBlockN, keys) - 1);
                    ids_lo = max(page_index(rk.start + first * kBlockN), pg_hi - kPageIds + 1);
                    ids_n = pg_hi - ids_lo + 1;
                    const int* row = p.block_table + b * p.block_table_stride + ids_lo;
#pragma unroll
                    for (int i = 0; i < kIdsPerThread; ++i) {
                        const int idx = tid + i * kThreads;
                        row_ids[i] = idx < ids_n ? row[idx] : 0;
                    }
#pragma unroll
                    for (int i = 0; i < kIdsPerThread; ++i)
                        if (tid + i * kThreads < ids_n) page_ids[tid + i * kThreads] = row_ids[i];
                }
            }
            __syncthreads();
        }
    }
    // block_table[b][x], staged (kPageTable) or from global memory
    auto page_id = [&](const int* table_row, int x) {
        if constexpr (kPageTable == 2) return page_ids[min(x, kPageIds - 1)];   // the whole row (ids_lo 0)
        if constexpr (kPageTable == 1) {
            if (static_cast<unsigned>(x - ids_lo) < static_cast<unsigned>(ids_n)) return page_ids[x - ids_lo];
        }
        return table_row[x];
    };

    // K/V addresses. Contiguous: the row's base once. Paged: a tile's keys lie on page `page`
    // (the first key's) or the next, whose ids (id_a, id_b) are read a block ahead.
    const u16* k_head = static_cast<const u16*>(p.k_cache) + hkv * p.k_head_stride;
    const u16* v_head = static_cast<const u16*>(p.v_cache) + hkv * p.v_head_stride;
    i64 k_row0 = 0, v_row0 = 0;
    const bool paged = p.block_table != nullptr;
    if (!paged) cache_offsets(p, b, 0, k_row0, v_row0);
    const int* table = paged ? p.block_table + b * p.block_table_stride : nullptr;
    const int last_key = max(keys - 1, 0);
    const u64 policy = kLoadHint == 2 || kLoadHint == 5 ? l2_policy_evict_first()
                       : kLoadHint == 6 ? l2_policy_evict_last() : 0;
    int page_first[kTiles], page_a[kTiles], page_b[kTiles];  // the next block's tiles (paged)
    auto fetch_pages = [&](int n) {  // block n's page ids, into registers
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            const int key0 = n * kBlockN + warp * kWarpN + 16 * tile;
            const int pos0 = rk.start + min(key0, last_key), pos1 = rk.start + min(key0 + 15, last_key);
            const int pg0 = page_index(pos0), pg1 = page_index(pos1);
            page_first[tile] = pg0 * p.page_size;
            page_a[tile] = page_id(table, pg0);
            page_b[tile] = page_id(table, pg1);
        }
    };
    // the cache offsets (k, v) of the tile's key k (0..15)
    auto offsets = [&](int tile, int key0, int k, i64& ko, i64& vo) {
        const int pos = rk.start + min(key0 + k, last_key);
        if (paged) {
            int row = pos - page_first[tile], id = page_a[tile];
            if (row >= p.page_size) {
                row -= p.page_size;
                id = page_b[tile];
            }
            id = min(max(id, 0), p.num_pages - 1);
            ko = id * p.k_batch_stride + row * p.k_row_stride;
            vo = id * p.v_batch_stride + row * p.v_row_stride;
        } else {
            ko = k_row0 + static_cast<i64>(pos) * p.k_row_stride;
            vo = v_row0 + static_cast<i64>(pos) * p.v_row_stride;
        }
    };
    // block n's K and V of this warp into (kr, vr); then (paged) block n - 1's page ids
    // One tile's rows from kp (key g's K) and vp (key 2t's V): the lane's other keys lie at
    // multiples of the row stride (a uniform product), no clamps.
    auto load_tile_rows = [&](const u16* kp, const u16* vp, u32 (&kr)[2][kKLoads][4], u32 (&vr)[4][kVLoads][4]) {
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int i = 0; i < kKLoads; ++i) ld_kv_16<kLoadHint>(kr[q][i], kp + 8 * q * p.k_row_stride + 32 * i, policy);
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int h = 0; h < kVLoads; ++h)
                ld_kv_16<kLoadHint>(vr[q][h], vp + ((q & 1) + 8 * (q >> 1)) * p.v_row_stride + 64 * h, policy);
    };
    // kAhead: block n's rows of this warp, one cache line per lane per K (V) tile: contiguous
    // whole blocks of the split only (a paged block's page ids are not read yet)
    auto prefetch_block = [&](int n) {
        if (paged || (kOrder ? n >= n_stop : n < n_begin) || (n + 1) * kBlockN > keys) return;
        constexpr int kLines = kHeadDim / 64;  // 128-byte lines per key row
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            const int pos = rk.start + n * kBlockN + warp * kWarpN + 16 * tile + (lane / kLines) % 16;
            const u16* kp = k_head + k_row0 + static_cast<i64>(pos) * p.k_row_stride + 64 * (lane % kLines);
            const u16* vp = v_head + v_row0 + static_cast<i64>(pos) * p.v_row_stride + 64 * (lane % kLines);
            if constexpr (kAheadL1) {
                prefetch_l1(kp);
                prefetch_l1(vp);
            } else {
                prefetch_l2(kp);
                prefetch_l2(vp);
            }
        }
    };
    // block n's K and V of this warp into (kr, vr); then (paged) block n - 1's page ids. A block
    // inside the row: one address per tile (paged: a tile on one page; a page size is a multiple
    // of 16, so only a cache_leftpad puts a tile across two); else a clamped address per key.
    auto load_block = [&](int n, u32 (&kr)[kTiles][2][kKLoads][4], u32 (&vr)[kTiles][4][kVLoads][4]) {
        const bool whole = (n + 1) * kBlockN <= keys;
        if constexpr (kAhead > 0) prefetch_block(kOrder ? n + kAhead * p.num_splits : n - kAhead);
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            const int pos0 = rk.start + n * kBlockN + warp * kWarpN + 16 * tile;
            if (whole && !paged) {
                load_tile_rows(k_head + k_row0 + static_cast<i64>(pos0 + g) * p.k_row_stride + 8 * t,
                               v_head + v_row0 + static_cast<i64>(pos0 + 2 * t) * p.v_row_stride + 8 * g,
                               kr[tile], vr[tile]);
                continue;
            }
            const int row0 = pos0 - (paged ? page_first[tile] : 0);
            if (whole && row0 + 15 < p.page_size) {  // paged, the tile on one page
                const int id = min(max(page_a[tile], 0), p.num_pages - 1);
                load_tile_rows(k_head + id * p.k_batch_stride + static_cast<i64>(row0 + g) * p.k_row_stride + 8 * t,
                               v_head + id * p.v_batch_stride + static_cast<i64>(row0 + 2 * t) * p.v_row_stride + 8 * g,
                               kr[tile], vr[tile]);
                continue;
            }
            const int key0 = n * kBlockN + warp * kWarpN + 16 * tile;
#pragma unroll
            for (int q = 0; q < 2; ++q) {  // K: keys g, g + 8
                i64 ko, vo;
                offsets(tile, key0, g + 8 * q, ko, vo);
#pragma unroll
                for (int i = 0; i < kKLoads; ++i) ld_kv_16<kLoadHint>(kr[tile][q][i], k_head + ko + 32 * i + 8 * t, policy);
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // V: keys 2t, 2t + 1, 2t + 8, 2t + 9
                i64 ko, vo;
                offsets(tile, key0, 2 * t + (q & 1) + 8 * (q >> 1), ko, vo);
#pragma unroll
                for (int h = 0; h < kVLoads; ++h) ld_kv_16<kLoadHint>(vr[tile][q][h], v_head + vo + 64 * h + 8 * g, policy);
            }
        }
        if constexpr (kOrder == 0) {
            if (paged && n - 1 >= n_begin) fetch_pages(n - 1);
        } else {
            if (paged && n + p.num_splits < n_stop) fetch_pages(n + p.num_splits);
        }
    };

    float o_acc[kRowTiles][kOTiles][4];
    float m[kRowTiles][2], l[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt) {
#pragma unroll
        for (int mt = 0; mt < kOTiles; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[rt][mt][e] = 0.f;
        m[rt][0] = m[rt][1] = neg_inf();
        l[rt][0] = l[rt][1] = 0.f;
    }

    // block n's math on its registers (kr, vr)
    // masked (a block on a mask's edge or the row's end, or softcap / ALiBi on): the scores'
    // transform and mask; the bulk's blocks run without (attend_any calls it with a constant:
    // two inlined copies of the body)
    auto attend = [&](int n, const u32 (&kr)[kTiles][2][kKLoads][4], const u32 (&vr)[kTiles][4][kVLoads][4],
                      bool masked) {
        float s[kTiles][kRowTiles][4];
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
            for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[tile][rt][e] = 0.f;
#pragma unroll
            for (int c = 0; c < kKSteps; ++c) {
                const int i = c / 2, r = 2 * (c % 2);
                const u32 a[4] = {kr[tile][0][i][r], kr[tile][1][i][r], kr[tile][0][i][r + 1], kr[tile][1][i][r + 1]};
#pragma unroll
                for (int rt = 0; rt < kRowTiles; ++rt) mma_16816<Elem>(s[tile][rt], a, q_frag[rt][c][0], q_frag[rt][c][1]);
            }
        }
        const bool edge = n * kBlockN < full_lo || (n + 1) * kBlockN > full_hi;
        if (masked) {
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
                for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n * kBlockN + warp * kWarpN + 16 * tile + g + 8 * (e >> 1), j = e & 1;
                        float x = s[tile][rt][e];
                        if (scores_transform) {
                            x *= p.softmax_scale;
                            if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
                            x = x * inv_scale - row_slope[rt][j] * fabsf(float(row_qi[rt][j] + offset - key));
                        }
                        if (edge && (key < row_lo[rt][j] || key >= row_hi[rt][j])) x = neg_inf();
                        s[tile][rt][e] = x;
                    }
        }
        // the online softmax per query row (rows 2t, 2t + 1 of each row tile)
        bool grew = false;
        float alpha[kRowTiles][2];
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float m_new = m[rt][j];
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile) m_new = fmaxf(m_new, fmaxf(s[tile][rt][j], s[tile][rt][j + 2]));
#pragma unroll
                for (int d = 4; d <= 16; d *= 2) m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, d));
                const float m_scaled = m_new == neg_inf() ? 0.f : m_new * p.scale_log2;
                alpha[rt][j] = exp2_approx(m[rt][j] * p.scale_log2 - m_scaled);
                grew |= m_new != m[rt][j];
                m[rt][j] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
                    for (int e = j; e < 4; e += 2) {
                        s[tile][rt][e] = exp2_scaled(s[tile][rt][e], p.scale_log2, m_scaled);
                        sum += s[tile][rt][e];
                    }
                l[rt][j] = l[rt][j] * alpha[rt][j] + sum;
            }
        if (__any_sync(0xffffffffu, grew)) {  // warp-uniform
#pragma unroll
            for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
                for (int mt = 0; mt < kOTiles; ++mt) {
                    o_acc[rt][mt][0] *= alpha[rt][0];
                    o_acc[rt][mt][1] *= alpha[rt][1];
                    o_acc[rt][mt][2] *= alpha[rt][0];
                    o_acc[rt][mt][3] *= alpha[rt][1];
                }
        }
        // Oᵀ += Vᵀ Pᵀ per tile
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            u32 pb[kRowTiles][2];
#pragma unroll
            for (int rt = 0; rt < kRowTiles; ++rt) {
                pb[rt][0] = movmatrix_trans(pack2<Elem>(s[tile][rt][0], s[tile][rt][1]));  // keys 0..7
                pb[rt][1] = movmatrix_trans(pack2<Elem>(s[tile][rt][2], s[tile][rt][3]));  // keys 8..15
            }
#pragma unroll
            for (int mt = 0; mt < kOTiles; ++mt) {
                constexpr int kU1 = kOTiles;  // list index of fragment row g + 8: kOTiles + mt
                const int u0 = mt, u1 = kU1 + mt;
                const u32 sel0 = u0 % 2 ? 0x7632u : 0x5410u, sel1 = u1 % 2 ? 0x7632u : 0x5410u;
                const u32 x0a = vr[tile][0][u0 / 8][(u0 % 8) / 2], x0b = vr[tile][1][u0 / 8][(u0 % 8) / 2];
                const u32 x1a = vr[tile][0][u1 / 8][(u1 % 8) / 2], x1b = vr[tile][1][u1 / 8][(u1 % 8) / 2];
                const u32 x2a = vr[tile][2][u0 / 8][(u0 % 8) / 2], x2b = vr[tile][3][u0 / 8][(u0 % 8) / 2];
                const u32 x3a = vr[tile][2][u1 / 8][(u1 % 8) / 2], x3b = vr[tile][3][u1 / 8][(u1 % 8) / 2];
                const u32 a[4] = {prmt(x0a, x0b, sel0), prmt(x1a, x1b, sel1), prmt(x2a, x2b, sel0), prmt(x3a, x3b, sel1)};
#pragma unroll
                for (int rt = 0; rt < kRowTiles; ++rt) mma_16816<Elem>(o_acc[rt][mt], a, pb[rt][0], pb[rt][1]);
            }
        }
    };

    // kPageTable with kEarlyPrefetch: block n's rows of this warp into L1 (one line per lane), at the
    // staged page ids (the blocks after the first two: their loads come a block later)
    auto prefetch_paged = [&](int n) {
        constexpr int kLines = kHeadDim / 64;  // 128-byte lines per key row
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            const int key = n * kBlockN + warp * kWarpN + 16 * tile + (lane / kLines) % 16;
            const int pos = rk.start + min(key, last_key), pg = page_index(pos);
            const int id = min(max(page_id(table, pg), 0), p.num_pages - 1);
            const i64 row = pos - pg * p.page_size;
            prefetch_l1(k_head + id * p.k_batch_stride + row * p.k_row_stride + 64 * (lane % kLines));
            prefetch_l1(v_head + id * p.v_batch_stride + row * p.v_row_stride + 64 * (lane % kLines));
        }
    };

    // two register sets: block it + 1's loads are in flight while block it's math runs
    u32 k_a[kTiles][2][kKLoads][4], v_a[kTiles][4][kVLoads][4];
    u32 k_b[kTiles][2][kKLoads][4], v_b[kTiles][4][kVLoads][4];
    // the blocks the plain loop below runs: none where the staged loop (kStaged) runs them
    const int n_plain = kStaged > 0 && !paged ? 0 : n_iters;
    if constexpr (kOrder == 0) {
        if (n_plain > 0) {
            if (paged) fetch_pages(n_end - 1);
            if constexpr (kAhead > 2) {  // iterations 2 .. kAhead - 1 (the loads of 0 and 1 prefetch kAhead on)
#pragma unroll
                for (int i = 2; i < kAhead; ++i) prefetch_block(n_end - 1 - i);
            }
            load_block(n_end - 1, k_a, v_a);
            if constexpr (kPageTable > 0 && kEarlyPrefetch) {
                if (paged) {
#pragma unroll
                    for (int j = 0; j < kEarlyBlocks; ++j) {
                        if (n_end - 3 - j < n_begin) break;
                        prefetch_paged(n_end - 3 - j);
                    }
                }
            }
        }
    } else {
        if (n_plain > 0) {
            if (paged) fetch_pages(n_first);
            if constexpr (kAhead > 2) {
#pragma unroll
                for (int i = 2; i < kAhead; ++i) prefetch_block(n_first + i * p.num_splits);
            }
            if (early && n_first == split && (split + 1) * kBlockN <= keys) {  // the early loads hold it
                if constexpr (kAhead > 0) prefetch_block(n_first + kAhead * p.num_splits);
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
                    for (int q = 0; q < 2; ++q)
#pragma unroll
                        for (int i = 0; i < kKLoads; ++i)
#pragma unroll
                            for (int e = 0; e < 4; ++e) k_a[tile][q][i][e] = k_e[tile][q][i][e];
#pragma unroll
                    for (int q = 0; q < 4; ++q)
#pragma unroll
                        for (int h = 0; h < kVLoads; ++h)
#pragma unroll
                            for (int e = 0; e < 4; ++e) v_a[tile][q][h][e] = v_e[tile][q][h][e];
                }
            } else {
                load_block(n_first, k_a, v_a);
            }
            if constexpr (kPageTable > 0 && kEarlyPrefetch) {
                if (paged) {
#pragma unroll
                    for (int j = 0; j < kEarlyBlocks; ++j) {
                        if (n_first + (2 + j) * p.num_splits >= n_stop) break;
                        prefetch_paged(n_first + (2 + j) * p.num_splits);
                    }
                }
            }
        }
    }
    auto attend_any = [&](int n, const u32 (&kr)[kTiles][2][kKLoads][4], const u32 (&vr)[kTiles][4][kVLoads][4]) {
        if (scores_transform || n * kBlockN < full_lo || (n + 1) * kBlockN > full_hi) attend(n, kr, vr, true);
        else attend(n, kr, vr, false);
    };
    // kStaged (contiguous caches): the warp's first two blocks load into the register sets as above and its
    // next kStaged blocks into its ring slots by cp.async, all issued at once; block i >= 2 is read from
    // slot (i - 2) % kStaged (each lane reads only the chunks it copied: no barrier), and once its math has
    // consumed those registers the slot takes block i + kStaged. One commit group per slot fill (empty past
    // the split's end), so block i's group is complete when at most kStaged - 1 are in flight.
    if constexpr (kStaged > 0) {
        if (!paged) {
            auto blk = [&](int i) { return kOrder == 0 ? n_end - 1 - i : n_first + i * p.num_splits; };
            // block n's K and V rows of this warp into ring slot `slot`: the addresses load_block reads
            auto stage_block = [&](int n, int slot) {
                u32x4* dst = stage_ring + slot * kChunks * 32;
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile) {
                    u32x4* kd = dst + tile * (2 * kKLoads + 4 * kVLoads) * 32;
                    u32x4* vd = kd + 2 * kKLoads * 32;
                    const int key0 = n * kBlockN + warp * kWarpN + 16 * tile;
#pragma unroll
                    for (int q = 0; q < 2; ++q) {  // K: keys g, g + 8
                        const u16* kp = k_head + k_row0
                                        + static_cast<i64>(rk.start + min(key0 + g + 8 * q, last_key)) * p.k_row_stride + 8 * t;
#pragma unroll
                        for (int i = 0; i < kKLoads; ++i) cp_async_16(smem_u32(kd + (q * kKLoads + i) * 32), kp + 32 * i);
                    }
#pragma unroll
                    for (int q = 0; q < 4; ++q) {  // V: keys 2t, 2t + 1, 2t + 8, 2t + 9
                        const int key = key0 + 2 * t + (q & 1) + 8 * (q >> 1);
                        const u16* vp = v_head + v_row0 + static_cast<i64>(rk.start + min(key, last_key)) * p.v_row_stride + 8 * g;
#pragma unroll
                        for (int h = 0; h < kVLoads; ++h) cp_async_16(smem_u32(vd + (q * kVLoads + h) * 32), vp + 64 * h);
                    }
                }
            };
            // block i (>= 2) from its slot into (kr, vr), once its group has landed
            auto from_ring = [&](int i, u32 (&kr)[kTiles][2][kKLoads][4], u32 (&vr)[kTiles][4][kVLoads][4]) {
                cp_async_wait<kStaged - 1>();
                const u32x4* src = stage_ring + ((i - 2) % kStaged) * kChunks * 32;
#pragma unroll
                for (int tile = 0; tile < kTiles; ++tile) {
                    const u32x4* kd = src + tile * (2 * kKLoads + 4 * kVLoads) * 32;
                    const u32x4* vd = kd + 2 * kKLoads * 32;
#pragma unroll
                    for (int q = 0; q < 2; ++q)
#pragma unroll
                        for (int i2 = 0; i2 < kKLoads; ++i2) {
                            const u32x4 x = kd[(q * kKLoads + i2) * 32];
                            kr[tile][q][i2][0] = x.x, kr[tile][q][i2][1] = x.y, kr[tile][q][i2][2] = x.z, kr[tile][q][i2][3] = x.w;
                        }
#pragma unroll
                    for (int q = 0; q < 4; ++q)
#pragma unroll
                        for (int h = 0; h < kVLoads; ++h) {
                            const u32x4 x = vd[(q * kVLoads + h) * 32];
                            vr[tile][q][h][0] = x.x, vr[tile][q][h][1] = x.y, vr[tile][q][h][2] = x.z, vr[tile][q][h][3] = x.w;
                        }
                }
            };
            auto refill = [&](int i) {  // block i's slot, its registers consumed, takes block i + kStaged
                if (i + kStaged < n_iters) stage_block(blk(i + kStaged), (i - 2) % kStaged);
                cp_async_commit();
            };
            if (n_iters > 0) load_block(blk(0), k_a, v_a);
            if (n_iters > 1) load_block(blk(1), k_b, v_b);
#pragma unroll
            for (int j = 0; j < kStaged; ++j) {
                if (2 + j < n_iters) stage_block(blk(2 + j), j);
                cp_async_commit();
            }
            for (int i = 0; i < n_iters; i += 2) {
                if (i >= 2) from_ring(i, k_a, v_a);
                attend_any(blk(i), k_a, v_a);
                if (i >= 2) refill(i);
                if (i + 1 >= n_iters) break;
                if (i + 1 >= 2) from_ring(i + 1, k_b, v_b);
                attend_any(blk(i + 1), k_b, v_b);
                if (i + 1 >= 2) refill(i + 1);
            }
            cp_async_wait<0>();  // the empty groups: nothing in flight past the loop
        }
    }
    if constexpr (kOrder == 0) {
        for (int it = 0; it < n_plain; it += 2) {
            if (it + 1 < n_plain) load_block(n_end - 2 - it, k_b, v_b);
            attend_any(n_end - 1 - it, k_a, v_a);
            if (it + 1 >= n_plain) break;
            if (it + 2 < n_plain) load_block(n_end - 3 - it, k_a, v_a);
            attend_any(n_end - 2 - it, k_b, v_b);
        }
    } else {
        const int S = p.num_splits;
        for (int it = 0; it < n_plain; it += 2) {
            const int n = n_first + it * S;
            if (it + 1 < n_plain) load_block(n + S, k_b, v_b);
            attend_any(n, k_a, v_a);
            if (it + 1 >= n_plain) break;
            if (it + 2 < n_plain) load_block(n + 2 * S, k_a, v_a);
            attend_any(n + S, k_b, v_b);
        }
    }

    if constexpr (kPdl == 2) launch_dependents();

    // the warps' merge: each warp's rows 8·rt + 2t + j, its columns u, into shared memory
    {
        float* o_merge = merge_smem;
        float* m_merge = o_merge + kWarps * kRows * kMergePitch;
        float* l_merge = m_merge + kWarps * kRows;
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = 8 * rt + 2 * t + j;
                float l_row = l[rt][j];
#pragma unroll
                for (int d = 4; d <= 16; d *= 2) l_row += __shfl_xor_sync(0xffffffffu, l_row, d);
                if (g == 0) {
                    m_merge[warp * kRows + r] = m[rt][j];
                    l_merge[warp * kRows + r] = l_row;
                }
                float* o_row = o_merge + (warp * kRows + r) * kMergePitch;
#pragma unroll
                for (int mt = 0; mt < kOTiles; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int u = half * kOTiles + mt;
                        o_row[64 * (u / 8) + 8 * g + u % 8] = o_acc[rt][mt][2 * half + j];
                    }
            }
    }
    __syncthreads();
    const bool direct = p.num_splits == 1;
    const int rows_all = p.batch * p.nheads * p.seqlen_q;
    merge_rows<kWarps, kRows, kHeadDim, kMergePitch, kThreads>(
        p, merge_smem, tid, rows_valid, [&](int r, int col, const float (&o4)[4], float inv_l, float m_row, float l_row) {
            const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
            const int row_id = (b * p.nheads + h) * p.seqlen_q + qi;
            if constexpr (kCluster > 0) {   // the split's normalized O and LSE stay in this CTA's shared memory
                *reinterpret_cast<f32x4*>(cluster_o + r * kHeadDim + col) =
                    f32x4{o4[0] * inv_l, o4[1] * inv_l, o4[2] * inv_l, o4[3] * inv_l};
                if (col == 0) cluster_lse[r] = l_row == 0.f ? neg_inf() : m_row * p.softmax_scale + logf(l_row);
            } else if (direct) {
                u16* o = static_cast<u16*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride + h * p.o_head_stride + col;
                *reinterpret_cast<u32x2*>(o) = u32x2{pack2<Elem>(o4[0] * inv_l, o4[1] * inv_l),
                                                     pack2<Elem>(o4[2] * inv_l, o4[3] * inv_l)};
                if (col == 0 && p.lse != nullptr) p.lse[row_id] = softmax_lse(m_row, l_row, p.softmax_scale);
            } else {
                float* o = p.o_partial + (static_cast<i64>(split) * rows_all + row_id) * p.head_dim_rounded + col;
                *reinterpret_cast<f32x4*>(o) = f32x4{o4[0] * inv_l, o4[1] * inv_l, o4[2] * inv_l, o4[3] * inv_l};
                if (col == 0)
                    p.lse_partial[static_cast<i64>(split) * rows_all + row_id] =
                        l_row == 0.f ? neg_inf() : m_row * p.softmax_scale + logf(l_row);
            }
        });

    if constexpr (kCluster > 0) {
        cluster_sync();   // every split's partial written (release) and visible to the cluster (acquire)
        cluster_merge<kHeadDim, Elem, kCluster, kRows>(p, cluster_o, cluster_lse, b, hkv, r0, rows_valid, warp, lane,
                                                      kWarps);
        cluster_sync();   // no CTA leaves while another still reads its shared memory
        return;
    }
    if constexpr (kFusedCombine) {
        if (direct) return;
        // the last split of the (batch, KV head, row block) to finish merges the group, as in
        // decode_splitkv (kLightFence: the barrier, then thread 0's acq_rel count)
        if constexpr (!kLightFence) __threadfence();
        __syncthreads();
        if (tid == 0) {
            int* counter = p.split_counters + (static_cast<i64>(b) * gridDim.y + blockIdx.y);
            const bool last = atom_add_acq_rel_gpu(counter, 1) == p.num_splits - 1;
            if (last) *counter = 0;  // every split has counted: back to 0 for the next call
            *last_flag = last;
        }
        __syncthreads();
        if (!*last_flag) return;
        if constexpr (!kLightFence) __threadfence();
        for (int r = warp; r < rows_valid; r += kWarps) {
            const int pr = r0 + r, qi = pr / p.group, h = hkv * p.group + pr % p.group;
            combine_row<kHeadDim, Elem, true, true>(p, (b * p.nheads + h) * p.seqlen_q + qi, lane);
        }
    }
}

// ---- decode_combine: merge the splits of each row (flash-decoding) -------------------------
// One warp per row R = (b·nheads + h)·seqlen_q + i, 4 warps per CTA (combine_row above).
// kPdl: as decode_append's (the main kernel's partials are read after the wait). kEarly: combine_row's
// (the first batch of partial-O loads before the LSE loads: one L2 round trip, not two, up to 16 splits).
template <int kHeadDim, class Elem, bool kPdl = false, bool kEarly = false>
__global__ void __launch_bounds__(128)
decode_combine(const DecodeParams p) {
    if constexpr (kPdl) {
        grid_dependency_wait();
        launch_dependents();
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int rows_all = p.batch * p.nheads * p.seqlen_q;
    const int row_id = blockIdx.x * 4 + warp;
    if (row_id >= rows_all) return;
    combine_row<kHeadDim, Elem, false, kEarly>(p, row_id, lane);
}

}  // namespace cuflash
