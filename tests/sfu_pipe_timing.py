"""What the softcapped score's SFU ops cost on this GPU, outside the attention kernel. Not a test:

    python tests/sfu_pipe_timing.py [--out FILE.json]

One block per SM (grid = the SM count), W warps per block; every thread runs NV independent chains
for ITERS iterations; cycles from clock64 around the loop (thread 0, between two __syncthreads). Rows:
  mufu_<op>      one SFU op per element and iteration (ex2 / tanh, f32 and f16): elements per clock per SM
  ffma           4 dependent FFMAs per element: the FMA pipes' rate, for comparison
  chain E, T, split: the softcapped score as sm90_fwd's fixed-max step computes it (FMUL, tanh, FFMA, ex2,
                 FADD into a row sum), with e of every 16 elements taking exp2_emu.cuh's exp2_poly<3> and
                 t of every 16 a software tanh (tanh_poly below) instead of the SFU op: cycles per
                 element and warp, i.e. what one warp's softmax step costs per score when it runs alone
                 on its SM sub-partition (W = 4: one warp per scheduler, as a consumer warpgroup's
                 softmax under the other warpgroup's GEMMs) or beside others (W = 8, 16).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SRC = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float ex2f(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float tanhf_(float x) { float y; asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ unsigned short ex2h(unsigned short x) { unsigned short y; asm volatile("ex2.approx.f16 %0, %1;" : "=h"(y) : "h"(x)); return y; }
__device__ __forceinline__ unsigned short tanhh(unsigned short x) { unsigned short y; asm volatile("tanh.approx.f16 %0, %1;" : "=h"(y) : "h"(x)); return y; }
__device__ __forceinline__ float exp2_poly3(float x) {
    const float kShifter = 12582912.f;
    x = x < -127.f ? -127.f : x;
    const float t = __fadd_rn(x, kShifter);
    const float j = __fsub_rn(t, kShifter);
    const float f = __fsub_rn(x, j);
    float p = fmaf(0.0550090596f, f, 0.242210969f);
    p = fmaf(p, f, 0.693282902f);
    p = fmaf(p, f, 1.f);
    return __fmul_rn(p, __uint_as_float((__float_as_uint(t) << 23) + (127u << 23)));
}
// odd polynomial y·q(y^2) on the clamped |y| <= 4 (degree 10 in y^2: 12 FMA-pipe ops and 2 clamps),
// for the cost only here
__device__ __forceinline__ float tanh_poly(float y) {
    y = fminf(fmaxf(y, -4.f), 4.f);
    const float z = y * y;
    float q = -1.0e-9f;
#pragma unroll
    for (int k = 0; k < 10; ++k) q = fmaf(q, z, 0.1f * (k + 1));
    return y * q;
}
#define NV 32
#define NC 64   // the chain: a consumer thread's 64 scores of a BN 128 block
extern "C" __global__ void mufu(int op, int iters, float* out, long long* cyc) {
    float v[NV];
    unsigned short h[NV];
    for (int i = 0; i < NV; ++i) { v[i] = 0.01f * (threadIdx.x % 7 + i); h[i] = __half_as_ushort(__float2half(v[i])); }
    __syncthreads();
    long long c0 = clock64();
    if (op == 0) { for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NV; ++i) v[i] = ex2f(-v[i]); } }
    else if (op == 1) { for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NV; ++i) v[i] = tanhf_(v[i] + 0.5f); } }
    else if (op == 2) { for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NV; ++i) h[i] = ex2h(h[i] ^ 0x8000); } }
    else if (op == 3) { for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NV; ++i) h[i] = tanhh(h[i]); } }
    else if (op == 4) { for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NV; ++i) { v[i] = fmaf(v[i], 0.999f, 0.001f); v[i] = fmaf(v[i], 0.999f, 0.001f);
                                       v[i] = fmaf(v[i], 0.999f, 0.001f); v[i] = fmaf(v[i], 0.999f, 0.001f); } } }
    else if (op == 5) { for (int it = 0; it < iters; ++it) {   // tanh and ex2 alternating, no FMA work
#pragma unroll
        for (int i = 0; i < NV; ++i) v[i] = ex2f(-tanhf_(v[i])); } }
    __syncthreads();
    long long c1 = clock64();
    float s = 0.f;
    for (int i = 0; i < NV; ++i) s += v[i] + __half2float(__ushort_as_half(h[i]));
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cyc[blockIdx.x] = c1 - c0;
}
template <int E, int T, bool kSplit>
__global__ void chain(int iters, float cin, float k, float* out, long long* cyc) {
    float v[NC], tt[NC];
    for (int i = 0; i < NC; ++i) v[i] = 0.01f * (threadIdx.x % 7 + i);
    float l = 0.f;
    __syncthreads();
    long long c0 = clock64();
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            const int j = i % 16;
            const bool emu_t = ((j + 9) * T) / 16 != ((j + 8) * T) / 16;
            const float y = v[i] * cin;
            tt[i] = emu_t ? tanh_poly(y) : tanhf_(y);
        }
        // kSplit: a branch between the tanhs and the exp2s, as sm90_fwd's fixed-max step has (the
        // mask of a diagonal block): two basic blocks, the tanhs' SFU burst before the exp2s'
        if (kSplit && iters == 12345) {
#pragma unroll
            for (int i = 0; i < NC; ++i) tt[i] = i == (threadIdx.x & 63) ? -1.f : tt[i];
        }
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            const int j = i % 16;
            const bool emu_e = ((j + 1) * E) / 16 != (j * E) / 16;
            const float x = fmaf(tt[i], k, -k);
            const float p = emu_e ? exp2_poly3(x) : ex2f(x);
            l += p;
            v[i] = p;
        }
    }
    __syncthreads();
    long long c1 = clock64();
    float s = l;
    for (int i = 0; i < NC; ++i) s += v[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cyc[blockIdx.x] = c1 - c0;
}
"""
CHAINS = [(e, t, sp) for sp in (1, 0) for e, t in ((0, 0), (2, 0), (4, 0), (6, 0), (8, 0), (0, 2), (0, 4), (4, 2))]


