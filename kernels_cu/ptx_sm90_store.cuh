// ptx_sm90_store.cuh: the TMA store that sm90_fwd's tma_store epilogue needs beyond ptx_sm90.cuh
// and ptx_sm90_bulk.cuh (whose bulk_commit_group / bulk_wait_group[_read] it pairs with), and the
// stmatrix of its p_smem P tile, and the byte permute with sign replication of its packed dropout
// mask, one small function per instruction with the reason it exists (ptx.cuh's rules; a separate
// file; sm90_bwd includes it too, through ptx_sm90_bwd.cuh, for stmatrix_x4 and prmt_sign).
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

// Four 8x8 16-bit matrices in mma fragment layout (thread (g, t) holds row g, columns 2t, 2t + 1
// of each: register i is matrix i) stored as they are: lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes). sm90_fwd's p_smem writes P_j (16-bit A fragments, pack_a_frags' order)
// into its shared-memory P tile with one instruction per k16 step, where 32-bit stores take four.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// 16 bytes from / to shared memory at a shared-window address: fold_cap 4 rescales each consumer
// warpgroup's rows of Q in place (softmax_fold.cuh prescale_q), a row's 128 bytes in 8 of these
// where 32-bit accesses take 32.
__device__ __forceinline__ void ld_shared_v4(u32 addr, u32 (&r)[4]) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void st_shared_v4(u32 addr, const u32 (&r)[4]) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// prmt in its default mode with the selector's sign bits: byte i of the result is byte sel[4i+2:4i]
// of {b, a} (a = bytes 0..3), copied, or, where sel's nibble has bit 3 set, that byte's top bit
// replicated over all 8 bits. dropout_packed.cuh turns keep flags (the top bit of a byte) into
// 16-bit masks of packed P with it, one instruction per two elements (CUDA's __byte_perm
// documents only the copy).
__device__ __forceinline__ u32 prmt_sign(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

}  // namespace cuflash
