"""Extra compute-sanitizer shapes for this session's new defaults (run under compute-sanitizer):
the d64 forward's three-consumer tile (from the 2k bucket), sm90_bwd's dynamic scheduler (d64,
d128 causal) and its d256 kernel, by default selection, forward + backward through torch."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
torch.manual_seed(0)
SH = [(1, 2100, 2100, 4, 2, 64, False), (1, 2100, 1900, 4, 1, 64, True), (1, 700, 900, 4, 2, 128, True),
      (1, 300, 203, 2, 1, 256, False), (1, 203, 300, 2, 2, 256, True)]
for b, sq, sk, h, hk, d, causal in SH:
    q = torch.randn(b, sq, h, d, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print('ok', (b, sq, sk, h, hk, d, causal), flush=True)
print('sanitize extra done')
