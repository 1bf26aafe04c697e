// fa2_bwd.cu: FlashAttention-2 backward, exact gradients on tensor cores (sm_80 and newer).
//
// Given dO and the forward's O and LSE, with P = exp(S·scale - LSE) recomputed from Q, K:
//   D   = rowsum(dO ∘ O)                  (fa2_bwd_preprocess)
//   dV  = Pᵀ dO
//   dP  = dO Vᵀ,   dS = P ∘ (dP - D)
//   dK  = scale · dSᵀ Q,   dQ = scale · dS K
//
// Three launches per backward:
//   1. fa2_bwd_preprocess  D, LSE·log2(e) into padded fp32 workspace; zero dQ accumulators
//   2. fa2_bwd             one CTA per K/V block K_j, V_j of one (head, batch); loops over the
//                          Q blocks Q_i that see it, keeps dK_j, dV_j in registers, adds each
//                          dQ_i contribution to an fp32 accumulator in global memory
//   3. fa2_bwd_convert_dq  dQ = scale · accumulator, in the input dtype
//      fa2_bwd_reduce_dkv  (GQA / MQA only) dK, dV summed over the query heads of a K/V head
//
// The mask is mask.cuh's, P's exp2 is softmax.cuh's, the products are gemm.cuh's.
//
// Warp layout of fa2_bwd: the warps form kWarps / kQSplit key groups; a group owns kMTiles·16
// whole keys of the block (rows of K_j, V_j, dK_j, dV_j), so the transposed products come straight
// out of the mma accumulators. With kQSplit = 1 a warp is a whole group:
//   Sᵀ  = K_j Q_iᵀ     (keys x queries)   A = K_j rows,  B = Q_i
//   Pᵀ  = exp2(Sᵀ·scale·log2e - LSE_i·log2e)
//   dV_j += Pᵀ dO_i                        A = Pᵀ straight from the accumulators, B = dO_i (.trans)
//   dPᵀ = V_j dO_iᵀ                        A = V_j rows,  B = dO_i
//   dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
//   dK_j += dSᵀ Q_i                        A = dSᵀ from the accumulators, B = Q_i (.trans)
//   dQ_i += dS K_j                         the sum runs over all keys, i.e. over all warps: dSᵀ
//                                          goes through shared memory once, then every warp
//                                          takes whole 16x16 tiles of dQ_i
// With kQSplit = 2 the two warps of a group split the queries of Sᵀ, dPᵀ (half the Q_i, dO_i
// fragments each) and the head-dim columns of dK_j, dV_j; Pᵀ joins dSᵀ in shared memory, and
// dV_j, dK_j read their A operands (this group's keys x all Br queries) from there. Fewer
// ldmatrix per mma (the product per warp is squarer) for one more tile written to shared memory.
//
// Template parameters (cuflash/families/fa2_bwd.py BwdConfig mirrors and validates them):
//   kBr       query rows of a Q block: a multiple of 16 (32, 64, 128)
//   kBc       keys of the K/V block of one CTA: a multiple of 16·kWarps (64, 128)
//   kWarps    warps per CTA (4, 8); each group of kQSplit warps owns kBc·kQSplit / kWarps keys
//   kStages   Q/dO blocks in flight in shared memory, >= 2
//   kDSplit   head-dim slices: kDSplit CTAs share a K/V block, each accumulating kHeadDim /
//             kDSplit columns of dK, dV, dQ (and recomputing Sᵀ, dPᵀ); 2 fits head dim 256
//             into registers, 1 otherwise
//   kQSplit   warps per key group (1, 2): they split the queries of Sᵀ, dPᵀ and the columns of
//             dK, dV (see above)
//   kHeadDim  compile-time head dim (multiple of 16, <= 256); params.head_dim may be smaller
//   Elem      bf16 or fp16; all accumulation in fp32
//   kCausal   bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q)
//   kDeterministic  dQ contributions are added in key-block order (a per-Q-block turn
//             counter), so dQ is bitwise reproducible; costs waiting
//   kVarlen   variable-length batch (varlen.cuh), in all four kernels: the batch index is a
//             sequence of cu_seqlens_q/k, grids are sized for the longest sequence and blocks
//             past a sequence's end exit at once; the fp32 workspace is indexed by tokens
//   kDropout  attention dropout (Algorithm 4): the forward's keep mask Z is regenerated
//             (philox.cuh), dV_j += (P ∘ Z / (1 - p))ᵀ dO_i and
//             dS = P ∘ (dP ∘ Z / (1 - p) - D); D = rowsum(dO ∘ O) is unchanged
//   kWindow, kSoftcap, kAlibi  as in fa2_fwd.cu: the band mask (mask.cuh BandMask) skips the Q
//             blocks outside a K/V block's band; P is recomputed through the same score
//             modifiers (score.cuh), and dS gains softcap's factor 1 - tanh²
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

