"""Where cuflash's torch fwd+bwd host time goes: time spent inside FlashAttnFn.forward and
.backward (wrapped with perf_counter) vs the whole step, next to SDPA and a no-op Python
autograd.Function, interleaved 3 times (the host is noisy). Run on the GPU machine."""
import json, math, os, time
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import cuflash
from cuflash import torch_ops

def per_call(f, n=2000):
    for _ in range(200): f()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best

shape = (1, 128, 4, 64)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

class Nop5(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, args):
        out = q.new_empty(*shape); lse = q.new_empty(1, 4, 128, dtype=torch.float32)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.state = args
        return out
    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        return g, g, g, None

def cf(): cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
def sd():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
sdpa_ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
def sd_pinned(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
def nop(): Nop5.apply(q, k, v, (None, True)).sum().backward()
def nop_fwd(): Nop5.apply(q, k, v, (None, True))
def cf_fwd(): cuflash.flash_attn_func(q, k, v, causal=True)

rows = []
for rep in range(2):
    for name, f in (("sdpa_flash fwdbwd", None), ("cuflash fwdbwd", cf), ("nop5 fwdbwd", nop),
                    ("cuflash fwd (grad)", cf_fwd), ("nop5 fwd (grad)", nop_fwd)):
        if f is None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                us = per_call(sd_pinned)
        else:
            us = per_call(f)
        rows.append({"rep": rep, "what": name, "us": us}); print(f"{rep} {name:24s} {us:8.2f}", flush=True)

# time inside forward / backward
acc = {"fwd": 0.0, "bwd": 0.0, "run": 0.0, "n": 0}
F0, B0 = torch_ops.FlashAttnFn.forward, torch_ops.FlashAttnFn.backward
def fwd(ctx, *a):
    t = time.perf_counter(); r = F0(ctx, *a); acc["fwd"] += time.perf_counter() - t; return r
def bwd(ctx, *a):
    t = time.perf_counter(); r = B0(ctx, *a); acc["bwd"] += time.perf_counter() - t; acc["n"] += 1; return r
torch_ops.FlashAttnFn.forward, torch_ops.FlashAttnFn.backward = staticmethod(fwd), staticmethod(bwd)
R0 = torch_ops._bwd_run
def run(*a):
    t = time.perf_counter(); r = R0(*a); acc["run"] += time.perf_counter() - t; return r
torch_ops._bwd_run = run
for _ in range(200): cf()
acc.update(fwd=0.0, bwd=0.0, run=0.0, n=0)
t = time.perf_counter()
for _ in range(2000): cf()
total = (time.perf_counter() - t) / 2000 * 1e6
inside = {"step_us": total, "in_forward_us": acc["fwd"] / 2000 * 1e6, "in_backward_us": acc["bwd"] / acc["n"] * 1e6, "in_bwd_run_us": acc["run"] / acc["n"] * 1e6}
print(inside)
json.dump({"rows": rows, "inside": inside}, open(os.path.join(os.environ.get("OUT", "."), "host_breakdown2.json"), "w"), indent=1)

# the CuPy path alone, then with gc off (the overhead bench measured it slower than here)
import cupy, gc
from cuflash.timing import host_us
qc, kc, vc = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
f = lambda: cuflash.flash_attn_func(qc, kc, vc, causal=True)
print("cupy host_us", host_us(f, calls=2000, sync=cupy.cuda.Device().synchronize))
print("cupy per_call", per_call(f))
gc.disable(); print("cupy host_us gc off", host_us(f, calls=2000, sync=cupy.cuda.Device().synchronize)); gc.enable()
