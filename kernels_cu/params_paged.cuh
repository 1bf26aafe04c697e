// params_paged.cuh: the argument struct of the paged-KV forward (fa2_fwd_paged.cu), same rules
// as params.cuh (one field per line, its field types); its own header, so that the other
// families' sources (and their code hash, which stamps the tuned tables) do not change when it
// does. cuflash/launch.py (struct_dtype) reads the fields from here, the base's from params.cuh.
#pragma once
#include "ptx.cuh"
#include "params.cuh"

namespace cuflash {

// Forward attention of a variable-length batch over a paged K/V cache (flash-attn's
// flash_attn_varlen_func with block_table). The FwdParams fields keep their varlen meaning
// (q, o: (total_q, nheads, head_dim); lse (nheads, total_q); cu_seqlens_q; seqlen_q / seqlen_k
// the longest sequences), except:
//   k, v          : (num_pages, page_block_size, nheads_kv, head_dim); k_batch_stride and
//                   v_batch_stride are the page strides (elements)
//   cu_seqlens_k  : (batch + 1) int32 offsets whose differences are the sequences' numbers of
//                   keys (the offsets themselves address nothing: the block table does)
// Key j of sequence b is row j % page_block_size of page block_table[b, j / page_block_size].
// Ids and entries are clamped (a bad id reads a wrong page of the cache, never outside it).
struct FwdPagedParams : FwdParams {
    int* block_table;         // int32 (batch, block_table_stride), row-major; written per call
    int block_table_stride;   // elements between the rows of sequence b and b + 1
    int block_table_cols;     // usable entries per row (>= 1): j / page_block_size is clamped below it
    int page_block_size;      // keys per page (>= 1)
    int num_pages;            // pages in k, v (>= 1): ids are clamped to [0, num_pages)
};

}  // namespace cuflash
