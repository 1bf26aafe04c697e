// ptx_decode.cuh: inline PTX that only decode_splitkv.cu uses (its fused combine, its Hopper
// loop, its L2-hinted K/V copies), one small function per instruction as in ptx.cuh. A separate header so that the other
// families' code hash (which covers every header they include) stays. The Hopper loop's mbarrier
// and TMA wrappers come from ptx_sm90.cuh (sm_90 PTX: only the kTma instantiations call them).
#pragma once
#include "ptx.cuh"
#include "ptx_sm90.cuh"
#include "ptx_sm90_cluster.cuh"
// (ptx_sm90_cluster.cuh: cluster_ctarank, mapa_shared and cluster_sync for decode_splitkv_regs'
// kCluster merge; only its cluster entry point, compiled for sm_90, calls them)

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

// cp_async_16 (16 bytes, all valid) with an L2 prefetch-size hint of kBytes (64, 128, 256): on
// an L2 miss the whole kBytes-aligned segment around src is fetched from DRAM at once (decode's
// K/V stream: fewer, larger DRAM requests). kBytes 0: the plain copy, no hint.
template <int kBytes>
__device__ __forceinline__ void cp_async_16_l2(u32 dst, const void* src) {
    static_assert(kBytes == 0 || kBytes == 64 || kBytes == 128 || kBytes == 256,
                  "the L2 prefetch size must be 0, 64, 128 or 256 bytes");
    if constexpr (kBytes == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
    else if constexpr (kBytes == 128)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
    else if constexpr (kBytes == 64)
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
    else
        cp_async_16(dst, src);
}

// `bytes` (a multiple of 16) of contiguous global memory at `src` into shared memory at `dst`
// (both 16-byte aligned) by the copy engine, completing them as transactions on mbarrier `bar`:
// the Hopper loop's paged fallback, one key row of one head per copy, where a TMA box would
// cross a page boundary (a cache_leftpad that is not a multiple of the box's rows).
__device__ __forceinline__ void bulk_load_1d(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// An L2 eviction policy that marks the lines it touches evict-first (createpolicy, fraction
// 1.0): a K/V stream read once per call need not push other data out of L2 (decode's kBulk 2).
__device__ __forceinline__ u64 l2_policy_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// An L2 eviction policy that marks the lines it touches evict-last (createpolicy, fraction 1.0):
// decode_splitkv_regs' load hint 6, a short call's K/V (1 x 8k: 34 MB, less than the 50 MB L2)
// kept in L2 for the next call that reads the same cache.
__device__ __forceinline__ u64 l2_policy_evict_last() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// bulk_load_1d with an L2 cache policy (l2_policy_evict_first): one whole K or V row of the
// cp.async loop's bulk path (kBulk 2), the copy engine's request instead of 16-byte cp.asyncs.
__device__ __forceinline__ void bulk_load_1d_hint(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}

// ---- decode_splitkv_regs: K/V rows straight into registers -------------------------------------
// 16 bytes of K or V (read-only for the kernel's life) into four registers, on the non-coherent
// path, with the cache hints of kHint:
//   0  none: the plain ld.global.nc
//   1  L1::no_allocate (a key row is read by one warp once) and an L2 prefetch size of 256 bytes
//      (a d 128 bf16 key row: on a miss the L2 fetches the row's whole segment at once)
//   2  as 1, with the L2 cache policy `policy` (l2_policy_evict_first: the stream is read once per
//      call; ld's own .L2::evict_first wants 32-byte vectors)
//   3  L1::no_allocate only;  4  L2::256B only;  5  the policy `policy` only
//   6  the policy `policy` only (the kernel passes l2_policy_evict_last)
// volatile: the loads stay where the kernel issues them, ahead of the mma.syncs (also volatile)
// that work on the previous block's registers.
template <int kHint>
__device__ __forceinline__ void ld_kv_16(u32 (&r)[4], const void* src, u64 policy = 0) {
    static_assert(kHint >= 0 && kHint <= 6, "the K/V load hint must be in 0..6");
    if constexpr (kHint == 2)
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src), "l"(policy));
    else if constexpr (kHint == 1)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src));
    else if constexpr (kHint == 3)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src));
    else if constexpr (kHint == 4)
        asm volatile("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src));
    else if constexpr (kHint == 5 || kHint == 6)
        asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src), "l"(policy));
    else
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(src));
}

