"""One profiled decode call (the third of three) under ncu --profile-from-start off.
usage: prof_dec.py BATCH CTX [PAGE]  (bf16, 32:8 heads, d128, one query token)"""
import sys
import torch
import cuflash
b, ctx = int(sys.argv[1]), int(sys.argv[2])
page = int(sys.argv[3]) if len(sys.argv) > 3 else 0
q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
if page:
    nb = b * (-(-ctx // page))
    kc, vc = (torch.randn(nb, page, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(b, -1)
else:
    kc, vc = (torch.randn(b, ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bt = None
lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
for i in range(3):
    torch.cuda.synchronize()
    if i == 2:
        torch.cuda.profiler.start()
    cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt)
    torch.cuda.synchronize()
torch.cuda.profiler.stop()
