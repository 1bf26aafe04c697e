"""compute-sanitizer shapes for the shipped defaults: session 17's (san_extra17.py, which runs session
16's first), then session 18's new paths."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_rounds", "san_extra17.py"))
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(2)
# session 18's new default paths: dq_first (bf16 d128 plain backward up to 2k, causal and not; fp16
# causal), the feature backwards on the plain call's schedule (bf16 d128 softcap / ALiBi / window), the
# fixed-max softcap forward's rounded row sum (seqlen_k 1 and 300), the decode without an LSE store
def qkv(b, sq, sk, h, hk, d, dt):
    mk = lambda s, hh: torch.randn(b, s, hh, d, device=dev, dtype=dt, requires_grad=True)  # noqa: E731
    return mk(sq, h), mk(sk, hk), mk(sk, hk)
for dt, sq, sk, h, hk, causal, kw in ((bf, 1000, 1000, 4, 4, False, {}), (bf, 777, 1000, 4, 2, True, {}),
                                      (torch.float16, 1000, 1000, 4, 4, True, {}),
                                      (bf, 700, 700, 4, 4, True, dict(softcap=30.0)),
                                      (bf, 700, 900, 4, 2, False, dict(alibi_slopes=torch.rand(4, device=dev))),
                                      (bf, 900, 900, 4, 4, True, dict(window_size=(256, 0))),
                                      (bf, 17, 1, 4, 4, False, dict(softcap=30.0)),
                                      (bf, 300, 300, 4, 1, True, dict(softcap=5.0))):
    q, k, v = qkv(1, sq, sk, h, hk, 128, dt)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal, **kw)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok s18", (str(dt), sq, sk, h, hk, causal, sorted(kw)), flush=True)
kc = torch.randn(2, 4096, 8, 128, device=dev, dtype=bf)
vc = torch.randn(2, 4096, 8, 128, device=dev, dtype=bf)
qd = torch.randn(2, 1, 32, 128, device=dev, dtype=bf)
for n in (0, 1, 3):
    cuflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=torch.tensor([4000, 77], dtype=torch.int32, device=dev),
                                    num_splits=n)
torch.cuda.synchronize()
print("ok s18 decode", flush=True)