// ---------------------------------------------------------------------------------------
// 1. preprocess: a CTA of kPrepThreads threads owns kPrepRows query rows (padded rows included).
//    D[i] = Σ_d dO[i,d]·O[i,d]; lse_log2[i] = LSE[i]·log2(e) (+inf past seqlen_q, so P = 0
//    there); dq_accum[i, :] = 0. CTA (0, h, b) also clears the dQ turn counters of (h, b).
//    dO is read through the caller's strides (do_src_*: any, e.g. the stride-0 broadcast that
//    out.sum().backward() gives); when the main kernel cannot read it in place (the head dim
//    not contiguous, or strides not whole 16-byte chunks) the preprocess also writes it to
//    dout_copy, contiguous, which the main kernel reads instead (no separate copy launch).
//
//    The kernel only moves bytes (dO, O in; the dQ accumulator's zeros out), so it is shaped for
//    bytes in flight: the accumulator rows of the CTA are one contiguous span, zeroed by 16-byte
//    stores, and where O and dO allow 16-byte loads (rows_16b) four threads share a row, each
//    loading whole 8-column chunks. Either way D is summed in one fixed order, that of a warp
//    per row: "lane" L (0..31) adds columns L, L+32, L+64, ... in turn, then the 32 lane sums
//    meet in a butterfly (xor 16, 8, 4, 2, 1). In the 16-byte path thread g (0..3) of a row
//    loads chunks g, g+4, g+8, ... (columns 8g + 32k ..): element e of its chunks is lane 8g+e's
//    column sequence, so it holds the sums of lanes 8g..8g+7 with no exchange; the butterfly's
//    xor 16 and 8 flip g's bits (shuffles), xor 4, 2, 1 flip e's (registers). The same D to the bit.
constexpr int kPrepThreads = 128;
constexpr int kPrepRows = 32;                          // query rows per CTA (divides every Br)
constexpr int kPrepRowThreads = kPrepThreads / kPrepRows;  // 16-byte path: threads per row
constexpr int kPrepGroupChunks = 128 / (8 * kPrepRowThreads);  // 16-byte path: chunks per thread in flight
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kPrepRowThreads == 4, "the 16-byte path's butterfly maps lane bits 4, 3 to the thread of a row");

// Whether O and dO (as the caller passed it) can be read in 16-byte chunks: contiguous head dim
// of whole chunks, every row start 16-byte aligned, and dO not being copied (the copy path
// writes dout_copy column by column).
__device__ __forceinline__ bool rows_16b(const BwdParams& p) {
    const i64 strides = p.o_batch_stride | p.o_row_stride | p.o_head_stride | p.do_src_batch_stride
                        | p.do_src_row_stride | p.do_src_head_stride;
    const unsigned long long base = reinterpret_cast<unsigned long long>(p.o)
                                    | reinterpret_cast<unsigned long long>(p.dout);
    return p.dout_copy == nullptr && p.do_src_col_stride == 1 && p.head_dim % 8 == 0 && strides % 8 == 0
           && base % 16 == 0;
}

// kZeroDq (appended; true: every kernel before it): false for sm90_bwd's dq_first, whose main
// kernel stores each Q block's first dQ part instead of adding it (the accumulator is not zeroed
// here; its per-Q-block tickets, dq_semaphore, are, as the deterministic turn counters)
template <class Elem, bool kVarlen = false, bool kZeroDq = true>
__global__ void __launch_bounds__(kPrepThreads)
fa2_bwd_preprocess(const BwdParams p) {
    const int head = blockIdx.y, batch = blockIdx.z;
    const i64 bh = static_cast<i64>(batch) * p.nheads + head;
    if (p.dq_semaphore != nullptr && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < p.seqlen_q_rounded / 16; i += blockDim.x)
            p.dq_semaphore[bh * (p.seqlen_q_rounded / 16) + i] = 0;
    }
    // This sequence's rows (varlen.cuh); varlen: only its own workspace rows, its length
    // rounded up to 128 (every Br), of the grid's seqlen_q_rounded.
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    const int seqlen_q = seq.seqlen_q;
    const int rows_end = kVarlen ? min(p.seqlen_q_rounded, (seqlen_q + 127) / 128 * 128) : p.seqlen_q_rounded;
    const int row0 = blockIdx.x * kPrepRows;
    if (row0 >= rows_end) return;
    const int rows = min(kPrepRows, rows_end - row0);
    const i64 ws0 = ws_row_offset<kVarlen>(p, batch, head, seq) + row0;  // the CTA's first workspace row
    const i64 lse0 = lse_offset<kVarlen>(p, batch, head, seq) + row0;
    const auto o_row = [&](int row) {
        return static_cast<const u16*>(p.o) + batch * p.o_batch_stride + (seq.q_start + row) * p.o_row_stride
               + head * p.o_head_stride;
    };
    const auto d_o_row = [&](int row) {
        return static_cast<const u16*>(p.dout) + batch * p.do_src_batch_stride
               + (seq.q_start + row) * p.do_src_row_stride + head * p.do_src_head_stride;
    };
    // The CTA's dQ accumulator rows, one contiguous span (head_dim_rounded is a multiple of 16).
    const auto zero_dq = [&]() {
        u32x4* dq = reinterpret_cast<u32x4*>(p.dq_accum + ws0 * p.head_dim_rounded);
        for (int i = threadIdx.x; i < rows * p.head_dim_rounded / 4; i += kPrepThreads) dq[i] = u32x4{0, 0, 0, 0};
    };
    const auto store_row = [&](int r, float D) {
        p.D[ws0 + r] = D;
        p.lse_log2[ws0 + r] = row0 + r < seqlen_q ? p.lse[lse0 + r] * kLog2e : pos_inf();
    };

    if (rows_16b(p)) {
        const int r = threadIdx.x / kPrepRowThreads, g = threadIdx.x % kPrepRowThreads;
        const int row = row0 + r;
        // chunk k of this thread: columns 32k + 8g .. 32k + 8g + 7; a group of kPrepGroupChunks
        // chunks is loaded before any is used (bytes in flight), head dims past 128 take two groups
        const bool live = r < rows && row < seqlen_q;
        const u16* o = o_row(row);
        const u16* d_o = d_o_row(row);
        float lane_D[8] = {};  // the sums of "lanes" 8g .. 8g + 7
        for (int k0 = 0; k0 == 0 || 8 * (kPrepRowThreads * k0 + g) < p.head_dim; k0 += kPrepGroupChunks) {
            u32x4 o_c[kPrepGroupChunks], d_o_c[kPrepGroupChunks];
#pragma unroll
            for (int k = 0; k < kPrepGroupChunks; ++k) {
                const int col = 8 * (kPrepRowThreads * (k0 + k) + g);
                if (live && col < p.head_dim) {
                    o_c[k] = *reinterpret_cast<const u32x4*>(o + col);
                    d_o_c[k] = *reinterpret_cast<const u32x4*>(d_o + col);
                }
            }
            if (kZeroDq && k0 == 0) zero_dq();
#pragma unroll
            for (int k = 0; k < kPrepGroupChunks; ++k) {
                if (live && 8 * (kPrepRowThreads * (k0 + k) + g) < p.head_dim) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const u32 o2 = (&o_c[k].x)[e / 2], d_o2 = (&d_o_c[k].x)[e / 2];
                        lane_D[e] += to_float<Elem>(static_cast<u16>(o2 >> (16 * (e % 2))))
                                     * to_float<Elem>(static_cast<u16>(d_o2 >> (16 * (e % 2))));
                    }
                }
            }
        }
        // the butterfly: xor 16 (g ^ 2), xor 8 (g ^ 1) across the row's threads, then xor 4, 2, 1 in registers
