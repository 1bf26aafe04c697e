// params_sm90_bwd.cuh: the argument struct of the Hopper backward family (sm90_bwd), same rules
// as params.cuh and params_sm90.cuh (cuflash/launch.py mirrors it). A file of its own so that
// sm90_fwd's rendered source, and with it the code hash that stamps its tuned table entries,
// does not change when this struct does.
#pragma once
#include "ptx.cuh"
#include "params.cuh"
#include "params_sm90.cuh"

namespace cuflash {

// Backward attention on sm_90a (sm90_bwd): BwdParams (params.cuh), whose fields the family's
// reused fa2_bwd kernels (preprocess, dQ convert, GQA reduction) read from the same packed
// buffer (they take `const BwdParams`, the base of this struct), then the TMA maps of the main
// kernel (rank 4, innermost first: head_dim, seqlen, heads, batch; box 64 columns x BM or BN
// rows, 128-byte swizzle, out-of-bounds zero fill): q, dO (the preprocess's dout_copy when that
// piece exists) with BM-row boxes, k, v with BN-row boxes. cuflash/launch.py lays the base's
// fields out first, then these from sizeof(BwdParams) on.
struct Sm90BwdParams : BwdParams {
    TmaDesc tma_q;         // box 64 x BM
    TmaDesc tma_k;         // box 64 x BN
    TmaDesc tma_v;         // box 64 x BN
    TmaDesc tma_do;        // box 64 x BM
    TmaDesc tma_dq;        // dq_writer: the fp32 dQ accumulator (head_dim_rounded, seqlen_q_rounded,
                           // batch · nheads), box 32 x BM x 1, 128B swizzle (else unset)
    int* tile_counter;     // dynamic (kDynamic): the int32 claim counter, zeroed once when the plan
                           // allocates it, reset by the kernel (else null)
};

}  // namespace cuflash
