"""Host cost of each piece of the torch fwd+bwd and CuPy forward paths (tiny problem).

Each line: CPU µs per call over N calls (no sync inside; best of 5). Run on the GPU machine.
"""
import math, sys, time
import torch, cupy
import torch.nn.functional as F
import cuflash
from cuflash import torch_ops, api

N = 2000
def per_call(f, n=N):
    for _ in range(200): f()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best

rows = []
def rec(name, f):
    us = per_call(f); rows.append((name, us)); print(f"{name:40s} {us:8.2f} us", flush=True)

shape = (1, 128, 4, 64)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
from torch.nn.attention import sdpa_kernel, SDPBackend

def cf_step():
    cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
def sdpa_step():
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    rec("sdpa_flash fwd+bwd", sdpa_step)
    rec("sdpa_flash fwd", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
rec("cuflash fwd+bwd", cf_step)
with torch.no_grad():
    rec("cuflash fwd (no grad)", lambda: cuflash.flash_attn_func(q, k, v, causal=True))
rec("cuflash fwd (grad, no bwd)", lambda: cuflash.flash_attn_func(q, k, v, causal=True))

class Nop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape)
    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return g, g, g
rec("python Function nop fwd+bwd (sum)", lambda: Nop.apply(q, k, v).sum().backward())
rec("C++ op fwd+bwd ((q*2).sum)", lambda: (q * 2).sum().backward())
rec("sum().backward() only, leaf", lambda: qt.sum().backward())
rec("q.new_empty(*shape)", lambda: q.new_empty(*shape))
rec("torch.empty(shape, dtype, device)", lambda: torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
g = torch.ones(shape, device="cuda", dtype=torch.bfloat16).expand(shape)
rec("expanded.clone(contiguous)", lambda: g.clone(memory_format=torch.contiguous_format))
rec("torch_ops._raw_stream(0)", lambda: torch_ops._raw_stream(0))

# the plans themselves
with torch.no_grad():
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
fplan = next(iter(torch_ops._fwd_plans.values())).plan
bplans = [p for p in torch_ops._bwd_plans.values() if not isinstance(p, str)]
dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
ptrs_f = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
stream = torch_ops._raw_stream(0)
rec(f"fwd plan.run ({len(fplan._calls)} launch)", lambda: fplan.run(ptrs_f, 0, stream))
if bplans:
    bp = bplans[0]
    ws = q.new_empty(bp.workspace_bytes, dtype=torch.uint8)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    ptrs_b = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
              dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    rec(f"bwd plan.run ({len(bp._calls)} launches)", lambda: bp.run(ptrs_b, ws.data_ptr(), stream))
    rec("bwd _bwd_run (alloc 4 + run)", lambda: torch_ops._bwd_run(bp, ptrs_b[:6], q, k, v, shape, shape))
    launch = bp._launch; fn = bp._calls[0]
    rec("one raw launchKernel", lambda: launch(fn[0], fn[1], fn[2], fn[3], fn[4], 1, 1, fn[5], stream, bp._argv_ptr, 0))

# CuPy
qc, kc, vc = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
rec("cupy flash_attn_func fwd", lambda: cuflash.flash_attn_func(qc, kc, vc, causal=True))
rec("cupy.empty(shape, f16)", lambda: cupy.empty(shape, cupy.float16))
rec("cupy get_current_stream().ptr", lambda: cupy.cuda.get_current_stream().ptr)
rec("cupy runtime.getDevice()", lambda: cupy.cuda.runtime.getDevice())
cp = next(iter(api._cupy_plans.values()))
rec("cupy _CupyForward.forward_ptrs", lambda: cp.forward_ptrs(qc.data.ptr, kc.data.ptr, vc.data.ptr))
import json, os
out_dir = os.environ.get("OUT", ".")
json.dump([{"what": n, "us_per_call": u} for n, u in rows], open(os.path.join(out_dir, "host_breakdown.json"), "w"), indent=1)
