// ptx_sm90_cluster.cuh: thread-block clusters of two CTAs that share TMA loads by multicast
// (ptx.cuh's rules: a why per wrapper). sm90_bwd's kCluster (two CTAs of adjacent K/V blocks share
// their Q_i, dO_i loads) and sm90_fwd's kCluster (two CTAs of adjacent Q blocks of one head share
// their K_j, V_j loads): each CTA issues half of a tile's boxes into both CTAs' shared memory, and a
// slot is refilled once both CTAs have released it (remote mbarrier arrivals).
#pragma once
#include "ptx_sm90.cuh"

namespace cuflash {

// This CTA's rank in its cluster (%cluster_ctarank): each of the two issues half of a tile's boxes.
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The shared::cluster address of `addr` (this CTA's shared window) in CTA `rank` of the cluster:
// the partner's mbarrier for a remote arrival.
__device__ __forceinline__ u32 mapa_shared(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

// Arrive on an mbarrier of another CTA of the cluster, releasing at cluster scope: the partner may
// overwrite a ring slot of this CTA (its multicast) once this CTA's reads of it are done.
__device__ __forceinline__ void mbarrier_arrive_remote(u32 cluster_bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(cluster_bar) : "memory");
}

// tma_load_4d multicast to the CTAs in `cta_mask`: each receives the box at the same shared offset
// `dst` and counts its bytes on its own mbarrier at offset `bar`, so one L2 read feeds both SMs.
__device__ __forceinline__ void tma_load_4d_multicast(u32 dst, const void* tmap, u32 bar, int c0, int c1, int c2,
                                                      int c3, u16 cta_mask) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
                 :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask) : "memory");
}

// Every thread of both CTAs of the cluster (arrive, release; wait, acquire): after the mbarrier
// inits, before a partner's multicast or remote arrival can reach them.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

}  // namespace cuflash
