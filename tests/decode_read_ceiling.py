"""The HBM read ceiling at the long decode cells (issue 13, session 27): how fast plain read-only
kernels stream the same K + V bytes as a bf16 d 128, 8-KV-head decode call, next to SDPA flash, cuDNN
and cuflash's heuristic on the same cache, in one process (CUDA graphs, shuffled rounds). Not a test.

Probe kernels (each thread 16-byte loads, ``U`` words of K and ``U`` of V in flight, xor-folded so
the loads stay; nothing is written unless a fold hits a magic value):
  flat_C_uU  C CTAs of 256 threads, CTA c reads the c-th C-th of K and the same of V (whole rows of
             every head: contiguous bytes), U = 4, 8 or 16
  heads_sS   decode's grid: one CTA per (split, KV head, batch), S splits of the row, its head's
             256-byte rows at the cache's 2 KB row stride (K and V of the same keys together)
and SDPA's and cuflash's calls also one per graph (``_g1``: a lone call with its launch).
flatdyn_C is flat_C_u8 with its passes claimed from a counter, flatrr_C with them dealt round-robin (the
same order of addresses over time, no balancing); headsdyn_sS as heads_sS
with each group's 128-row blocks claimed by its S splits from the group's counter (balance within a group only, as
the decode kernels' claims); heads_lL_sS as heads_sS with L lanes per
256-byte row in each warp load (4: 8 rows x 64 bytes, as decode_splitkv_regs' K loads; 8: 4 rows x 128 bytes,
as its V loads; 16: 2 whole rows, as a cp.async tile).
So flat_128 against flat_132 says whether the 4 SMs a 128-CTA grid leaves idle would stream more,
flat_C against heads_sS what the heads' strided order costs, and U what bytes in flight buy.

    python tests/decode_read_ceiling.py [--cells 8x32k 32x8k] [--rounds 7] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_tma_timing as dt  # noqa: E402  (caches, graphs, replay timing)

THREADS = 256
SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ unsigned fold(uint4 a) { return a.x ^ a.y ^ a.z ^ a.w; }

// CTA c: words [lo, hi) of K and of V (n16 16-byte words each), U of each per thread in flight
extern "C" __global__ void __launch_bounds__(256, 1) flat(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                       long long n16, unsigned* __restrict__ out) {
    const long long lo = n16 * blockIdx.x / gridDim.x, hi = n16 * (blockIdx.x + 1) / gridDim.x;
    unsigned acc = 0;
    long long i = lo + threadIdx.x;
    for (; i + (KV_U - 1) * 256 < hi; i += KV_U * 256) {   // whole passes: every load issued before any use
        uint4 a[KV_U], b[KV_U];
#pragma unroll
        for (int j = 0; j < KV_U; ++j) {
            a[j] = k[i + j * 256];
            b[j] = v[i + j * 256];
        }
#pragma unroll
        for (int j = 0; j < KV_U; ++j) acc ^= fold(a[j]) ^ fold(b[j]);
    }
    for (; i < hi; i += 256) acc ^= fold(k[i]) ^ fold(v[i]);
    if (acc == 0x9e3779b9u) out[blockIdx.x * 256 + threadIdx.x] = acc;
}

// flat's passes dealt round-robin (CTA c: passes c, c + C, ...): flat_dyn's order of addresses over time, no claims
extern "C" __global__ void __launch_bounds__(256, 1) flat_rr(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                          long long n16, unsigned* __restrict__ out) {
    constexpr long long kPass = KV_U * 256;
    unsigned acc = 0;
    for (long long cur = blockIdx.x * kPass; cur < n16; cur += gridDim.x * kPass) {
        const long long i = cur + threadIdx.x;
        if (cur + kPass <= n16) {
            uint4 a[KV_U], b[KV_U];
#pragma unroll
            for (int j = 0; j < KV_U; ++j) {
                a[j] = k[i + j * 256];
                b[j] = v[i + j * 256];
            }
#pragma unroll
            for (int j = 0; j < KV_U; ++j) acc ^= fold(a[j]) ^ fold(b[j]);
        } else {
            for (long long x = i; x < n16; x += 256) acc ^= fold(k[x]) ^ fold(v[x]);
        }
    }
    if (acc == 0x9e3779b9u) out[blockIdx.x * 256 + threadIdx.x] = acc;
}

// flat's passes claimed one at a time from a counter (zeroed before each launch): a CTA that streams
// faster takes more, so the CTAs end together
extern "C" __global__ void __launch_bounds__(256, 1) flat_dyn(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                           long long n16, unsigned* __restrict__ out,
                                                           unsigned long long* __restrict__ counter) {
    __shared__ long long next;
    unsigned acc = 0;
    constexpr long long kPass = KV_U * 256;
    if (threadIdx.x == 0) next = static_cast<long long>(atomicAdd(counter, 1ull)) * kPass;
    __syncthreads();
    for (long long cur = next; cur < n16;) {
        unsigned long long claim = 0;
        if (threadIdx.x == 0) claim = atomicAdd(counter, 1ull);   // the next pass's, in flight with this one's loads
        const long long i = cur + threadIdx.x;
        if (cur + kPass <= n16) {
            uint4 a[KV_U], b[KV_U];
#pragma unroll
            for (int j = 0; j < KV_U; ++j) {
                a[j] = k[i + j * 256];
                b[j] = v[i + j * 256];
            }
#pragma unroll
            for (int j = 0; j < KV_U; ++j) acc ^= fold(a[j]) ^ fold(b[j]);
        } else {
            for (long long x = i; x < n16; x += 256) acc ^= fold(k[x]) ^ fold(v[x]);
        }
        __syncthreads();
        if (threadIdx.x == 0) next = static_cast<long long>(claim) * kPass;
        __syncthreads();
        cur = next;
    }
    if (acc == 0x9e3779b9u) out[blockIdx.x * 256 + threadIdx.x] = acc;
}

// CTA (split, head, batch): rows [ctx * split / splits, ...) of its head, 16 words a row, 16 rows per
// pass of 256 threads, U passes of K and of V in flight
extern "C" __global__ void __launch_bounds__(256, 1) heads(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                        int ctx, int hkv, unsigned* __restrict__ out) {
    const int split = blockIdx.x, splits = gridDim.x, h = blockIdx.y, b = blockIdx.z;
    const long long base = (static_cast<long long>(b) * ctx * hkv + h) * 16 + threadIdx.x % 16;
    const int r_lo = static_cast<long long>(ctx) * split / splits, r_hi = static_cast<long long>(ctx) * (split + 1) / splits;
    unsigned acc = 0;
    const long long row_stride = static_cast<long long>(hkv) * 16;
    int r = r_lo + threadIdx.x / 16;
    for (; r + (KV_U - 1) * 16 < r_hi; r += KV_U * 16) {
        uint4 a[KV_U], c[KV_U];
#pragma unroll
        for (int j = 0; j < KV_U; ++j) {
            a[j] = k[base + (r + 16 * j) * row_stride];
            c[j] = v[base + (r + 16 * j) * row_stride];
        }
#pragma unroll
        for (int j = 0; j < KV_U; ++j) acc ^= fold(a[j]) ^ fold(c[j]);
    }
    for (; r < r_hi; r += 16) acc ^= fold(k[base + r * row_stride]) ^ fold(v[base + r * row_stride]);
    if (acc == 0x9e3779b9u) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x * 256 + blockIdx.x * 256 + threadIdx.x] = acc;
}

// as heads, the group's 128-row blocks claimed one at a time from its counter (counters[b * hkv + h], zeroed
// before each launch) by its splits: balancing within a group only, as the decode kernels' claims
extern "C" __global__ void __launch_bounds__(256, 1) heads_dyn(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                            int ctx, int hkv, unsigned* __restrict__ out,
                                                            unsigned long long* __restrict__ counters) {
    __shared__ int next;
    const int h = blockIdx.y, b = blockIdx.z;
    unsigned long long* counter = counters + b * hkv + h;
    const long long base = (static_cast<long long>(b) * ctx * hkv + h) * 16 + threadIdx.x % 16;
    const long long row_stride = static_cast<long long>(hkv) * 16;
    const int n_blocks = ctx / 128;
    unsigned acc = 0;
    if (threadIdx.x == 0) next = static_cast<int>(atomicAdd(counter, 1ull));
    __syncthreads();
    for (int blk = next; blk < n_blocks;) {
        unsigned long long claim = 0;
        if (threadIdx.x == 0) claim = atomicAdd(counter, 1ull);
        uint4 a[8], c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long long x = base + static_cast<long long>(blk * 128 + threadIdx.x / 16 + 16 * j) * row_stride;
            a[j] = k[x];
            c[j] = v[x];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= fold(a[j]) ^ fold(c[j]);
        __syncthreads();
        if (threadIdx.x == 0) next = static_cast<int>(claim);
        __syncthreads();
        blk = next;
    }
    if (acc == 0x9e3779b9u) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x * 256 + blockIdx.x * 256 + threadIdx.x] = acc;
}

// as heads, with kLanes lanes per 256-byte row in each warp load (16: 2 rows of 256 bytes per instruction,
// as a cp.async tile; 4: 8 rows x 64 bytes, as decode_splitkv_regs' K loads; 8: 4 rows x 128 bytes, as its V
// loads): 128 rows of K and of V in flight per CTA, 8 words each per thread
template <int kLanes>
__device__ __forceinline__ void heads_lanes(const uint4* __restrict__ k, const uint4* __restrict__ v, int ctx, int hkv,
                                            unsigned* __restrict__ out) {
    constexpr int kRowsPerWarp = 32 / kLanes, kWordsPerLane = 16 / kLanes, kPasses = 8 / kWordsPerLane;
    constexpr int kRowsPerPass = 8 * kRowsPerWarp;   // 8 warps
    const int split = blockIdx.x, splits = gridDim.x, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row_in = warp * kRowsPerWarp + lane / kLanes;
    const long long base = (static_cast<long long>(b) * ctx * hkv + h) * 16 + lane % kLanes;
    const long long row_stride = static_cast<long long>(hkv) * 16;
    const int r_lo = static_cast<long long>(ctx) * split / splits, r_hi = static_cast<long long>(ctx) * (split + 1) / splits;
    unsigned acc = 0;
    int r = r_lo;
    for (; r + kPasses * kRowsPerPass <= r_hi; r += kPasses * kRowsPerPass) {
        uint4 a[8], c[8];
#pragma unroll
        for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
            for (int i = 0; i < kWordsPerLane; ++i) {
                const long long x = base + static_cast<long long>(r + ps * kRowsPerPass + row_in) * row_stride + kLanes * i;
                a[ps * kWordsPerLane + i] = k[x];
                c[ps * kWordsPerLane + i] = v[x];
            }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= fold(a[j]) ^ fold(c[j]);
    }
    for (int row = r + threadIdx.x / 16; row < r_hi; row += 16) {
        const long long x = (static_cast<long long>(b) * ctx * hkv + h) * 16 + threadIdx.x % 16 + row * row_stride;
        acc ^= fold(k[x]) ^ fold(v[x]);
    }
    if (acc == 0x9e3779b9u) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x * 256 + blockIdx.x * 256 + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(256, 1) heads_l4(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                             int ctx, int hkv, unsigned* __restrict__ out) {
    heads_lanes<4>(k, v, ctx, hkv, out);
}
extern "C" __global__ void __launch_bounds__(256, 1) heads_l8(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                             int ctx, int hkv, unsigned* __restrict__ out) {
    heads_lanes<8>(k, v, ctx, hkv, out);
}
extern "C" __global__ void __launch_bounds__(256, 1) heads_l16(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                              int ctx, int hkv, unsigned* __restrict__ out) {
    heads_lanes<16>(k, v, ctx, hkv, out);
}
"""


