import os, sys
sys.path.insert(0, os.getcwd())
import torch, cuflash
torch.manual_seed(0)
for kw in (dict(softcap=30.0), dict(alibi_slopes=torch.rand(4, device="cuda") * 0.3), dict(window_size=(256, 0))):
    for causal in (False, True):
        q, k, v = (torch.randn(1, 900, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        o = cuflash.flash_attn_func(q, k, v, causal=causal, **kw)
        o.float().square().sum().backward()
        torch.cuda.synchronize(); print("ok", sorted(kw), causal, flush=True)
