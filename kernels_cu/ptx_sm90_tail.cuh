// ptx_sm90_tail.cuh: inline PTX that only sm90_fwd's balanced tail (sm90_tail.cuh, kStreamTail) uses,
// one small function per instruction as in ptx.cuh; its own file so that the other families' code
// hash (which covers every header they include) stays.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// 16-byte load cached in L2 only (ld.global.cg): a partial another CTA wrote may sit stale in this
// SM's L1 (not coherent across SMs), never in L2.
__device__ __forceinline__ float4 ld_cg_float4(const float4* addr) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(addr) : "memory");
    return v;
}
// Suspends the thread for about `ns` nanoseconds: a spin on a flag in L2 without flooding it.
__device__ __forceinline__ void nanosleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

}  // namespace cuflash
