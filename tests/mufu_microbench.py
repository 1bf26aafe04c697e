"""Issue cost of the SFU ops the softcap forward runs per score (MUFU.TANH, MUFU.EX2) against FFMA,
on the GPU at hand: cycles per warp instruction per SM sub-partition, from clock64 around a loop of
8 independent chains per thread. Not a test; a few seconds:

    python tests/mufu_microbench.py [--out /tmp/mufu.json]

Rows: op x warps per sub-partition (1: the pingpong softmax phase, one consumer warp per
sub-partition issuing; 2, 4: more warps to cover latency). One CTA per SM.
"""
import argparse
import json

SRC = r"""
template <int kOp>
__device__ __forceinline__ void run(float* out, long long* cycles, int iters) {
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = 0.001f * (threadIdx.x + j);
    __syncthreads();
    long long t0 = clock64();
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (kOp == 0 || kOp == 3) asm volatile("tanh.approx.f32 %0, %0;" : "+f"(x[j]));
            if (kOp == 1 || kOp == 3) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[j]));
            if (kOp == 2) asm volatile("fma.rn.f32 %0, %0, 0f3F000000, 0f3F000000;" : "+f"(x[j]));
        }
    }
    long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
extern "C" __global__ void bench0(float* o, long long* c, int n) { run<0>(o, c, n); }
extern "C" __global__ void bench1(float* o, long long* c, int n) { run<1>(o, c, n); }
extern "C" __global__ void bench2(float* o, long long* c, int n) { run<2>(o, c, n); }
extern "C" __global__ void bench3(float* o, long long* c, int n) { run<3>(o, c, n); }
"""
OPS = {0: "tanh", 1: "ex2", 2: "ffma", 3: "tanh+ex2"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import cupy as cp

    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = []
    iters = 2048
    for op, name in OPS.items():
        for wps in (1, 2, 4):
            threads = 128 * wps
            out = cp.zeros(sms * threads, dtype=cp.float32)
            cyc = cp.zeros(sms, dtype=cp.int64)
            for _ in range(2):
                mod.get_function(f"bench{op}")((sms,), (threads,), (out, cyc, cp.int32(iters)))
            cp.cuda.Device().synchronize()
            c = float(cp.median(cyc.astype(cp.float64)))
            instr = iters * 8 * (2 if op == 3 else 1) * wps   # warp instructions per sub-partition
            rows.append(dict(op=name, warps_per_smsp=wps, cycles=c, cycles_per_warp_instr=c / instr))
            print(f"{name:9s} warps/SMSP {wps}: {c / instr:6.2f} cycles per warp instruction", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