#pragma unroll
        for (int e = 0; e < 8; ++e) lane_D[e] += __shfl_xor_sync(0xffffffffu, lane_D[e], 2);
#pragma unroll
        for (int e = 0; e < 8; ++e) lane_D[e] += __shfl_xor_sync(0xffffffffu, lane_D[e], 1);
#pragma unroll
        for (int e = 0; e < 4; ++e) lane_D[e] += lane_D[e + 4];
#pragma unroll
        for (int e = 0; e < 2; ++e) lane_D[e] += lane_D[e + 2];
        if (g == 0 && r < rows) store_row(r, lane_D[0] + lane_D[1]);
    } else {
        // any strides: a warp per row, lane L adding columns L, L+32, ... (the order above)
        if constexpr (kZeroDq) zero_dq();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int r = warp; r < rows; r += kPrepThreads / 32) {
            const int row = row0 + r;
            float D = 0.f;
            if (row < seqlen_q) {
                const u16* o = o_row(row);
                const u16* d_o = d_o_row(row);
                u16* copy = p.dout_copy == nullptr ? nullptr
                            : static_cast<u16*>(p.dout_copy) + batch * p.do_batch_stride
                              + (seq.q_start + row) * p.do_row_stride + head * p.do_head_stride;
                for (int c = lane; c < p.head_dim; c += 32) {
                    const u16 d_o_c = d_o[c * p.do_src_col_stride];
                    if (copy != nullptr) copy[c] = d_o_c;
                    D += to_float<Elem>(o[c]) * to_float<Elem>(d_o_c);
                }
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) D += __shfl_xor_sync(0xffffffffu, D, offset);
            if (lane == 0) store_row(r, D);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 2. main kernel

// dQ_i (rows x cols 16x16 tiles) is split over the warps as a grid of wm x (warps / wm)
// equal blocks: the wm (a power of 2) that loads the fewest fragments, rows/wm + cols/wn,
// per 16 keys. 0 when no grid divides the tiles evenly.
__host__ __device__ constexpr int dq_warp_rows(int warps, int rows, int cols) {
    int best = 0, best_loads = 1 << 30;
    for (int wm = 1; wm <= warps; wm *= 2) {
        const int wn = warps / wm;
        if (warps % wm || rows % wm || cols % wn) continue;
        if (rows / wm + cols / wn < best_loads) best = wm, best_loads = rows / wm + cols / wn;
    }
    return best;
}

// dst[g + 8h][c] += one 16x16 mma result (two n8 halves, C layout) in fp32 at `row_stride`
// floats per row. Atomics are the cost of dQ: make them 16 bytes wide. A thread holds columns
// 2t, 2t+1 of both 8-column halves; lanes t and t^1 swap halves, so that even t owns
// columns 2t..2t+3 of the first half and odd t columns 2t+6..2t+9 of the second.
__device__ __forceinline__ void red_add_tile_16x16(float* dst, int row_stride, const float (&acc)[2][4],
                                                   int g, int t) {
    const bool even = (t & 1) == 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8
        const float give0 = even ? acc[1][2 * half] : acc[0][2 * half];
        const float give1 = even ? acc[1][2 * half + 1] : acc[0][2 * half + 1];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        float v[4];
        if (even) {
            v[0] = acc[0][2 * half], v[1] = acc[0][2 * half + 1], v[2] = got0, v[3] = got1;
        } else {
            v[0] = got0, v[1] = got1, v[2] = acc[1][2 * half], v[3] = acc[1][2 * half + 1];
        }
        const int col = even ? 2 * t : 8 + 2 * (t - 1);
        red_add_f32x4(dst + static_cast<i64>(g + 8 * half) * row_stride + col, v);
    }
}

template <int kBr, int kBc, int kWarps, int kStages, int kDSplit, int kQSplit, int kHeadDim>
struct BwdShape {
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kKeyGroups = kWarps / kQSplit;
    static constexpr int kMTiles = kBc / (16 * kKeyGroups);  // 16-key mma tiles per warp
    static constexpr int kWarpQueries = kBr / kQSplit;      // queries of Sᵀ, dPᵀ per warp
    static constexpr int kNTilesS = kWarpQueries / 8;       // 8-query tiles of Sᵀ, dPᵀ per key row
    static constexpr int kDCols = kHeadDim / kDSplit;       // head-dim columns of dK, dV, dQ per CTA
    static constexpr int kWarpDCols = kDCols / kQSplit;     // head-dim columns of dK, dV per warp
    static constexpr int kNTilesD = kWarpDCols / 8;         // 8-column tiles of dK, dV per key row
    static constexpr int kPitch = kHeadDim + 8;          // row pitch of Q, K, V, dO tiles, elements
    static constexpr int kDsPitch = kBr + 8;             // row pitch of the dSᵀ tile, elements
    static constexpr int kKVTile = kBc * kPitch;
    static constexpr int kQTile = kBr * kPitch;
    // dQ_i = dS K_j split into 16x16 output tiles, dealt round-robin to the warps
    static constexpr int kDqRowTiles = kBr / 16, kDqColTiles = kDCols / 16;
    static constexpr int kDqTiles = kDqRowTiles * kDqColTiles;
    static constexpr int kDqTilesPerWarp = (kDqTiles + kWarps - 1) / kWarps;
    static constexpr int kDqWarpsM = dq_warp_rows(kWarps, kDqRowTiles, kDqColTiles);  // 0: none fits
    static constexpr int kDqWarpsN = kDqWarpsM > 0 ? kWarps / kDqWarpsM : 0;

