// params_decode.cuh: the argument struct of the split-KV decode family (decode_splitkv.cu):
// its three kernels (append, main, combine) share it. A separate file so that the other
// families' code hash stays; cuflash/launch.py (struct_dtype) reads the fields from here.
#pragma once
#include "ptx.cuh"
#include "params.cuh"
#include "params_sm90.cuh"
// (params_sm90.cuh: TmaDesc, the Hopper loop's tensor maps)

namespace cuflash {

// flash_attn_with_kvcache. Layouts (elements; the last dimension is contiguous):
//   q, o            : (batch, seqlen_q, nheads, head_dim)
//   k_cache, v_cache: (batch_cache, capacity, nheads_kv, head_dim), or paged
//                     (num_blocks, page_size, nheads_kv, head_dim) addressed by block_table
//   k_new, v_new    : (batch, seqlen_new, nheads_kv, head_dim), appended at cache_seqlens[b]
//   rotary_cos/sin  : (seqlen_ro, rotary_dim / 2), row stride rotary_row_stride
//   cache_seqlens, cache_batch_idx, cache_leftpad : int32 (batch,), each may be null
//   block_table     : int32 (batch, max_blocks), row stride block_table_stride; null: not paged
//   alibi_slopes    : fp32 (batch, nheads) with batch stride alibi_batch_stride (0: (nheads,))
//   lse             : (batch, nheads, seqlen_q), fp32, contiguous, natural log; null: not written
// fp32 workspace (num_splits > 1), row R = (b·nheads + h)·seqlen_q + i:
//   o_partial       : (num_splits, batch·nheads·seqlen_q, head_dim_rounded), O / l per split
//   lse_partial     : (num_splits, batch·nheads·seqlen_q), -inf for a split without keys
//   q_rot           : (batch, seqlen_q, nheads, head_dim) contiguous, q rotated (rotary only)
// persistent (fused combine, num_splits > 1; owned by the call shape's plan, not per call):
//   split_counters  : int32 (batch, nheads_kv · row_blocks), 0 before and after every call
// TMA tensor maps (DecodeTmaParams, sm_90 only; written per call by the family's call_writer, as
// they embed the caches' addresses), rank 4, innermost first, box (kHeadDim + 8) x tma_box_rows x 1 x 1,
// no swizzle, out-of-bounds zero fill. The box's 8 columns past the head dim fall outside the
// tensor and arrive as zeros, so TMA writes the same padded rows (pitch kHeadDim + 8) as the
// cp.async loop, and the consumers' ldmatrix addressing stays conflict-free:
//   contiguous: (head_dim, capacity, nheads_kv, batch_cache) with the caches' strides
//   paged     : (head_dim, page_size, nheads_kv, num_pages)
// DecodeTmaParams is passed as a `const __grid_constant__` kernel parameter (TMA reads the maps
// in parameter space); the other kernels keep a plain `const DecodeParams`.
struct DecodeParams {
    const void* q;
    void* k_cache;
    void* v_cache;
    const void* k_new;
    const void* v_new;
    const void* rotary_cos;
    const void* rotary_sin;
    int* cache_seqlens;
    int* cache_batch_idx;
    int* cache_leftpad;
    int* block_table;
    const float* alibi_slopes;
    void* o;
    float* lse;
    float* o_partial;
    float* lse_partial;
    void* q_rot;
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;      // k_cache / v_cache: per batch row of the cache, or per page
    i64 k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_row_stride;
    i64 v_head_stride;
    i64 kn_batch_stride;     // k_new
    i64 kn_row_stride;
    i64 kn_head_stride;
    i64 vn_batch_stride;     // v_new
    i64 vn_row_stride;
    i64 vn_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 rotary_row_stride;
    i64 block_table_stride;
    i64 alibi_batch_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int head_dim;            // the real head dim (a multiple of 8, <= the kernel's kHeadDim)
    int head_dim_rounded;    // the kernel's kHeadDim: o_partial's row length
    int seqlen_new;          // rows of k_new / v_new (0: nothing to append)
    int capacity;            // logical positions of a cache row
    int page_size;           // paged: keys per page (any multiple of 16); 0: contiguous
    int num_pages;           // k_cache.shape[0]: pages (paged) or cache rows; ids are clamped below it
    int cache_seqlen_fixed;  // cache_seqlens[b] when cache_seqlens is null (an int, or the capacity)
    int rotary_dim;          // 0: no rotary
    int rotary_interleaved;  // 1: GPT-J pairs (2i, 2i+1); 0: GPT-NeoX halves (i, i + rotary_dim/2)
    int rotary_q_per_row;    // 1: query i rotates at position end + i (causal / local); 0: at end
    int window_left;         // keys j >= i + offset - left (-1: unbounded)
    int window_right;        // keys j <= i + offset + right (-1: unbounded; causal: 0)
    int num_splits;          // CTAs along each row's keys; 1 writes o and lse directly
    int group;               // nheads / nheads_kv: query heads packed per KV head
    int row_blocks;          // CTAs over the group·seqlen_q packed rows of one KV head
    float softmax_scale;     // natural-log scale, for the LSE
    float scale_log2;        // softmax_scale * log2(e)
    float softcap;           // 0: off; else scores become softcap·tanh(scores / softcap)
    int* split_counters;     // fused combine: (batch, nheads_kv · row_blocks) CTAs done per group,
                             // zero between calls (zeroed once when allocated, reset by the last
                             // CTA of each group); null otherwise
};

// The Hopper loop's params (decode_splitkv_tma, sm_90): DecodeParams plus the K / V tensor maps.
// The family packs this struct for every launch; the other kernels take DecodeParams, its prefix
// (the driver copies a kernel's own parameter size), so their code is what it was before it.
struct DecodeTmaParams : DecodeParams {
    int tma_box_rows;        // keys per TMA box (contiguous: kBlockN; paged: a divisor of kBlockN
                             // and page_size); 0 without the Hopper loop
    TmaDesc tma_k;           // k_cache's map (zeros without the Hopper loop)
    TmaDesc tma_v;           // v_cache's map
};

}  // namespace cuflash
