"""decode_splitkv_stream calls for compute-sanitizer (racecheck, memcheck); not a test. bf16, d 128,
32:8 heads, one query row: batch 3 with 3000, 0 and 17 keys (a row without items, a group shorter
than a range) on 3 CTAs (ranges over several groups, pieces merged by the last CTA) and on the
resident slots, contiguous and paged (page 16), each twice (the second call finds the counters
reset); then the split kernel with light_fence (3 splits), twice.

    compute-sanitizer --tool racecheck python tests/decode_stream_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import get  # noqa: E402


def main():
    p = Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128)
    cfg = get("decode_splitkv").heuristic(p).replace(fused_combine=True, early_merge=True, ring_fill=0, dynamic=0, light_fence=False,
                                                      stream=True)
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(3, 3008, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3000, 0, 17], device="cuda", dtype=torch.int32)
    table = torch.randperm(3 * 3008 // 16, device="cuda", dtype=torch.int32).reshape(3, -1)
    kp, vp = (x.reshape(-1, 16, 8, 128) for x in (kc, vc))
    runs = 0
    for ctas in (3, 0):
        for paged in (False, True):
            for _ in range(2):
                if paged:
                    kvcache_with_config(cfg.replace(l2_prefetch=0), q, kp, vp, cache_seqlens=lens, block_table=table,
                                        num_splits=ctas)
                else:
                    kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens, num_splits=ctas)
                runs += 1
    lf = cfg.replace(stream=False, light_fence=True)   # the split kernel's light-fence count
    for _ in range(2):
        kvcache_with_config(lf, q, kc, vc, cache_seqlens=lens, num_splits=3)
        runs += 1
    torch.cuda.synchronize()
    print(f"stream sanitize done: {runs} runs ({cfg.name}, {lf.name})")


if __name__ == "__main__":
    main()
