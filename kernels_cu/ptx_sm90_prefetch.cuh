// ptx_sm90_prefetch.cuh: TMA's L2 prefetch of a tensor tile, which sm90_fwd's kPrefetch needs beyond
// ptx_sm90.cuh (ptx.cuh's rules; a separate file so that the other sm90 families' code hashes stay).
#pragma once
#include "ptx.cuh"

namespace cuflash {

// One box of a rank-4 tensor at coordinates (c0 innermost .. c3), as tma_load_4d would load it,
// brought into L2 only: no shared memory, no mbarrier, nothing to wait for (a hint the copy engine
// runs on its own). Why: a later tma_load_4d of the same box then reads L2 instead of DRAM, so a load
// whose data arrive just before they are needed (the next tile's Q, issued when the current tile's
// last S GEMM frees the buffer) waits for L2's latency, not for DRAM's under every SM's burst.
__device__ __forceinline__ void tma_prefetch_4d(const void* tmap, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
                 :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

}  // namespace cuflash