    static_assert(kWarps >= 1 && kWarps <= 16, "warps must be in 1..16");
    static_assert(kQSplit >= 1 && kWarps % kQSplit == 0, "qsplit must divide warps");
    static_assert(kBc % (16 * kKeyGroups) == 0,
                  "Bc must be a multiple of 16 * warps / qsplit: each key group owns whole 16-key mma tiles");
    static_assert(kWarpQueries % 16 == 0 && (kDCols / 16) % kQSplit == 0,
                  "qsplit must split Br and the head-dim slice into whole 16-wide tiles");
    static_assert(kBr % 16 == 0 && kBr <= 128,
                  "Br must be a multiple of 16, at most 128 (the workspace row padding)");
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256,
                  "kHeadDim must be a multiple of 16, at most 256");
    static_assert(kStages >= 2, "stages must be >= 2: one Q/dO block computed while the next loads");
    static_assert(kDSplit >= 1 && (kHeadDim / 16) % kDSplit == 0,
                  "dsplit must divide kHeadDim / 16: every slice is whole 16-column tiles");
};

template <int kBr, int kBc, int kWarps, int kStages, int kDSplit, int kQSplit, int kHeadDim, class Elem,
          bool kCausal, bool kDeterministic, bool kVarlen = false, bool kDropout = false, bool kWindow = false,
          bool kSoftcap = false, bool kAlibi = false>
