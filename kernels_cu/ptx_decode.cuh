// ptx_decode.cuh: inline PTX that only decode_splitkv.cu uses (its fused combine), one small
// function per instruction as in ptx.cuh. A separate header so that the other families' code
// hash (which covers every header they include) stays.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Returns *addr and adds x, acquire + release at GPU scope: a CTA counting itself done
// publishes its writes and, when it is the last, sees the others' (decode's fused combine).
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* addr, int x) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(addr), "r"(x) : "memory");
    return old;
}
// 16-byte load cached in L2 only (ld.global.cg): data another CTA of the same kernel wrote may
// sit stale in this SM's L1 (the L1 is not coherent across SMs), never in L2.
__device__ __forceinline__ void ld_cg_f32x4(float (&v)[4], const float* addr) {
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "l"(addr) : "memory");
}
// 4-byte load cached in L2 only (see ld_cg_f32x4).
__device__ __forceinline__ float ld_cg_f32(const float* addr) {
    float x;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(addr) : "memory");
    return x;
}

}  // namespace cuflash
