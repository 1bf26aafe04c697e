"""Where one eager forward + backward call's wall time goes (bench overhead's eager_fwdbwd path:
b=8 s=2k h=16 d=128 causal bf16): per implementation, the wall time of one call + synchronize, and
a torch.profiler trace of that call: every CUDA kernel's start / end relative to the call's start
and the GPU idle gaps between them, plus the host-side ops' spans."""
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cuflash import flash_attn_func

b, s, h, d = 8, 2048, 16, 128


def make(impl):
    """(call, ctx) for one implementation: call() is one eager forward + out.sum().backward() on
    inputs made once, call.forward() the forward alone; ctx() the SDPA backend pin to enter around
    the calls."""
    if impl == "cuflash":
        shape, ctx = (b, s, h, d), contextlib.nullcontext
        f = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    else:
        shape = (b, h, s, d)
        be = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION
        ctx = lambda: sdpa_kernel(be)  # noqa: E731
        f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def call():
        call.forward().sum().backward()
    call.forward = lambda: f(q, k, v)
    return call, ctx


def main():
    for impl in ("cuflash", "cudnn", "flash"):
        call, ctx = make(impl)
        with ctx():
            for _ in range(5):
                call()
            walls = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        print(f"== {impl}: eager wall median {statistics.median(walls):.3f} ms (min {min(walls):.3f})")
        evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
        cpu = [e for e in prof.events() if e.device_type.name == "CPU"]
        t0 = min([e.time_range.start for e in cpu] + [e.time_range.start for e in evs])
        last_end = None
        for e in sorted(evs, key=lambda e: e.time_range.start):
            st, en = e.time_range.start - t0, e.time_range.end - t0
            gap = "" if last_end is None else f" gap {st - last_end:7.1f}"
            print(f"  gpu {st:8.1f} .. {en:8.1f} us ({en - st:7.1f}){gap}  {e.name[:90]}")
            last_end = en
        tops = sorted(cpu, key=lambda e: e.time_range.start)
        for e in tops:
            if e.time_range.end - e.time_range.start > 8 and e.name.count("::") <= 2:
                print(f"  cpu {e.time_range.start - t0:8.1f} .. {e.time_range.end - t0:8.1f} us  {e.name[:80]}")


if __name__ == "__main__":
    main()
