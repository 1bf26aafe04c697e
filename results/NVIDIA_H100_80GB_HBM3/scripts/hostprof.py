"""Host cost pieces (CPU clock) of torch fwd, fwd+bwd, cupy fwd, and eager decode vs SDPA; cProfile dumps."""
import cProfile, pstats, io, os, time, sys
import torch, cupy
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import cuflash
from cuflash.decode import flash_attn_with_kvcache
out = os.environ.get("OUT", ".")
def clock(f, n=2000):
    for _ in range(50): f()
    torch.cuda.synchronize()
    best = 1e9
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n // 5): f()
        dt = (time.perf_counter() - t) / (n // 5) * 1e6
        torch.cuda.synchronize()
        best = min(best, dt)
    return best
def prof(name, f, n=400):
    for _ in range(20): f()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): f()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    open(f"{out}/prof_{name}.txt", "w").write(s.getvalue())
bf = torch.bfloat16
q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=bf) for _ in range(3))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
qtg, ktg, vtg = (x.clone().requires_grad_() for x in (qt, kt, vt))
res = {}
def cf_fwd(): return cuflash.flash_attn_func(q, k, v, causal=True)
def sd_fwd(): return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
def cf_fb(): cuflash.flash_attn_func(qg, kg, vg, causal=True).sum().backward()
def sd_fb(): F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True).sum().backward()
o1 = cuflash.flash_attn_func(qg, kg, vg, causal=True); g1 = torch.randn_like(o1)
def cf_bwd_only():
    o = cuflash.flash_attn_func(qg, kg, vg, causal=True); torch.autograd.backward(o, g1)
o2 = F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True); g2 = torch.randn_like(o2)
def sd_bwd_only():
    o = F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True); torch.autograd.backward(o, g2)
def sumonly(): qtg.sum().backward()
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for name, f in [("cf_fwd", cf_fwd), ("sd_fwd", sd_fwd), ("cf_fwdbwd", cf_fb), ("sd_fwdbwd", sd_fb),
                    ("cf_fwd_bwdgrad", cf_bwd_only), ("sd_fwd_bwdgrad", sd_bwd_only), ("sum_bwd_only", sumonly)]:
        res[name] = clock(f)
    res["cf_fwd2"], res["sd_fwd2"], res["cf_fwdbwd2"], res["sd_fwdbwd2"] = clock(cf_fwd), clock(sd_fwd), clock(cf_fb), clock(sd_fb)
    prof("torch_fwdbwd", cf_fb); prof("torch_fwd", cf_fwd)
# empty-op baselines
res["torch_empty_x2"] = clock(lambda: (q.new_empty(1, 128, 4, 64), q.new_empty(1, 4, 128, dtype=torch.float32)))
cq, ck, cv = (cupy.random.standard_normal((1, 128, 4, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
def cp_fwd(): return cuflash.flash_attn_func(cq, ck, cv, causal=True)
res["cupy_fwd"] = clock(cp_fwd)
res["cupy_empty_x2"] = clock(lambda: (cupy.empty((1, 128, 4, 64), cupy.float16), cupy.empty((1, 4, 128), cupy.float32)))
prof("cupy_fwd", cp_fwd, 2000)
# decode eager host time: b1 ctx 8k, 32:8 heads d128
b, ctx = 1, 256
qd = torch.randn(b, 1, 32, 128, device="cuda", dtype=bf)
kc, vc = (torch.randn(b, ctx, 8, 128, device="cuda", dtype=bf) for _ in range(2))
sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
kn, vn = (torch.randn(b, 1, 8, 128, device="cuda", dtype=bf) for _ in range(2))
qdt, kct, vct = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
res["cf_decode"] = clock(lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl), 1000)
res["cf_decode_append"] = clock(lambda: flash_attn_with_kvcache(qd, kc, vc, k=kn, v=vn, cache_seqlens=sl), 1000)
for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
    with sdpa_kernel(getattr(SDPBackend, be)):
        res["sd_decode_" + be] = clock(lambda: F.scaled_dot_product_attention(qdt, kct, vct, enable_gqa=True), 1000)
prof("decode", lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl), 1000)
import json
json.dump(res, open(f"{out}/hostprof.json", "w"), indent=1)
for k_, v_ in res.items(): print(f"{k_:24s} {v_:8.1f} us")