def kernels(u: int):
    import cupy

    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17", f"-DKV_U={u}"))
    return (mod.get_function("flat"), mod.get_function("heads"), mod.get_function("flat_dyn"), mod.get_function("flat_rr"), mod.get_function("heads_dyn"),
            {n: mod.get_function(f"heads_l{n}") for n in (4, 8, 16)})


def probe_fns(kc, vc, out, sms):
    """(label, fn) of the probe kernels on the cache (kc, vc), each launched on torch's current stream."""
    import cupy
    import numpy as np
    import torch

    batch, ctx, hkv, d = kc.shape
    assert d == 128
    n16 = kc.numel() * 2 // 16
    ks, vs, os_ = (np.uint64(t.data_ptr()) for t in (kc, vc, out))
    counter = torch.zeros(batch * hkv, dtype=torch.int64, device="cuda")
    cs = np.uint64(counter.data_ptr())
    fns = []
    for u in (4, 8, 16):
        flat, heads, flat_dyn, flat_rr, heads_dyn, lanes = kernels(u)

        def launch(kern, grid, args):
            def f():
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    kern(grid, (THREADS,), args)
            return f
        ctas = (64, 96, 120, 128, 132, 2 * sms, 4 * sms, 8 * sms) if u == 8 else (128, sms)
        for c in ctas:
            fns.append((f"flat_{c}_u{u}", launch(flat, (c,), (ks, vs, np.int64(n16), os_))))
        if u == 8:
            for c in (128, sms, 2 * sms):
                fns.append((f"flatrr_{c}", launch(flat_rr, (c,), (ks, vs, np.int64(n16), os_))))
            for c in (128, sms, 2 * sms):
                dyn = launch(flat_dyn, (c,), (ks, vs, np.int64(n16), os_, cs))

                def f(dyn=dyn):
                    counter.zero_()
                    dyn()
                fns.append((f"flatdyn_{c}", f))
            for s in (1, 2, 4, 16):
                fns.append((f"heads_s{s}", launch(heads, (s, hkv, batch), (ks, vs, np.int32(ctx), np.int32(hkv), os_))))
            s = 2 if batch * hkv * 2 <= sms else 1   # decode's split count for these cells (128 / 256 CTAs)
            for sd in (2, 4):
                hd = launch(heads_dyn, (sd, hkv, batch), (ks, vs, np.int32(ctx), np.int32(hkv), os_, cs))

                def f(hd=hd):
                    counter.zero_()
                    hd()
                fns.append((f"headsdyn_s{sd}", f))
            for n, kern in lanes.items():
                fns.append((f"heads_l{n}_s{s}", launch(kern, (s, hkv, batch), (ks, vs, np.int32(ctx), np.int32(hkv), os_))))
    return fns


