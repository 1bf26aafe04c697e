// ptx_sm90_bulk.cuh: the bulk reduce-add that sm90_bwd's dq_bulk mode needs beyond
// ptx_sm90.cuh, one small function per instruction with the reason it exists (ptx.cuh's
// rules; a separate file so that sm90_fwd's code hash stays).
//
// cp.reduce.async.bulk adds a contiguous run of shared memory element by element into global
// memory through the async proxy (the TMA engine): one instruction per run instead of one
// red.global.add per thread and 16 bytes, and the issuing thread goes on at once. Each element's
// addition is atomic, as red.global.add's. Addresses and sizes are multiples of 16 bytes. The
// generic-proxy stores that fill the source must be made visible to the async proxy first
// (fence_proxy_async_smem, ptx_sm90.cuh), and the source may be rewritten only once
// bulk_wait_group_read says the engine has read it. Completion is tracked per thread: the
// thread that issues an operation is the one that commits and waits for it.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Add `bytes` of fp32 at shared address `src` into global `dst` (part of this thread's next
// bulk group).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// Close this thread's bulk operations issued since the last commit into one group.
__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Wait until at most kPending of this thread's bulk groups still read their shared source:
// after <0> the staging buffer may be rewritten (the global additions may still be in flight).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(kPending) : "memory");
}
// Wait until at most kPending of this thread's bulk groups are still in flight, reads and
// writes: before the CTA exits, so that no operation reads its shared memory once it is freed.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(kPending) : "memory");
}

// Add a box of fp32 at shared address `src` into the tensor that map `tmap` describes, at
// coordinates (c0 innermost, c1, c2): the tensor (TMA) form, so one instruction moves a whole
// swizzled tile (sm90_bwd's dq_writer: a BM x 32 column box of dQ_i, read from shared memory as
// the map's 128-byte swizzle lays it out, which keeps the consumers' fragment stores free of
// bank conflicts); part of this thread's next bulk group, as bulk_reduce_add_f32.
__device__ __forceinline__ void bulk_reduce_add_tensor_3d(const void* tmap, u32 src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];"
                 :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}

}  // namespace cuflash