__global__ void __launch_bounds__(kWarps * 32)
fa2_bwd(const BwdParams p) {
    using Shape = BwdShape<kBr, kBc, kWarps, kStages, kDSplit, kQSplit, kHeadDim>;
    using Mask = BandMask<kCausal, kWindow>;  // the mask kind (mask.cuh)
    constexpr int kThreads = Shape::kThreads, kMTiles = Shape::kMTiles;
    constexpr int kNTilesS = Shape::kNTilesS, kNTilesD = Shape::kNTilesD;
    constexpr int kPitch = Shape::kPitch, kRowBytes = kPitch * 2, kDsRowBytes = Shape::kDsPitch * 2;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* k_smem = reinterpret_cast<u16*>(smem_raw);                 // [Bc][kPitch]
    u16* v_smem = k_smem + Shape::kKVTile;                           // [Bc][kPitch]
    u16* q_smem = v_smem + Shape::kKVTile;                           // [kStages][Br][kPitch]
    u16* do_smem = q_smem + kStages * Shape::kQTile;                 // [kStages][Br][kPitch]
    u16* ds_smem = do_smem + kStages * Shape::kQTile;                // [Bc][kDsPitch]  dSᵀ
    u16* p_smem = ds_smem + kBc * Shape::kDsPitch;                   // [Bc][kDsPitch]  Pᵀ (kQSplit > 1)
    constexpr int kPTiles = kQSplit > 1 ? 1 : 0;
    float* lse_smem = reinterpret_cast<float*>(p_smem + kPTiles * kBc * Shape::kDsPitch);  // [kStages][Br]
    float* D_smem = lse_smem + kStages * kBr;                        // [kStages][Br]

    // Launch order (a 1-D grid of batch·nheads·kv_ctas blocks, kv_ctas = K/V blocks x kDSplit):
    // the (batch, head) pairs in groups of p.head_group; within a group, K/V block 0 of every
    // pair, then block 1, ... Under the causal mask the first K/V blocks are the longest (every
    // Q block sees them), so each group runs longest first and its short blocks fill the tail;
    // the host sizes groups to a few waves of CTAs, few enough pairs that their Q, dO and dQ
    // stay in L2, and enough that the dQ atomics of concurrent CTAs spread over several heads.
    const int pairs = p.batch * p.nheads, kv_ctas = gridDim.x / pairs;
    const int group = blockIdx.x / (p.head_group * kv_ctas);
    const int group_pairs = min(p.head_group, pairs - group * p.head_group);
    const int in_group = blockIdx.x - group * p.head_group * kv_ctas;
    const int kv_index = in_group / group_pairs;              // n_block·kDSplit + slice
    const int pair = group * p.head_group + in_group % group_pairs;
    const int n_block = kv_index / kDSplit, col0 = (kv_index % kDSplit) * Shape::kDCols;
    const int head = pair % p.nheads, batch = pair / p.nheads;
    const int head_kv = head / (p.nheads / p.nheads_kv);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int key0 = n_block * kBc;                                   // first key of K_j
    const int warp_key0 = (warp / kQSplit) * kMTiles * 16;            // this warp's keys within K_j
    const int warp_q0 = (warp % kQSplit) * Shape::kWarpQueries;       // its queries of Sᵀ, dPᵀ in Q_i
    const int warp_c0 = col0 + (warp % kQSplit) * Shape::kWarpDCols;  // its first column of dK, dV
    const i64 bh = static_cast<i64>(batch) * p.nheads + head;

    // This sequence's rows and lengths (varlen.cuh; fixed lengths: 0, 0, seqlen_q, seqlen_k).
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    if (kVarlen && key0 >= seq.seqlen_k) return;  // a K/V block past this sequence's end
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const i64 ws0 = ws_row_offset<kVarlen>(p, batch, head, seq);

    const u16* q_gmem = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                        + seq.q_start * p.q_row_stride;
    const void* dout = p.dout_copy != nullptr ? p.dout_copy : p.dout;  // preprocess: why
    const u16* do_gmem = static_cast<const u16*>(dout) + batch * p.do_batch_stride
                         + head * p.do_head_stride + seq.q_start * p.do_row_stride;
    const float* lse_gmem = p.lse_log2 + ws0;
    const float* D_gmem = p.D + ws0;
    float* dq_accum = p.dq_accum + ws0 * p.head_dim_rounded;
    Dropout dropout{};  // kDropout: the forward's keep mask and scale
    if constexpr (kDropout)
        dropout = Dropout::load(p.rng_state, p.dropout_threshold, p.dropout_scale);

    // Q blocks that see K_j: all of them, or under the causal mask those from the first row
    // i with key0 <= i + seqlen_k - seqlen_q on; under a window also only those up to the last
    // row whose band reaches K_j.
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    const int m_blocks = (seqlen_q + kBr - 1) / kBr;
    const int m_block_min = mask.template q_block_begin<kBr>(key0);
    const int m_block_max = mask.template q_block_end<kBr, kBc>(key0, m_blocks);
    const int n_iters = max(0, m_block_max - m_block_min);
    const ScoreMod<kSoftcap, kAlibi> score(p.softcap_in, p.softcap_out, p.alibi_slopes,
                                           p.alibi_batch_stride, batch, head, p.softmax_scale,
                                           seqlen_q, seqlen_k);

    // Q_i, dO_i, LSE_i, D_i of the it-th iteration (Q blocks in increasing order).
    auto load_q_do = [&](int it) {
        const int m_block = m_block_min + it, slot = it % kStages;
        const i64 row0 = static_cast<i64>(m_block) * kBr;
        const int rows_valid = seqlen_q - m_block * kBr;
        load_tile_g2s<kBr, kHeadDim, kPitch, kThreads>(q_smem + slot * Shape::kQTile,
                                                      q_gmem + row0 * p.q_row_stride,
                                                      p.q_row_stride, rows_valid, p.head_dim, tid);
        load_tile_g2s<kBr, kHeadDim, kPitch, kThreads>(do_smem + slot * Shape::kQTile,
                                                      do_gmem + row0 * p.do_row_stride,
                                                      p.do_row_stride, rows_valid, p.head_dim, tid);
        // the workspace rows are padded to seqlen_q_rounded: whole 16-byte chunks, all valid
        if (tid < kBr / 4)
            cp_async_16(smem_u32(lse_smem + slot * kBr + 4 * tid), lse_gmem + row0 + 4 * tid, true);
        else if (tid < kBr / 2)
            cp_async_16(smem_u32(D_smem + slot * kBr + 4 * (tid - kBr / 4)),
                        D_gmem + row0 + 4 * (tid - kBr / 4), true);
    };
    static_assert(kBr / 2 <= kThreads, "one thread per 16-byte chunk of LSE_i and D_i");

    // Prologue: K_j, V_j and the first Q/dO block in group 0, then kStages - 2 more blocks.
    {
        const int keys_valid = seqlen_k - key0;
        load_tile_g2s<kBc, kHeadDim, kPitch, kThreads>(
            k_smem, static_cast<const u16*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride
                        + (seq.k_start + key0) * p.k_row_stride, p.k_row_stride, keys_valid, p.head_dim, tid);
        load_tile_g2s<kBc, kHeadDim, kPitch, kThreads>(
            v_smem, static_cast<const u16*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride
                        + (seq.k_start + key0) * p.v_row_stride, p.v_row_stride, keys_valid, p.head_dim, tid);
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_iters) load_q_do(s);
        cp_async_commit();
    }

    // Thread (g, t) holds keys warp_key0 + 16·mt + g + 8·half ([mt][..][2·half + e]) and, of
    // Sᵀ / dPᵀ, query columns warp_q0 + 8·nt + 2t + e; of dK / dV, head-dim columns
    // warp_c0 + 8·nt + 2t + e.
    float dk_acc[kMTiles][kNTilesD][4];
    float dv_acc[kMTiles][kNTilesD][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTilesD; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[mt][nt][e] = dv_acc[mt][nt][e] = 0.f;

    // ldmatrix lane addresses (byte offsets in shared memory), as in fa2_fwd.cu:
    // A operand, rows of K_j / V_j (keys x head dim)
    const int a_row = warp_key0 + (lane & 7) + ((lane >> 3) & 1) * 8, a_col_bytes = (lane >> 4) * 16;
    const u32 k_a = smem_u32(k_smem) + a_row * kRowBytes + a_col_bytes;
    const u32 v_a = smem_u32(v_smem) + a_row * kRowBytes + a_col_bytes;
    // A operand, rows of Pᵀ / dSᵀ (keys x queries; kQSplit > 1)
    const u32 p_a = smem_u32(p_smem) + a_row * kDsRowBytes + a_col_bytes;
    const u32 ds_at = smem_u32(ds_smem) + a_row * kDsRowBytes + a_col_bytes;
    // B operand with n = queries, k = head dim: this warp's rows of Q_i / dO_i as they are (Sᵀ, dPᵀ)
    const u32 b_lane = (warp_q0 + (lane & 7) + (lane >> 4) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;
    // B operand with k = queries (or keys), n = head-dim columns: Q_i / dO_i / K_j transposed;
    // from this CTA's first column (dQ) or this warp's (dK, dV)
    const u32 bt_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16 + col0 * 2;
    const u32 bt_warp_lane = bt_lane + (warp_c0 - col0) * 2;

    // Packed A fragments (keys x this warp's queries) of Pᵀ or dSᵀ into a [Bc][kDsPitch] tile.
    // Register r of fragment (mt, kk) holds keys g + 8·(r % 2), queries 16kk + 2t + 8·(r / 2).
    auto store_t = [&](u16* tile, const u32 (&frag)[kMTiles][kNTilesS / 2][4]) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int kk = 0; kk < kNTilesS / 2; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int key = warp_key0 + mt * 16 + g + 8 * (r % 2);
                    const int query = warp_q0 + kk * 16 + 2 * t + 8 * (r / 2);
                    *reinterpret_cast<u32*>(tile + key * Shape::kDsPitch + query) = frag[mt][kk][r];
                }
    };
    // A operand with m = queries, k = keys: dSᵀ transposed back into dS (dQ)
    const u32 ds_a = smem_u32(ds_smem) + ((lane & 7) + (lane >> 4) * 8) * kDsRowBytes + ((lane >> 3) & 1) * 16;

    for (int it = 0; it < n_iters; ++it) {
        const int m_block = m_block_min + it, slot = it % kStages;
        const int row0 = m_block * kBr;

        // Q_i, dO_i, LSE_i, D_i have landed; every warp is done with iteration it - 1 (its
        // slot, and its reads of dSᵀ in the dQ step), so both may be overwritten below.
        cp_async_wait<kStages - 2>();
        __syncthreads();
        if (it + kStages - 1 < n_iters) load_q_do(it + kStages - 1);
        cp_async_commit();

        const u32 q_b = smem_u32(q_smem + slot * Shape::kQTile) + b_lane;
        const u32 do_b = smem_u32(do_smem + slot * Shape::kQTile) + b_lane;
        const u32 q_bt = smem_u32(q_smem + slot * Shape::kQTile) + bt_warp_lane;
        const u32 do_bt = smem_u32(do_smem + slot * Shape::kQTile) + bt_warp_lane;
        const float* lse_i = lse_smem + slot * kBr + warp_q0;
        const float* D_i = D_smem + slot * kBr + warp_q0;

        // ---- Sᵀ = K_j Q_iᵀ (this warp's keys x Br queries) ----
        float s_acc[kMTiles][kNTilesS][4];
        gemm_rows_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(s_acc, k_a, q_b);

        // ---- Pᵀ = exp2(S'ᵀ·scale·log2e - LSE·log2e), S' = Sᵀ through the score modifiers
        // (softcap keeps its tanh t per element for dS); padded queries have LSE = +inf -> 0 ----
        // Hidden elements get P = 0, only in the ragged blocks and those on the band's edges.
        const bool needs_mask = mask.template needs_mask<kBc, kBr>(row0, n_block);
        float tanh_s[kSoftcap ? kMTiles : 1][kSoftcap ? kNTilesS : 1][4];
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt) {
            const float2 lse = *reinterpret_cast<const float2*>(lse_i + nt * 8 + 2 * t);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float& s = s_acc[mt][nt][e];
                    const int key = key0 + warp_key0 + mt * 16 + g + 8 * (e / 2);
                    const int query = row0 + warp_q0 + nt * 8 + 2 * t + e % 2;
                    if (ScoreMod<kSoftcap, kAlibi>::kOn)
                        s = score.apply(s, query, key, tanh_s[kSoftcap ? mt : 0][kSoftcap ? nt : 0][e]);
                    s = exp2_scaled(s, p.scale_log2, e % 2 ? lse.y : lse.x);
                    if (needs_mask) mask.apply(s, query, key, 0.f);
                }
        }

        // ---- dropout: the dropped elements of Pᵀ negated (Pᵀ >= 0, so the sign is ¬Z) ----
        // (kPairs where a warp's 16-key tiles pair up into 32-key blocks: one call per 16 elements;
        // up to head dim 64: at 128 its registers spill the varlen kernel, 68 bytes)
        if constexpr (kDropout)
            dropout.template negate_dropped_transposed<kBc % 32 == 0 && kMTiles % 2 == 0 && kHeadDim <= 64>(
                s_acc, static_cast<int>(bh), key0 + warp_key0, row0 + warp_q0, g, t);

        // ---- dV_j += Pᵀ dO_i (kQSplit > 1: after the barrier, Pᵀ from shared memory) ----
        // (dropout: (Pᵀ ∘ Z) / (1 - p), the positive part of the signed Pᵀ, scaled)
        {
            u32 p_frag[kMTiles][kNTilesS / 2][4];
            if constexpr (kDropout) {
                float pz[kMTiles][kNTilesS][4];
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) pz[mt][nt][e] = fmaxf(s_acc[mt][nt][e], 0.f) * dropout.scale;
                pack_a_frags<kMTiles, kNTilesS / 2, Elem>(p_frag, pz);
            } else {
                pack_a_frags<kMTiles, kNTilesS / 2, Elem>(p_frag, s_acc);
            }
            if constexpr (kQSplit == 1)
                gemm_frags_x_rows_t<kMTiles, kNTilesD, kBr / 16, kRowBytes, Elem>(dv_acc, p_frag, do_bt);
            else
                store_t(p_smem, p_frag);
        }

        // ---- dPᵀ = V_j dO_iᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ - D_i) ----
        float dp_acc[kMTiles][kNTilesS][4];
        gemm_rows_x_rows<kMTiles, kNTilesS, kHeadDim / 16, kRowBytes, Elem>(dp_acc, v_a, do_b);
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt) {
            const float2 D = *reinterpret_cast<const float2*>(D_i + nt * 8 + 2 * t);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float d_row = e % 2 ? D.y : D.x;
                    if constexpr (kDropout) {  // dS = P ∘ (Z ∘ dP / (1 - p) - D), P = |signed Pᵀ|
                        const float s = s_acc[mt][nt][e];
                        const float z = s > 0.f ? dropout.scale : 0.f;
                        dp_acc[mt][nt][e] = fabsf(s) * (dp_acc[mt][nt][e] * z - d_row);
                    } else {
                        dp_acc[mt][nt][e] = s_acc[mt][nt][e] * (dp_acc[mt][nt][e] - d_row);
                    }
                    if (kSoftcap) {  // d(softcap·tanh(x / softcap))/dx = 1 - tanh²
                        const float th = tanh_s[kSoftcap ? mt : 0][kSoftcap ? nt : 0][e];
                        dp_acc[mt][nt][e] *= 1.f - th * th;
                    }
                }
        }

        // ---- dK_j += dSᵀ Q_i (scaled once, in the epilogue); dSᵀ to shared memory for dQ ----
        {
            u32 ds_frag[kMTiles][kNTilesS / 2][4];
            pack_a_frags<kMTiles, kNTilesS / 2, Elem>(ds_frag, dp_acc);
            if constexpr (kQSplit == 1)
                gemm_frags_x_rows_t<kMTiles, kNTilesD, kBr / 16, kRowBytes, Elem>(dk_acc, ds_frag, q_bt);
            store_t(ds_smem, ds_frag);
        }
        __syncthreads();  // all of dSᵀ (and Pᵀ) is in shared memory

        if constexpr (kQSplit > 1) {  // this group's keys x all Br queries, this warp's columns
            gemm_rows_x_rows_t<kMTiles, kNTilesD, kBr / 16, kDsRowBytes, kRowBytes, Elem>(dv_acc, p_a, do_bt);
            gemm_rows_x_rows_t<kMTiles, kNTilesD, kBr / 16, kDsRowBytes, kRowBytes, Elem>(dk_acc, ds_at, q_bt);
        }

        // ---- dQ_i += dS K_j: 16x16 tiles of dQ_i, summed over the Bc keys of K_j ----
        if (kDeterministic) {  // wait for this CTA's turn at this Q block: K/V blocks in order
            // (a lower kv_index of the same pair has a lower block index: resident or done).
            // The K/V blocks that visit this Q block are [kv_block_begin, ...): turns count
            // from the first of them (0 but under a window's left bound).
            int* turn = p.dq_semaphore + bh * (p.seqlen_q_rounded / 16) + m_block;
            const int first = mask.template kv_block_begin<kBr, kBc>(row0) * kDSplit;
            if (tid == 0) while (ld_acquire_gpu(turn) != kv_index - first) {}
            __syncthreads();
        }
        const u32 k_bt = smem_u32(k_smem) + bt_lane;
        float* dq_rows = dq_accum + static_cast<i64>(row0) * p.head_dim_rounded + col0;
        if constexpr (Shape::kDqWarpsM > 0) {
            // The warps tile dQ_i as a kDqWarpsM x kDqWarpsN grid of kTM x kTN blocks of 16x16
            // tiles: per 16 keys a warp loads kTM dS fragments and kTN K fragments for
            // 2·kTM·kTN mma, instead of one of each per 2 mma.
            constexpr int kTM = Shape::kDqRowTiles / Shape::kDqWarpsM;
            constexpr int kTN = Shape::kDqColTiles / Shape::kDqWarpsN;
            const int tm0 = (warp % Shape::kDqWarpsM) * kTM, tn0 = (warp / Shape::kDqWarpsM) * kTN;
            float dq_acc[kTM][kTN][2][4] = {};
#pragma unroll
            for (int kk = 0; kk < kBc / 16; ++kk) {
                u32 a[kTM][4];
#pragma unroll
                for (int i = 0; i < kTM; ++i) ldmatrix_x4_trans(a[i], ds_a + kk * 16 * kDsRowBytes + (tm0 + i) * 32);
#pragma unroll
                for (int j = 0; j < kTN; ++j) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, k_bt + kk * 16 * kRowBytes + (tn0 + j) * 32);
#pragma unroll
                    for (int i = 0; i < kTM; ++i) {
                        mma_16816<Elem>(dq_acc[i][j][0], a[i], b[0], b[1]);
                        mma_16816<Elem>(dq_acc[i][j][1], a[i], b[2], b[3]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < kTM; ++i)
#pragma unroll
                for (int j = 0; j < kTN; ++j)
                    red_add_tile_16x16(dq_rows + (tm0 + i) * 16 * p.head_dim_rounded + (tn0 + j) * 16,
                                       p.head_dim_rounded, dq_acc[i][j], g, t);
        } else {
            // Tile counts that no warp grid divides (e.g. 3 column tiles): deal the 16x16 tiles
            // round-robin, one dS and one K fragment per 2 mma.
#pragma unroll
            for (int i = 0; i < Shape::kDqTilesPerWarp; ++i) {
                const int tile = warp + i * kWarps;
                if (Shape::kDqTiles % kWarps != 0 && tile >= Shape::kDqTiles) break;
                const int mq = tile / Shape::kDqColTiles, dq16 = tile % Shape::kDqColTiles;
                float dq_acc[2][4] = {};
#pragma unroll
                for (int kk = 0; kk < kBc / 16; ++kk) {
                    u32 a[4], b[4];
                    ldmatrix_x4_trans(a, ds_a + kk * 16 * kDsRowBytes + mq * 32);
                    ldmatrix_x4_trans(b, k_bt + kk * 16 * kRowBytes + dq16 * 32);
                    mma_16816<Elem>(dq_acc[0], a, b[0], b[1]);
                    mma_16816<Elem>(dq_acc[1], a, b[2], b[3]);
                }
                red_add_tile_16x16(dq_rows + mq * 16 * p.head_dim_rounded + dq16 * 16,
                                   p.head_dim_rounded, dq_acc, g, t);
            }
        }
        if (kDeterministic) {  // pass the turn on once every thread's additions are visible
            __threadfence();
            __syncthreads();
            if (tid == 0) red_release_add_gpu(p.dq_semaphore + bh * (p.seqlen_q_rounded / 16) + m_block, 1);
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO ----
    // MHA: straight into dk, dv. GQA / MQA: fp32 per query head, summed by fa2_bwd_reduce_dkv.
    const bool grouped = p.nheads != p.nheads_kv;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + warp_key0 + mt * 16 + g + 8 * half;
            if (key >= seqlen_k) continue;
#pragma unroll
            for (int nt = 0; nt < kNTilesD; ++nt) {
                const int col = warp_c0 + nt * 8 + 2 * t;
                const float dk0 = dk_acc[mt][nt][2 * half] * p.softmax_scale;
                const float dk1 = dk_acc[mt][nt][2 * half + 1] * p.softmax_scale;
                const float dv0 = dv_acc[mt][nt][2 * half], dv1 = dv_acc[mt][nt][2 * half + 1];
                if (grouped) {
                    const i64 off = (dkv_row_offset<kVarlen>(p, batch, head, seq) + key) * p.head_dim_rounded + col;
                    *reinterpret_cast<float2*>(p.dk_accum + off) = make_float2(dk0, dk1);
                    *reinterpret_cast<float2*>(p.dv_accum + off) = make_float2(dv0, dv1);
                } else if (col < p.head_dim) {
                    const int tok = seq.k_start + key;
                    u16* dk = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + tok * p.dk_row_stride
                              + head * p.dk_head_stride + col;
                    u16* dv = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + tok * p.dv_row_stride
                              + head * p.dv_head_stride + col;
                    *reinterpret_cast<u32*>(dk) = pack2<Elem>(dk0, dk1);
                    *reinterpret_cast<u32*>(dv) = pack2<Elem>(dv0, dv1);
                }
            }
        }
}