def run_cell(cell, rounds, reps, log):
    import torch

    from cuflash.bench.decode import capture_graph
    from cuflash.decode import flash_attn_with_kvcache
    from cuflash.timing import round_orders

    batch, ctx, _ = dt.CELLS[cell]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    (q, kc, vc, _), = dt.make_caches(batch, ctx, 0, 1, torch.bfloat16, gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.zeros(8 * sms * THREADS * 16, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * kc.numel() * 2
    jobs = [(impl, dt.sdpa_fn(impl, q, kc, vc)) for impl in ("sdpa_flash", "sdpa_cudnn")]
    jobs.append(("heuristic", lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)))
    jobs += probe_fns(kc, vc, out, sms)
    # one call per graph (the launch and a lone call's start and end, not hidden by a neighbour)
    jobs += [(label + "_g1", f) for label, f in jobs[:3]]
    records, graphs = [], []
    for label, f in jobs:
        rec = dict(cell=cell, label=label, times=[])
        try:
            f()
            graphs.append((capture_graph(f, 1), 1) if label.endswith("_g1") else dt.build_graph(f, dt.eager_us(f)))
        except Exception as exc:  # noqa: BLE001 - the record says why
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            graphs.append(None)
        records.append(rec)
    for order in round_orders(list(range(len(records))), rounds, "shuffle"):
        for i in order:
            if graphs[i] is not None:
                records[i]["times"].append(dt.replay_us(*graphs[i], reps))
    for rec in records:
        t = sorted(rec["times"])
        if t:
            rec.update(us=t[len(t) // 2], spread=t[-1] / t[0], TBps=kv_bytes / (t[len(t) // 2] * 1e-6) / 1e12)
    for rec in sorted(records, key=lambda r: r.get("us") or 1e9):
        log(f"  {cell} {rec['label']:14s} " + (f"{rec['us']:9.2f} us {rec['TBps']:5.3f} TB/s  sp {rec['spread']:.4f}"
                                                if rec.get("us") else rec.get("error", "")))
    del graphs
    torch.cuda.empty_cache()
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["8x32k"], choices=list(dt.CELLS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    t0 = time.time()
    print(torch.cuda.get_device_name(0), flush=True)
    records = []
    for cell in a.cells:
        records += run_cell(cell, a.rounds, a.reps, lambda s: print(s, flush=True))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(0), "records": records}, fh, indent=1)
    print(f"done {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
