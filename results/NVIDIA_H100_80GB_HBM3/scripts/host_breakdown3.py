"""Where the torch fwd+bwd host time goes, part 3 (same process, interleaved): the real step
vs the step with the kernels' launches replaced by no-ops (forward, backward, both), and the
backward's launch+alloc cost on the main thread vs inside autograd's device thread."""
import math, time, json, os
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import cuflash
from cuflash import torch_ops, launch

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
def cf(): cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
def sd(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
cf(); torch.cuda.synchronize()
fplan = next(iter(torch_ops._fwd_plans.values())).plan
entry = next(iter(torch_ops._fwd_plans.values()))
bplan = next(iter(entry.bwd.values()))[1]
real_f, real_b = fplan.run, bplan.run
noop = lambda *a: None
rows = []
def rec(name, f):
    us = per_call(f); rows.append((name, us)); print(f"{name:44s} {us:8.2f}", flush=True)
for rep in range(2):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec(f"{rep} sdpa_flash step", sd)
    fplan.run, bplan.run = real_f, real_b
    rec(f"{rep} cuflash step", cf)
    fplan.run, bplan.run = noop, real_b
    rec(f"{rep} cuflash step, fwd launch no-op", cf)
    fplan.run, bplan.run = real_f, noop
    rec(f"{rep} cuflash step, bwd launches no-op", cf)
    fplan.run, bplan.run = noop, noop
    rec(f"{rep} cuflash step, no launches", cf)
fplan.run, bplan.run = real_f, real_b
# the backward's launch + allocations: main thread vs autograd's device thread
acc = {"t": 0.0, "n": 0}
R0 = torch_ops._bwd_run
def run(*a):
    t = time.perf_counter(); r = R0(*a); acc["t"] += time.perf_counter() - t; acc["n"] += 1; return r
torch_ops._bwd_run = run
for _ in range(300): cf()
acc.update(t=0.0, n=0)
for _ in range(2000): cf()
in_thread = acc["t"] / acc["n"] * 1e6
torch_ops._bwd_run = R0
out = torch.empty_like(q); lse = torch.empty(1, 4, 128, device="cuda")
dout = torch.randn_like(q)
ptrs = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
main_thread = per_call(lambda: R0(bplan, ptrs, q, k, v, shape, shape))
print(f"_bwd_run in autograd's thread {in_thread:.2f} us, on the main thread {main_thread:.2f} us")
json.dump({"rows": rows, "bwd_run_in_thread_us": in_thread, "bwd_run_main_thread_us": main_thread},
          open(os.path.join(os.environ.get("OUT", "."), "host_breakdown3.json"), "w"), indent=1)
