"""torch.profiler view (CPU side) of one tiny fwd+bwd step, cuflash vs SDPA flash, same run:
which autograd nodes and aten ops each step runs, and their CPU time (profiler overhead
included, so compare the two columns, not the absolute values)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import profile, ProfilerActivity
import cuflash

shape = (1, 128, 4, 64)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
def cf(): cuflash.flash_attn_func(q, k, v, causal=True).sum().backward()
def sd(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).sum().backward()
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for name, f in (("sdpa_flash", sd), ("cuflash", cf)):
        for _ in range(100): f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50): f()
            torch.cuda.synchronize()
        print(f"===== {name} (50 steps)")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
