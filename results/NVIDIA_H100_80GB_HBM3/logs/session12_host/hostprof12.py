"""Host time per call (µs, 2000 calls, no sync inside) and a cProfile of the FP8 hot path."""
import cProfile, pstats, time, io, torch, cuflash
torch.manual_seed(0)
q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
one = torch.ones(1, device="cuda")
def per_call(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    el = time.perf_counter() - t; torch.cuda.synchronize()
    return el / n * 1e6
import torch.nn.functional as F
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
rows = {
 "bf16 fwd": lambda: cuflash.flash_attn_func(q, k, v, causal=True),
 "fp8 fwd, descales": lambda: cuflash.flash_attn_func(q8, k8, v8, causal=True, q_descale=one, k_descale=one, v_descale=one),
 "fp8 fwd, no descales": lambda: cuflash.flash_attn_func(q8, k8, v8, causal=True),
 "sdpa default": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
}
for name, fn in rows.items():
    print(f"{name:24s} {per_call(fn):7.1f} us", flush=True)
qg = q.clone().requires_grad_(); kg = k.clone().requires_grad_(); vg = v.clone().requires_grad_()
def fb():
    cuflash.flash_attn_func(qg, kg, vg, causal=True).sum().backward()
print(f"{'bf16 fwd+bwd':24s} {per_call(fb, 500):7.1f} us", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): rows["fp8 fwd, descales"]()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue())
