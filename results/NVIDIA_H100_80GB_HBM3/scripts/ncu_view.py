"""One profiled forward and backward, bf16 d128 non-causal 16k (batch 1, 16 heads): run under
ncu --profile-from-start off; the profiled region is the second call."""
import sys
import torch
import cuflash
causal = len(sys.argv) > 1 and sys.argv[1] == "causal"
q, k, v, do = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
leaves = [x.requires_grad_() for x in (q, k, v)]
for i in range(2):
    if i:
        torch.cuda.synchronize(); torch.cuda.profiler.start()
    o = cuflash.flash_attn_func(*leaves, causal=causal)
    torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
torch.cuda.profiler.stop()
