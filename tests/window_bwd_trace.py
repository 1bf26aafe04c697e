"""Where the window backward's wall time beyond its kernels goes (issue 12; session 23's win5 found about
80 us per backward between the kernels' sum and the CUDA-event time). torch.profiler, CPU and CUDA activity,
over --reps backward calls of the window (1024, 0) causal and the plain causal call (bf16, d128, batch 2 x
16 heads x 8k, bench --mode features' shape), each after a warm-up:

* the host side: the CUDA runtime / driver calls and aten ops by self CPU time (a synchronizing call, a
  pageable copy or an allocation in the loop shows here), and the host time per backward call;
* the GPU side: each kernel's start and end, and the idle time between consecutive kernels, summed per call.

Not a test:

    timeout 60 python tests/window_bwd_trace.py --reps 10
"""
import argparse
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from window_bwd_kernels_timing import BATCH, HEAD_DIM, HEADS, SEQLEN  # noqa: E402  (the same shape)


def gpu_gaps(events):
    """(kernel count, busy us, idle us between consecutive kernels) of the profiled kernels."""
    ks = sorted((e.time_range.start, e.time_range.end) for e in events
                if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy = sum(b - a for a, b in ks)
    idle = sum(max(0.0, ks[i + 1][0] - ks[i][1]) for i in range(len(ks) - 1))
    return len(ks), busy, idle


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    import cuflash

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for name, kw in (("window causal", dict(causal=True, window_size=(1024, 0))), ("plain causal", dict(causal=True))):
        o = cuflash.flash_attn_func(q, k, v, **kw)
        fn = (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            fn()
        host_us = (time.perf_counter() - t0) / args.reps * 1e6
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / args.reps * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                fn()
            torch.cuda.synchronize()
        n, busy, idle = gpu_gaps(prof.events())
        print(f"== {name}: host {host_us:.1f} us per backward call (queued, no sync), wall {wall_us:.1f} us; "
              f"GPU: {n / args.reps:.1f} kernels per call, busy {busy / args.reps:.1f} us, idle between kernels "
              f"{idle / args.reps:.1f} us per call", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
        kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type.name == "CUDA"), key=lambda t: t[0])
        print("the last call's GPU timeline (us from its first kernel; name):")
        per = max(1, len(kern) // args.reps)
        last = kern[-per:]
        for a, b, nm in last:
            print(f"  {a - last[0][0]:9.1f} .. {b - last[0][0]:9.1f}  {nm[:110]}")


if __name__ == "__main__":
    main()
