"""Host µs per call of the CuPy paths (tiny problem), split: fwd, fwd+lse, bwd alone, fwd+lse+bwd."""
import statistics, sys, time
import cupy
from cuflash.api import flash_attn_backward, flash_attn_func

shape = (1, 128, 4, 64)
q, k, v, dout = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
fns = {
    "fwd": lambda: flash_attn_func(q, k, v, causal=True),
    "fwd_lse": lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True),
    "bwd": lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=True),
}
def both():
    o, l, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    return flash_attn_backward(dout, q, k, v, o, l, causal=True)
fns["fwd_bwd"] = both
for f in fns.values():
    for _ in range(200): f()
cupy.cuda.Device().synchronize()
per = {n: [] for n in fns}
for _ in range(11):
    for n, f in fns.items():
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(300): f()
        per[n].append((time.perf_counter() - t0) / 300 * 1e6)
cupy.cuda.Device().synchronize()
print(sys.argv[1], " ".join(f"{n} {min(v):.1f}/{statistics.median(v):.1f}" for n, v in per.items()))
if len(sys.argv) > 2:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): both()
    pr.disable(); cupy.cuda.Device().synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
