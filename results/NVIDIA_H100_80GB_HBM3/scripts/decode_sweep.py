"""Decode: time splits x configs per cell (CUDA-graph), beside SDPA flash/cuDNN and a copy ceiling."""
import json, sys, os, time
import torch
from cuflash.bench.decode import time_graph, _cache, _fn, HQ, HK, D
from cuflash.decode import kvcache_with_config
from cuflash.families.decode_splitkv import DecodeConfig
out = os.environ.get("OUT", ".")
cells = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072), (32, 8192), (32, 32768), (64, 32768), (16, 65536)]
cfgs = [DecodeConfig(4, 16, 3, 2, 2, 128, "bf16", False), DecodeConfig(4, 16, 4, 2, 2, 128, "bf16", False),
        DecodeConfig(8, 16, 2, 2, 2, 128, "bf16", False), DecodeConfig(4, 32, 2, 2, 2, 128, "bf16", False),
        DecodeConfig(2, 16, 4, 2, 2, 128, "bf16", False), DecodeConfig(8, 16, 3, 2, 2, 128, "bf16", False)]
splits_all = [1, 2, 3, 4, 5, 6, 8, 11, 12, 16, 17, 22, 24, 32, 33, 44, 48, 64, 66, 96, 128]
recs = []
t0 = time.time()
for b, ctx in cells:
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    kc, vc, _ = _cache(b, ctx, 0, torch.bfloat16)
    kvb = 2 * b * ctx * HK * D * 2
    for impl in ("cuflash", "sdpa_flash", "sdpa_cudnn"):
        us = time_graph(_fn(impl, q, kc, vc, None, sl), 5)
        recs.append(dict(impl=impl, b=b, ctx=ctx, us=us, tbps=kvb / us / 1e6)); print(recs[-1], flush=True)
    dst = torch.empty_like(kc)
    us = time_graph(lambda: dst.copy_(kc), 5)
    recs.append(dict(impl="copy_k", b=b, ctx=ctx, us=us, tbps=2 * kc.numel() * 2 / us / 1e6)); print(recs[-1], flush=True)
    del dst
    for cfg in cfgs:
        blocks = ctx // cfg.block_n
        best = None
        for s in splits_all:
            if s > blocks:
                continue
            c = cfg.replace(splits=s)
            try:
                us = time_graph(lambda: kvcache_with_config(c, q, kc, vc, cache_seqlens=sl), 5)
            except Exception as e:
                print("ERR", c.name, repr(e)[:200]); continue
            r = dict(impl="cfg", cfg=c.name, b=b, ctx=ctx, splits=s, us=us, tbps=kvb / us / 1e6)
            recs.append(r)
            if best is None or us < best["us"]:
                best = r
        print("BEST", best, flush=True)
    del kc, vc
    torch.cuda.empty_cache()
    if time.time() - t0 > 200:
        print("time cap"); break
json.dump(recs, open(f"{out}/decode_sweep.json", "w"), indent=0)
