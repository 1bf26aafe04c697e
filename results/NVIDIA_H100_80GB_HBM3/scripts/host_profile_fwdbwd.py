"""Where the torch fwd+bwd host time goes (tiny problem), on the GPU machine."""
import cProfile, pstats, time, torch, cuflash, io
import torch.nn.functional as F
q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.ones(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
def step():
    cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
def step_ones():
    cuflash.flash_attn_func(q, k, v, causal=True).backward(g)
def fwd_only():
    out = cuflash.flash_attn_func(q, k, v, causal=True)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
def sdpa():
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
for f in (step, step_ones, fwd_only, sdpa, step):
    for _ in range(50): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(1000): f()
    host = (time.perf_counter() - t) / 1000 * 1e6
    torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 1000 * 1e6
    print(f"{f.__name__}: host {host:.1f} us/call, wall incl. drain {wall:.1f}")
pr = cProfile.Profile(); pr.enable()
for _ in range(300): step()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue())
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20): step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