// ---------------------------------------------------------------------------------------
// 3. epilogue kernels: one thread per 8 consecutive head-dim columns of one row (16-byte
//    loads and stores).
constexpr int kEpilogueThreads = 256;

// dQ[b, i, h, :] = scale · dq_accum[b, h, i, :]
template <class Elem, bool kVarlen = false>
__global__ void __launch_bounds__(kEpilogueThreads)
fa2_bwd_convert_dq(const BwdParams p) {
    const int head = blockIdx.y, batch = blockIdx.z;
    const int chunks = p.head_dim / 8;
    const int idx = blockIdx.x * kEpilogueThreads + threadIdx.x;
    const int row = idx / chunks, col = (idx % chunks) * 8;
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    if (row >= seq.seqlen_q) return;
    // 8 floats, 32-byte aligned (head_dim_rounded and col are multiples of 8): two 16-byte loads
    const float4* acc = reinterpret_cast<const float4*>(
        p.dq_accum + (ws_row_offset<kVarlen>(p, batch, head, seq) + row) * p.head_dim_rounded + col);
    const float4 a0 = acc[0], a1 = acc[1];
    const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    u32x4 out;
    u32* words = &out.x;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        words[i] = pack2<Elem>(a[2 * i] * p.softmax_scale, a[2 * i + 1] * p.softmax_scale);
    *reinterpret_cast<u32x4*>(static_cast<u16*>(p.dq) + batch * p.dq_batch_stride
                              + (seq.q_start + row) * p.dq_row_stride + head * p.dq_head_stride + col) = out;
}

