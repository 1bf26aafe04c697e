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
prof = cProfile.Profile()
prof.enable()
for _ in range(300):
    flash_attn_backward(dout, q, k, v, out, lse, causal=True)
cupy.cuda.Device().synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
