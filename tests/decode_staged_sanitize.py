"""decode_splitkv_regs with the staged ring (regs_staged, kStaged) for compute-sanitizer (memcheck, racecheck,
synccheck); not a test. bf16, d 128, 32:8 heads, one query row, batch 3 with 3000, 0 and 17 keys
(tests/decode_regs_sanitize.py's inputs: a row without keys, a ragged top block, a leftpad): 4 warps with ring
depths 1, 2, 4 and 8 warps with 2, at 1, 3 and 32 splits (fused combine, each config twice: the counters back
at 0), the separate combine, the interleaved order with its early prefetch, paged caches (page 16: the plain
loop under the same config), d 64 with two row tiles; then one batch row (capacity 8192) at 8192 and 3001 keys
with the batch-1 rule's config (4 warps, depth 2, 32 splits); then the shipped batch-1 config (REGS_BATCH1_RULES:
the separate combine with its early partial-O loads, pdl 1) at 1, 3, 16 and 40 splits.

    compute-sanitizer --tool memcheck python tests/decode_staged_sanitize.py [--shipped]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from decode_regs_sanitize import _regs_config, batch3_inputs, one_row  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def configs():
    """The configs this script runs (tests/decode_precompile.py compiles them first)."""
    base = _regs_config(Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128)).replace(warps=4, regs_staged=2)
    d64 = _regs_config(Problem("decode", "bf16", 2, 4, 1999, 8, 2, 64, True, False), 1).replace(warps=4, regs_staged=2)
    return base, [base, base.replace(regs_staged=1), base.replace(regs_staged=4), base.replace(warps=8),
                  base.replace(fused_combine=False, light_fence=False),
                  base.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3)], d64


def shipped_calls(q1, k1, v1) -> int:
    """The shipped batch-1 config (REGS_BATCH1_RULES: separate combine, early partial-O loads, pdl 1), each call
    a programmatic dependent of the previous call's combine, at 1, 3, 16 and 40 splits: the calls made."""
    from cuflash.registry import get

    shipped = get("decode_splitkv").heuristic(Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128))
    assert shipped.early_merge and shipped.pdl == 1 and not shipped.fused_combine, shipped.name
    return sum(one_row(shipped, q1, k1, v1, splits) + one_row(shipped, q1, k1, v1, splits) for splits in (1, 3, 16, 40))


def main():
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if "--shipped" in sys.argv:   # the shipped config only (a short sanitizer pass)
        runs = shipped_calls(q1, k1, v1)
        torch.cuda.synchronize()
        print(f"{runs} calls of the shipped batch-1 config ok")
        return
    base, cfgs, d64 = configs()
    q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
    runs = 0
    for cfg in cfgs:
        for splits in (1, 3, 32):
            for _ in range(2):
                kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, num_splits=splits)
                runs += 1
        kvcache_with_config(cfg, q, kp, vp, cache_seqlens=lens, block_table=table, cache_leftpad=pad, num_splits=3)
        runs += 1
    q4 = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    k4, v4 = (torch.randn(2, 2000, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    l4 = torch.tensor([1999, 700], device="cuda", dtype=torch.int32)
    kvcache_with_config(d64, q4, k4, v4, cache_seqlens=l4, causal=True, window_size=(300, 0), num_splits=3)
    runs += 1 + one_row(base.replace(regs=1), q1, k1, v1, 32) + shipped_calls(q1, k1, v1)
    torch.cuda.synchronize()
    print(f"{runs} staged calls ok: {', '.join(c.name for c in cfgs + [d64])}")


if __name__ == "__main__":
    main()
