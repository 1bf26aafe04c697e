"""One profiled call (the second of two) of cuflash at the FA benchmark shape: run under
ncu --profile-from-start off.  usage: prof1.py fwd|bwd D causal|full SEQLEN [dtype]"""
import sys
import torch
import cuflash
op, d, mask, s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[5] if len(sys.argv) > 5 else "bf16"]
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
leaves = [x.requires_grad_() for x in (q, k, v)]
for i in range(2):
    o = cuflash.flash_attn_func(*leaves, causal=mask == "causal")
    torch.cuda.synchronize()
    if i:
        torch.cuda.profiler.start()
    if op == "fwd" and i:
        o = cuflash.flash_attn_func(*leaves, causal=mask == "causal")
    else:
        torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()

