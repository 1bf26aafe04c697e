"""compute-sanitizer shapes for the shipped defaults (session 16: d128 dynamic + frag_pin, d64 dk_late / q_rotate, d256 roles + dq_writer), by default selection through torch:
sm90_bwd d128 (dq_early / dk_late / ds_double heuristic) and d256 / d192 (dq_writer), the
non-causal sm90_fwd tiles (HEURISTIC_NC), the d128 feature defaults (window, softcap, ALiBi),
and decode (batch 1 contiguous, pages of 16 and 256)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
SH = [(1, 700, 900, 4, 2, 128, True, {}), (1, 900, 700, 4, 1, 128, False, {}),
      (1, 300, 203, 2, 1, 256, False, {}), (1, 203, 300, 2, 2, 192, True, {}),
      (1, 2100, 2100, 2, 2, 256, False, {}), (1, 1500, 1500, 2, 1, 128, False, {}),
      (1, 1100, 1300, 4, 2, 128, True, dict(window_size=(256, 0))),
      (1, 1100, 1000, 4, 2, 128, False, dict(window_size=(200, 300))),
      (1, 900, 1100, 4, 2, 128, True, dict(softcap=30.0)),
      (1, 900, 900, 4, 2, 128, True, dict(alibi_slopes=torch.rand(4, device=dev) * 0.3))]
for b, sq, sk, h, hk, d, causal, kw in SH:
    q = torch.randn(b, sq, h, d, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=bf, requires_grad=True)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal, **kw)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok", (b, sq, sk, h, hk, d, causal, sorted(kw)), flush=True)
# fp16 d64 non-causal (q_rotate) and d64 causal (dk_late) by default selection
for sq, sk, causal in ((700, 900, False), (513, 513, True)):
    q = torch.randn(1, sq, 4, 64, device=dev, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, sk, 2, 64, device=dev, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, sk, 2, 64, device=dev, dtype=torch.float16, requires_grad=True)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok fp16 d64", (sq, sk, causal), flush=True)
# decode: batch 1 contiguous (fused combine), paged 16 / 256
for batch, ctx, page in ((1, 8192, 0), (2, 3000, 16), (3, 5000, 256), (1, 20000, 16)):
    q = torch.randn(batch, 1, 32, 128, device=dev, dtype=bf)
    if page:
        nb = batch * (-(-ctx // page))
        kc = torch.randn(nb, page, 8, 128, device=dev, dtype=bf)
        vc = torch.randn(nb, page, 8, 128, device=dev, dtype=bf)
        bt = torch.randperm(nb, device=dev, dtype=torch.int32).reshape(batch, -1)
    else:
        kc = torch.randn(batch, ctx, 8, 128, device=dev, dtype=bf)
        vc = torch.randn(batch, ctx, 8, 128, device=dev, dtype=bf)
        bt = None
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32) - torch.arange(batch, device=dev, dtype=torch.int32)
    for _ in range(2):
        cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt)
    torch.cuda.synchronize()
    print("ok decode", (batch, ctx, page), flush=True)
print("sanitize extra done")
