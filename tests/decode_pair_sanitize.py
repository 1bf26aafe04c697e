"""REGS_CLUSTER_PAIRS' calls (the regs kernel's 2 splits as one cluster of 2 CTAs, merged through distributed
shared memory) for compute-sanitizer (memcheck, racecheck, synccheck); not a test. bf16, d 128, 32:8 heads, one
query row, batch 8 (64 groups: 2 splits on 132 SMs) of capacity 9000 with ragged rows (0, 1, block edges, full),
through flash_attn_with_kvcache as users call it (the shape rule's interleaved order with its early prefetch),
contiguous and, with REGS_CLUSTER_PAIRS_PAGED, paged (page 16 with the staged page table, a leftpad across pages).
Each call twice.

    compute-sanitizer --tool memcheck python tests/decode_pair_sanitize.py
    compute-sanitizer --tool racecheck python tests/decode_pair_sanitize.py
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

from cuflash import decode  # noqa: E402
from cuflash.decode import flash_attn_with_kvcache  # noqa: E402
from cuflash.families import decode_splitkv as mod  # noqa: E402


def main():
    mod.REGS_CLUSTER_PAIRS = mod.REGS_CLUSTER_PAIRS_PAGED = True
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(8, 9008, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([9000, 0, 1, 8191, 8192, 4097, 129, 7777], device="cuda", dtype=torch.int32)
    pad = torch.tensor([5, 0, 0, 16, 0, 1, 2, 7], device="cuda", dtype=torch.int32)
    table = torch.randperm(8 * 9008 // 16, device="cuda", dtype=torch.int32).reshape(8, -1)
    kp, vp = (x.reshape(-1, 16, 8, 128) for x in (kc, vc))
    for _ in range(2):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, cache_leftpad=pad)
    torch.cuda.synchronize()
    names = sorted({e.plan.config.name for e in decode._gpu_plans.values() if e.plan is not None})
    assert names and all("_cl2" in n for n in names), names
    print(f"pair sanitize done: 4 runs ({', '.join(names)})")


if __name__ == "__main__":
    main()
