// ptx.cuh: inline PTX, one small function per instruction. With ptx_sm90.cuh (the Hopper-only
// instructions) it holds all of cuflash's inline asm.
//
// cuflash kernels include no system header, so they compile the same way under NVRTC
// (CuPy RawModule, at run time) and nvcc (the CPU test that compiles every instantiation).
// Elements are carried as raw 16-bit storage; the element type is a tag (bf16 / fp16)
// that picks the conversion and the mma variant.
#pragma once

namespace cuflash {

using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
using i64 = long long;

// Element type tags: they pick the mma.sync and cvt variants below.
struct bf16 { using storage = u16; };
struct fp16 { using storage = u16; };

// ---- addresses -------------------------------------------------------------------------
// 32-bit shared-memory address of a generic pointer into shared memory. ldmatrix and cp.async
// take a shared-window address; converting once lets the loops add compile-time offsets to one
// 32-bit register instead of carrying 64-bit generic pointers.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(addr) : "l"(p));
    return addr;
}

// ---- cp.async: global -> shared without passing through registers -------------------------
// Copies 16 bytes; when `valid` is false nothing is read and the 16 bytes are zero-filled
// (src-size 0). Zero fill is how out-of-range rows and padded head-dim columns stay finite.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// The same copy of 16 bytes that are all valid: no src-size operand. The zero-fill form
// costs the load/store pipe more (measured on the H100: the backward's dQ reductions stalled
// behind it, "LG throttle"), so whole tiles take this one.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
// Close the cp.async copies issued so far into one group: groups are the unit that
// cp_async_wait counts, so each pipeline stage (a tile or a few) commits its own.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most `N` committed groups are still in flight (groups complete in order):
// waiting for all but the newest N lets the next stages keep loading while this one is used.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// ---- ldmatrix: four 8x8 16-bit matrices from shared memory into mma fragments -------------
// One instruction fills a whole A fragment (or two B fragments) in the mma layout, where
// per-thread loads would need four 32-bit loads and fragment shuffling.
// Lane l gives the address of row (l % 8) of matrix (l / 8); register r[i] gets matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Same, each 8x8 matrix transposed: the B operand of a product whose reduction dimension runs
// down the stored rows (V in O += P V, stored [key][dim] but needed as [dim][key]), with no
// transposed copy in shared memory.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- mma.sync m16n8k16: D(16x8, fp32) += A(16x16) * B(16x8), 16-bit inputs ------------------
// The warp-level tensor-core product of sm_80 and newer (sm_90's wgmma would need warpgroup-wide
// shared-memory operands); the widest mma.sync shape for 16-bit inputs, accumulating in fp32.
// Fragment ownership (g = lane / 4, t = lane % 4):
//   A: a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..)
//   B: b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g)
//   C/D: d0,d1 (row g, cols 2t, 2t+1), d2,d3 (row g+8, cols 2t, 2t+1)
template <class Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<fp16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- conversions -------------------------------------------------------------------------
// Two fp32 -> one register of two 16-bit values, `lo` in the low half (the lower column):
// one cvt rounds and packs both, which is the A fragment register layout (P, dS) and the
// 4-byte store of two output columns. No system header, so no __floats2bfloat162_rn.
template <class Elem>
__device__ __forceinline__ u32 pack2(float lo, float hi);

template <>
__device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <>
__device__ __forceinline__ u32 pack2<fp16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 16-bit element -> fp32 (exact for both formats), on raw storage since cuflash includes no
// cuda_fp16.h / cuda_bf16.h: bf16 is the high half of an fp32, fp16 needs the cvt.
template <class Elem>
__device__ __forceinline__ float to_float(u16 x);

template <>
__device__ __forceinline__ float to_float<bf16>(u16 x) { return __uint_as_float(u32(x) << 16); }
template <>
__device__ __forceinline__ float to_float<fp16>(u16 x) {
    float y;
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x));
    return y;
}

// ---- math ----------------------------------------------------------------------------------
// 2^x on the special-function unit, one MUFU.EX2 (exp2f wraps it in a fix-up for denormal
// results); the softmax's exponents are pre-scaled by log2(e) so every exp is this one.
// exp2(-inf) = 0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// tanh(x) on the special-function unit, one MUFU.TANH (sm_75+), max relative error ~2^-11:
// softcapping's tanh; tanhf is a dozen FMAs and a division. tanh(±inf) = ±1.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- global atomics and ordering ---------------------------------------------------------
// *addr += x in L2 (dQ accumulation across CTAs). red, not atom: no return value, so the
// thread does not wait for the L2 round trip.
__device__ __forceinline__ void red_add_f32(float* addr, float x) {
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr), "f"(x) : "memory");
}
// addr[0] += x, addr[1] += y (8-byte aligned): one vector reduction on sm_90 and newer, half
// the L2 atomic requests of two scalar ones.
__device__ __forceinline__ void red_add_f32x2(float* addr, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
#else
    red_add_f32(addr, x);
    red_add_f32(addr + 1, y);
#endif
}
// addr[0..3] += v[0..3] (16-byte aligned): one vector reduction on sm_90 and newer, a quarter
// of the L2 atomic requests (the dQ atomics are the backward's bottleneck).
__device__ __forceinline__ void red_add_f32x4(float* addr, const float (&v)[4]) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]) : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) red_add_f32(addr + i, v[i]);
#endif
}
// Load with acquire semantics at GPU scope: later reads see what the releasing CTA wrote
// (the deterministic dQ turn counter; a volatile load orders nothing).
__device__ __forceinline__ int ld_acquire_gpu(const int* addr) {
    int x;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(x) : "l"(addr) : "memory");
    return x;
}
// *addr += x with release semantics at GPU scope: earlier writes are visible first (passes
// the dQ turn on; one instruction instead of a fence followed by an atomic).
__device__ __forceinline__ void red_release_add_gpu(int* addr, int x) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(addr), "r"(x) : "memory");
}

}  // namespace cuflash