// ld_kv_16 under a predicate inside the asm (r keeps its value where `pred` is false): decode_splitkv_regs' kSpec
// issues its early loads with no branch around them, so they share a basic block with what follows and the
// scheduler cannot leave them behind the uses of cache_seqlens.
template <int kHint>
__device__ __forceinline__ void ld_kv_16_if(u32 (&r)[4], const void* src, bool pred, u64 policy = 0) {
    static_assert(kHint >= 0 && kHint <= 6, "the K/V load hint must be in 0..6");
    const int on = pred;
    if constexpr (kHint == 2)
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %6;}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on), "l"(policy));
    else if constexpr (kHint == 1)
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on));
    else if constexpr (kHint == 3)
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on));
    else if constexpr (kHint == 4)
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on));
    else if constexpr (kHint == 5 || kHint == 6)
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %6;}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on), "l"(policy));
    else
        asm volatile("{.reg .pred p; setp.ne.b32 p, %5, 0;\n"
                     "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];}"
                     : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(src), "r"(on));
}

// The cache line holding `addr` into L1 (decode_splitkv_regs' kEarlyPrefetch: the first K/V
// block's rows requested before cache_seqlens arrives; the ld.global.nc that follows hits L1).
__device__ __forceinline__ void prefetch_l1(const void* addr) {
    asm volatile("prefetch.global.L1 [%0];" :: "l"(addr));
}

// A 32-bit global load kept in program order (asm volatile): decode_splitkv_regs' kSpec reads cache_seqlens after
// its speculative K/V loads, and the compiler may otherwise hoist a plain load's uses above them.
__device__ __forceinline__ int ld_ordered_s32(const int* addr) {
    int v;
    asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(addr));
    return v;
}

// An empty asm that takes `x`: x is computed before the asm statements that follow (decode_splitkv_regs' kSpec 2:
// the early loads' addresses before griddepcontrol.wait, which the compiler otherwise schedules first).
__device__ __forceinline__ void computed_before(const void* x) {
    asm volatile("" :: "l"(x));
}

// The cache line holding `addr` into L2 (decode_splitkv_regs' kAhead: the K/V rows of a block
// further ahead than its two register sets requested early, so a short split's whole stream is in
// flight from its start).
__device__ __forceinline__ void prefetch_l2(const void* addr) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(addr));
}

// The 8 x 8 matrix of 16-bit elements that the warp holds one register per lane of (lane l: row
// l / 4, columns 2·(l % 4) and + 1), transposed in place across the lanes: P's C fragment of
// Sᵀ = K Qᵀ (key rows, query-row columns) becomes the B fragment of Oᵀ += Vᵀ Pᵀ (k = keys).
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// Bytes of the pair {a, b} (a: bytes 0-3, b: 4-7) picked by `sel`'s nibbles: 0x5410 packs the
// low halves (a's into the low half), 0x7632 the high halves. V's rows hold consecutive columns
// of one key; Vᵀ's A fragment wants two keys of one column per register.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// ---- programmatic dependent launch (sm_90; cuflash.launch launches a kPdl kernel with the attribute) ----
// Blocks the thread until the grids this one depends on (the stream's previous kernel, launched
// before it under programmatic stream serialization) have completed and their memory operations are
// visible: a kPdl kernel's first read of anything an earlier kernel may write, and its first write,
// come after it. Returns at once for a kernel launched without the attribute (and before sm_90).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the stream's next kernel (if launched with the attribute) be scheduled once every CTA of this
// grid has issued this or exited: its CTAs take SMs as ours free them and run their prologue up to
// their own grid_dependency_wait, which still waits for this grid's completion (no ordering given up).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- decode_splitkv_regs' kCluster merge: the splits of one group read each other's partials ------
// 4 bytes of another CTA's shared memory (`addr`: a shared::cluster address from mapa_shared):
// a split's LSE of one row, read by the CTA that merges a slice of that row's columns.
__device__ __forceinline__ float ld_shared_cluster_f32(u32 addr) {
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}

// 16 bytes (4 fp32 columns of a split's normalized O) of another CTA's shared memory, one
// distributed-shared-memory request: the merging CTA's columns of one split, without the global
// round trip of the fused combine.
__device__ __forceinline__ void ld_shared_cluster_f32x4(float (&v)[4], u32 addr) {
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(addr) : "memory");
}

}  // namespace cuflash