def main():
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=256)
    args = ap.parse_args()
    names = ["mufu"] + [f"chain<{e}, {t}, {'true' if sp else 'false'}>" for e, t, sp in CHAINS]
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "--use_fast_math"), name_expressions=names)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(sms * 1024, cp.float32)
    cyc = cp.zeros(sms, cp.int64)
    rows = []
    nv = 32

    def run(fn, warps, *a):
        fn((sms,), (32 * warps,), (*a, out, cyc))   # warm-up
        fn((sms,), (32 * warps,), (*a, out, cyc))
        cp.cuda.Device().synchronize()
        return float(cp.median(cyc.astype(cp.float64)))

    for warps in (4, 8, 16):
        for op, name in enumerate(("ex2_f32", "tanh_f32", "ex2_f16", "tanh_f16", "ffma_x4", "tanh+ex2")):
            c = run(mod.get_function("mufu"), warps, cp.int32(op), cp.int32(args.iters))
            elems = warps * 32 * nv * args.iters
            per = (4 if op == 4 else 2 if op == 5 else 1)
            rows.append(dict(kind="mufu", op=name, warps=warps, cycles=c, ops_per_clk_sm=elems * per / c))
            print(f"W={warps:2d} {name:10s} {elems * per / c:7.2f} ops/clk/SM", flush=True)
        for e, t, sp in CHAINS:
            c = run(mod.get_function(f"chain<{e}, {t}, {'true' if sp else 'false'}>"), warps, cp.int32(args.iters // 2),
                    cp.float32(0.03), cp.float32(1.0))
            # cycles per element of one warp, per scheduler (warps / 4 warps share one)
            per = c / (64 * (args.iters // 2)) / (warps / 4)
            rows.append(dict(kind="chain", E=e, T=t, split=bool(sp), warps=warps, cycles=c, cycles_per_elem_warp=per))
            print(f"W={warps:2d} chain{' split' if sp else '      '} exp2 emu {e:2d}/16 tanh emu {t}/16: "
                  f"{per:6.2f} cycles per score per warp (x{warps // 4} warps per scheduler)", flush=True)
    if args.out:
        json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=rows),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
