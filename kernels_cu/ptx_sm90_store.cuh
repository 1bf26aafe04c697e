// ptx_sm90_store.cuh: the TMA store that sm90_fwd's tma_store epilogue needs beyond ptx_sm90.cuh
// and ptx_sm90_bulk.cuh (whose bulk_commit_group / bulk_wait_group[_read] it pairs with), one
// small function per instruction with the reason it exists (ptx.cuh's rules; a separate file,
// included by sm90_fwd.cu only, so that sm90_bwd's code hash stays).
//
// cp.async.bulk.tensor (shared -> global) copies a box of shared memory, laid out as the tensor
// map's swizzle says, into the tensor the map describes: one instruction from one thread per box,
// the engine clips the rows and columns past the tensor's extent (a ragged last Q block, a head
// dim below the box), and the issuing thread goes on at once. The generic-proxy stores that fill
// the box must be made visible to the async proxy first (fence_proxy_async_smem), and the box may
// be rewritten only after bulk_wait_group_read<0> by the issuing thread.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Store the box at shared address `src` into the rank-4 tensor of map `tmap` at coordinates (c0
// innermost .. c3); part of this thread's next bulk group.
__device__ __forceinline__ void tma_store_4d(const void* tmap, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}

// A 32-bit store to shared memory at a shared-window address (the staging tile is addressed like
// every other shared tile of the Hopper kernels: by 32-bit shared addresses).
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 value) {
    asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(value) : "memory");
}

}  // namespace cuflash
