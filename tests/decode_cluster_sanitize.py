"""decode_splitkv_regs' clusters (regs_cluster: the splits merged through distributed shared memory)
for compute-sanitizer (memcheck, racecheck); not a test. bf16, d 128, 32:8 heads, one query row,
clusters of 16, 8 and 2 CTAs: batch 3 with 3000, 0 and 17 keys (a row without keys, splits without
keys), contiguous and paged (page 16, a cache_leftpad that puts tiles across pages); d 64 with 16
packed rows (two row tiles) under a causal window; one batch row of capacity 8192 at 8192, 3001 and
0 keys. Each call twice.

    compute-sanitizer --tool memcheck python tests/decode_cluster_sanitize.py
    compute-sanitizer --tool racecheck python tests/decode_cluster_sanitize.py [--quick]

--quick: clusters of 16 and 2 only, each call once (racecheck is slow).
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from decode_regs_sanitize import batch3_inputs  # noqa: E402  (the regs sanitizer's batch-3 call)
from cuflash.families.decode_splitkv import DecodeConfig  # noqa: E402

CLUSTERS = (16, 8, 2)


def main():
    base = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=6)
    q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
    q64 = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    k64, v64 = (torch.randn(2, 2000, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens64 = torch.tensor([1999, 77], device="cuda", dtype=torch.int32)
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    quick = "--quick" in sys.argv   # racecheck's pass: clusters of 16 and 2, each call once
    runs, names = 0, []
    for cl in (16, 2) if quick else CLUSTERS:
        cfg = base.replace(regs_cluster=cl)
        cfg64 = base.replace(head_dim=64, m_tiles=2, regs=3, causal=True, regs_cluster=cl)
        names += [cfg.name, cfg64.name]
        for _ in range(1 if quick else 2):
            kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens)
            kvcache_with_config(cfg, q, kp, vp, cache_seqlens=lens, block_table=table, cache_leftpad=pad)
            kvcache_with_config(cfg64, q64, k64, v64, cache_seqlens=lens64, causal=True, window_size=(300, 0))
            for n in (8192, 3001, 0):
                kvcache_with_config(cfg, q1, k1, v1, cache_seqlens=torch.tensor([n], device="cuda", dtype=torch.int32))
            runs += 6
    torch.cuda.synchronize()
    print(f"cluster sanitize done: {runs} runs ({', '.join(names)})")


if __name__ == "__main__":
    main()
