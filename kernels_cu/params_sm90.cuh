// params_sm90.cuh: the argument structs of the Hopper (sm_90a) families, same rules as
// params.cuh (cuflash/launch.py mirrors both files: one field per line, the field types of
// params.cuh) plus one more field type, `TmaDesc`: a TMA tensor map (CUtensorMap), 128 bytes,
// 64-byte aligned, built on the host by cuTensorMapEncodeTiled and written into the packed
// params per call (it embeds the tensor's global address). The struct is passed as a
// `const __grid_constant__` kernel parameter, so the kernel hands TMA the address of the map
// in parameter space, with no copy to global memory.
//
// A separate file from params.cuh so that the sm_80 families' rendered source (and with it
// their code hash, which stamps the tuned tables) does not change when a Hopper struct does.
#pragma once
#include "ptx.cuh"
#include "params.cuh"

namespace cuflash {

// A CUtensorMap, opaque to the kernel: 128 bytes, 64-byte aligned as TMA requires.
struct alignas(64) TmaDesc {
    u64 opaque[16];
};

// Forward attention on sm_90a (sm90_fwd). Layouts as FwdParams (elements; last dimension
// contiguous):
//   q, o : (batch, seqlen_q, nheads,    head_dim)
//   k, v : (batch, seqlen_k, nheads_kv, head_dim)
//   lse  : (batch, nheads, seqlen_q), fp32, contiguous, natural log
// q, k, v are read only through their tensor maps (rank 4, innermost first: head_dim, seqlen,
// heads, batch; box 64 columns x BM or BN rows, 128-byte swizzle, out-of-bounds zero fill).
// Their pointers stay because every params struct starts with its per-call pointers: the launch
// plan writes them, and the family's call_writer encodes the maps from them.
struct Sm90FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    TmaDesc tma_q;         // box 64 x BM
    TmaDesc tma_k;         // box 64 x BN
    TmaDesc tma_v;         // box 64 x BN
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int seqlen_k;
    int head_dim;          // the real head dim (a multiple of 8, <= the kernel's kHeadDim)
    float softmax_scale;   // natural-log scale, for the LSE
    float scale_log2;      // softmax_scale * log2(e), computed on the host
    // features (appended; unused by a kernel built without them):
    int window_left;       // kWindow: keys before the diagonal a query sees, -1 unbounded
    int window_right;      // kWindow: keys after the diagonal, -1 unbounded
    float softcap_in;      // kSoftcap: scale / softcap (score.cuh)
    float softcap_out;     // kSoftcap: softcap / scale
    const float* alibi_slopes;  // kAlibi: fp32 (nheads) or (batch, nheads); written per call
    i64 alibi_batch_stride;     // kAlibi: 0 for (nheads), nheads for (batch, nheads)
    const void* rng_state;   // kDropout: int64[2] (seed, offset) in device memory, per call; else null
    int dropout_threshold;   // kDropout: drop iff the element's Philox byte < round(p·256) (philox.cuh)
    float dropout_scale;     // kDropout: 1 / (1 - p), applied to the kept elements
    // the dynamic scheduler (kDynamic; appended, unused by a kernel built without it):
    int* tile_counter;       // int32 claim counter, zeroed once when allocated, reset by the kernel
    int sched_section;       // (head, batch) pairs per section of the tile order, >= 1
    // the TMA-store epilogue (kTmaStore; appended, unused by a kernel built without it):
    TmaDesc tma_o;           // o's map: box 64 columns x 64 rows (one consumer warpgroup's rows)
    // variable-length batches (kVarlen, varlen.cuh; appended): q, o are (total_q, nheads,
    // head_dim), k, v (total_k, nheads_kv, head_dim), packed; the tensor maps span the whole
    // packed tensors (batch extent 1, seqlen extent the token total); batch is the number of
    // sequences and seqlen_q / seqlen_k the longest ones (the grid's extent); lse (nheads, total_q)
    int* cu_seqlens_q;        // kVarlen: int32 (batch + 1), sequence b's queries are rows
                              // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1; per call; else null
    int* cu_seqlens_k;        // kVarlen: the same for keys and values
    int total_q;              // kVarlen: rows of q (the LSE's row length); else 0
    // the folded softcap's fixed running max (kFoldCap 3, softmax_fold.cuh; appended, unused by a
    // kernel built without it): the max in units of t = tanh(S·softcap_in), <= 1, when the host
    // allows it for this cap (no score's P can underflow: 2·softcap·log2(e) <= 100), else 2 (any
    // value > 1): the kernel computes the row max
    float softcap_fixed_m;
    // the balanced tail (kStreamTail, sm90_tail.cuh; appended, unused by a kernel built without it):
    // the plan's buffers, zeroed once, the flags reset by the kernel
    int* tail_flags;          // int32, per (slot, consumer thread): a writer's partial is ready
    float* tail_partial;      // fp32 partials of the tiles cut in two (per slot and thread)
    int tail_n;               // K/V blocks per tile
    int tail_dp_end;          // tiles [0, tail_dp_end) run data parallel
    int tail_q;               // units (tile, block) per range of the stretch: tail_q, +1 for the first
    int tail_rem;             //   tail_rem ranges
    int tail_magic;           // x / tail_n = (x · (u32) tail_magic) >> tail_shift for 0 <= x < 2^31
    int tail_shift;
};

}  // namespace cuflash
