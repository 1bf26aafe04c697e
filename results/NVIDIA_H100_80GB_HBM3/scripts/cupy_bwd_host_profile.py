"""Where the CuPy backward's host time goes (bench overhead's cupy_fwdbwd path: b=1 s=128 h=4 d=64
causal fp16): µs per call of the forward, the backward and each piece, then cProfile of the
backward's calls sorted by own time."""
import cProfile
import pstats
import time

import cupy

from cuflash.api import flash_attn_backward, flash_attn_func

shape = (1, 128, 4, 64)
q, k, v, dout = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                 for _ in range(4))
out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
for _ in range(20):
    flash_attn_backward(dout, q, k, v, out, lse, causal=True)
cupy.cuda.Device().synchronize()


def us(fn, n=400):
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        cupy.cuda.Device().synchronize()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)


print(f"fwd (no lse)   {us(lambda: flash_attn_func(q, k, v, causal=True)):8.1f} us")
print(f"fwd (with lse) {us(lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)):8.1f} us")
print(f"bwd            {us(lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=True)):8.1f} us")
print(f"cupy.empty x3  {us(lambda: [cupy.empty(shape, cupy.float16) for _ in range(3)]):8.1f} us")
# the GPU's time per backward (events around 200 calls), and the host's alone (no GPU wait: the
# process's CPU time over calls issued back to back, then the wait excluded)
ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
ev0.record()
for _ in range(200):
    flash_attn_backward(dout, q, k, v, out, lse, causal=True)
ev1.record()
ev1.synchronize()
print(f"bwd GPU time   {cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3 / 200:8.1f} us per call (events)")
t0 = time.perf_counter()
for _ in range(200):
    flash_attn_backward(dout, q, k, v, out, lse, causal=True)
t1 = time.perf_counter()
cupy.cuda.Device().synchronize()
print(f"bwd host issue {(t1 - t0) / 200 * 1e6:8.1f} us per call (before the final wait; "
      f"the wait {(time.perf_counter() - t1) * 1e6:.0f} us)")
for name, kw in (("kernels", {}),):
    from cuflash import api
    plan = next(iter(api._feature_plans.values()))
    print("plan launches:", [(getattr(l, "name", str(l))[:60], getattr(l, "grid", None), getattr(l, "block", None))
                             for l in getattr(plan, "launches", [])])
prof = cProfile.Profile()
prof.enable()
for _ in range(300):
    flash_attn_backward(dout, q, k, v, out, lse, causal=True)
cupy.cuda.Device().synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
