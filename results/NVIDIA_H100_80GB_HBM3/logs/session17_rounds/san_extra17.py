"""compute-sanitizer shapes for the shipped defaults: session 16's (san_extra16.py, run first), then
session 17's stream_tail, dq_convert, drop_early and varlen d64 on sm90_bwd."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session16_rounds", "san_extra16.py"))
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(1)
# session 17: stream_tail (d128 non-causal 2k, d256 non-causal 4k: more tiles than SMs, so the last
# stretch is cut by K/V blocks), dq_convert (d128 causal / fp16 non-causal up to 4k), drop_early (d128
# dropout), varlen at d64 on sm90_bwd
for dt, d, s, h, causal, bwd in ((bf, 128, 2048, 10, False, True), (torch.float16, 128, 2048, 10, False, True),
                                 (bf, 256, 4096, 5, False, False), (bf, 128, 1000, 4, True, True),
                                 (torch.float16, 128, 1500, 4, True, True)):
    q = torch.randn(1, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, s, h, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, s, h, d, device=dev, dtype=dt, requires_grad=True)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal)
        if bwd:
            o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok s17", (str(dt), d, s, h, causal, bwd), flush=True)
for causal in (False, True):
    q = torch.randn(1, 700, 4, 128, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(1, 900, 2, 128, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(1, 900, 2, 128, device=dev, dtype=bf, requires_grad=True)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, dropout_p=0.1, causal=causal)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok dropout", causal, flush=True)
lens = [0, 17, 300, 1023, 5]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
tot = int(cu[-1])
q = torch.randn(tot, 4, 64, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(tot, 2, 64, device=dev, dtype=bf, requires_grad=True)
v = torch.randn(tot, 2, 64, device=dev, dtype=bf, requires_grad=True)
for _ in range(2):
    o = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    o.float().square().sum().backward()
torch.cuda.synchronize()
print("ok varlen d64", flush=True)
print("sanitize extra done")
