"""Two decode_splitkv calls for compute-sanitizer (racecheck, memcheck) on the dynamic block claims
(kDynamic 1: thread 0's claimed ids through the shared-memory ring, the claim counter's reset) and
their equal-run fallback in the same kernel; not a test. bf16, d 128, 32:8 heads, one query row:
1 x 8192 keys with 2 splits (32 blocks per split: claims), then 3 splits (21: equal runs), each
twice (the second call finds the counters reset).

    compute-sanitizer --tool racecheck python tests/decode_claims_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import get  # noqa: E402


def main():
    p = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)
    cfg = get("decode_splitkv").heuristic(p).replace(fused_combine=True, early_merge=True, ring_fill=1, dynamic=1)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), 8192, device="cuda", dtype=torch.int32)
    runs = 0
    for splits in (2, 3):
        for _ in range(2):
            kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens, num_splits=splits)
            runs += 1
    torch.cuda.synchronize()
    print(f"claims sanitize done: {runs} runs ({cfg.name})")


if __name__ == "__main__":
    main()