// GQA / MQA: dK[b, j, h_kv, :] = Σ over the query heads h of h_kv of dk_accum[b, h, j, :]
// (dK already scaled), the same for dV; summed in head order, so the result is reproducible.
template <class Elem, bool kVarlen = false>
__global__ void __launch_bounds__(kEpilogueThreads)
fa2_bwd_reduce_dkv(const BwdParams p) {
    const int head_kv = blockIdx.y, batch = blockIdx.z;
    const int group = p.nheads / p.nheads_kv;
    const int chunks = p.head_dim / 8;
    const int idx = blockIdx.x * kEpilogueThreads + threadIdx.x;
    const int key = idx / chunks, col = (idx % chunks) * 8;
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    if (key >= seq.seqlen_k) return;
    float dk[8] = {}, dv[8] = {};
    for (int h = head_kv * group; h < (head_kv + 1) * group; ++h) {
        const i64 off = (dkv_row_offset<kVarlen>(p, batch, h, seq) + key) * p.head_dim_rounded + col;
        // 16-byte loads (off is a multiple of 8 floats)
        const float4* dk_h = reinterpret_cast<const float4*>(p.dk_accum + off);
        const float4* dv_h = reinterpret_cast<const float4*>(p.dv_accum + off);
        const float4 k0 = dk_h[0], k1 = dk_h[1], v0 = dv_h[0], v1 = dv_h[1];
        const float dk_add[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
        const float dv_add[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            dk[i] += dk_add[i];
            dv[i] += dv_add[i];
        }
    }
    u32x4 dk_out, dv_out;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        (&dk_out.x)[i] = pack2<Elem>(dk[2 * i], dk[2 * i + 1]);
        (&dv_out.x)[i] = pack2<Elem>(dv[2 * i], dv[2 * i + 1]);
    }
    const int tok = seq.k_start + key;
    *reinterpret_cast<u32x4*>(static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + tok * p.dk_row_stride
                              + head_kv * p.dk_head_stride + col) = dk_out;
    *reinterpret_cast<u32x4*>(static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + tok * p.dv_row_stride
                              + head_kv * p.dv_head_stride + col) = dv_out;
}

}  // namespace cuflash
