"""ncu target: the second call of each shape is profiled. bwd_D_C_S (sm90_bwd), fwd_D_C_S."""
import sys, torch, cuflash
which = sys.argv[1]
torch.manual_seed(0)
_, d, c, s = which.split("_"); d, s, causal = int(d), int(s), c == "c"
h, b = 2048 // d, 16384 // s
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
for i in range(2):
    if i: torch.cuda.synchronize(); torch.cuda.profiler.start()
    o = cuflash.flash_attn_func(q, k, v, causal=causal)
    if which.startswith("bwd"): torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
torch.cuda.profiler.stop()
