"""decode_splitkv_regs calls for compute-sanitizer (memcheck, racecheck); not a test. bf16, d 128,
32:8 heads, one query row: batch 3 with 3000, 0 and 17 keys (a row without keys, a ragged top
block), contiguous and paged (page 16, with a cache_leftpad that puts tiles across pages), at 1
and 3 splits (the fused combine with light_fence), each twice (the second call finds the
counters reset); then d 64 with 16 packed rows (two row tiles, 3 splits) and a causal window;
then the contiguous calls again with regs_ahead 3 (L2), 2 (L1) under the evict-last hint (7), and
regs_order 2 (interleaved blocks, the first loaded before the lengths) with regs_ahead 2; then one
batch row (capacity 8192, 8192 and 3001 keys) under the batch-1 rules' options (the early L1
prefetch of 1, 2 and 3 blocks, 4 warps, regs_order 2).

    compute-sanitizer --tool memcheck python tests/decode_regs_sanitize.py [--page-table]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from cuflash.families import decode_splitkv as mod  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import get  # noqa: E402


def _regs_config(problem, regs=1):
    old = mod.REGS_DEFAULT, mod.REGS_HEAD_DIM_DEFAULT
    mod.REGS_DEFAULT, mod.REGS_HEAD_DIM_DEFAULT = regs, (64, 128)
    try:
        cfg = get("decode_splitkv").heuristic(problem)
    finally:
        mod.REGS_DEFAULT, mod.REGS_HEAD_DIM_DEFAULT = old
    assert cfg.regs == regs, cfg.name
    return cfg


def batch3_inputs():
    """(q, k_cache, v_cache, cache_seqlens, cache_leftpad, block_table, k pages, v pages): batch 3 with
    3000, 0 and 17 keys, the pages (16 keys) viewing the contiguous caches."""
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(3, 3008, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3000, 0, 17], device="cuda", dtype=torch.int32)
    pad = torch.tensor([5, 0, 3], device="cuda", dtype=torch.int32)
    table = torch.randperm(3 * 3008 // 16, device="cuda", dtype=torch.int32).reshape(3, -1)
    kp, vp = (x.reshape(-1, 16, 8, 128) for x in (kc, vc))
    return q, kc, vc, lens, pad, table, kp, vp


def one_row(cfg, q1, k1, v1, splits) -> int:
    """One batch row (capacity 8192) at 8192 and 3001 keys: the calls made."""
    for n in (8192, 3001):
        kvcache_with_config(cfg, q1, k1, v1, cache_seqlens=torch.tensor([n], device="cuda", dtype=torch.int32),
                            num_splits=splits)
    return 2


def page_table_and_order():
    """Session 25's paths only (--page-table): the staged page ids (regs_page_table; page 16 with a
    leftpad across pages, a 40000-key row of page 16 wider than the staged ids at 1 split: its top 2048
    pages staged, the rest read from the table), with the paged prefetch of 1 / 3 blocks after the first
    two (regs_order 0 and 1), and the contiguous interleaved order with its first 3 blocks prefetched
    before the lengths arrive (batch 3 ragged, one row full and short), at 1 and 3 splits."""
    cfg = _regs_config(Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128))
    q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
    runs, names = 0, []
    paged = [cfg.replace(regs_page_table=1), cfg.replace(regs_page_table=1, regs_prefetch=True),
             cfg.replace(regs=6, regs_page_table=1, regs_prefetch=True, regs_prefetch_blocks=3),
             cfg.replace(regs=6, regs_page_table=1, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3)]
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(2500, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table1 = torch.randperm(2500, device="cuda", dtype=torch.int32).reshape(1, -1)
    for c in paged:
        names.append(c.name)
        for splits in (1, 3):
            kvcache_with_config(c, q, kp, vp, cache_seqlens=lens, block_table=table, cache_leftpad=pad,
                                num_splits=splits)
            kvcache_with_config(c, q1, k1, v1, cache_seqlens=torch.tensor([40000], device="cuda", dtype=torch.int32),
                                block_table=table1, num_splits=splits)
            runs += 2
    contiguous = [cfg.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3)]
    k8, v8 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for c in contiguous:
        names.append(c.name)
        for splits in (1, 3):
            kvcache_with_config(c, q, kc, vc, cache_seqlens=lens, num_splits=splits)
            runs += 1 + one_row(c, q1, k8, v8, splits)
    torch.cuda.synchronize()
    print(f"regs sanitize (--page-table) done: {runs} runs ({', '.join(names)})")


def main():
    if "--page-table" in sys.argv:
        return page_table_and_order()
    cfg = _regs_config(Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128))
    q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
    runs = 0
    for splits in (1, 3):
        for paged in (False, True):
            for _ in range(2):
                if paged:
                    kvcache_with_config(cfg, q, kp, vp, cache_seqlens=lens, block_table=table, cache_leftpad=pad,
                                        num_splits=splits)
                else:
                    kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens, num_splits=splits)
                runs += 1
    p64 = Problem("decode", "bf16", 2, 4, 2000, 8, 2, 64, True, False, ())
    cfg64 = _regs_config(p64, 3)
    q64 = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    k64, v64 = (torch.randn(2, 2000, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens64 = torch.tensor([1999, 77], device="cuda", dtype=torch.int32)
    for _ in range(2):
        kvcache_with_config(cfg64, q64, k64, v64, cache_seqlens=lens64, causal=True, window_size=(300, 0), num_splits=3)
        runs += 1
    ahead = [cfg.replace(regs_ahead=3), cfg.replace(regs=7, regs_ahead=2, regs_ahead_l1=True),
             cfg.replace(regs_order=2, regs_ahead=2)]
    for c in ahead:   # the prefetches ahead (contiguous whole blocks only)
        for splits in (1, 3):
            for _ in range(2):
                kvcache_with_config(c, q, kc, vc, cache_seqlens=lens, num_splits=splits)
                runs += 1
    b1 = cfg.replace(regs=6)
    b1s = [b1.replace(regs_prefetch=True), b1.replace(regs_prefetch=True, regs_prefetch_blocks=2),
           b1.replace(regs_prefetch=True, regs_prefetch_blocks=3),
           b1.replace(regs_prefetch=True, warps=4), b1.replace(regs_order=2)]
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for c in b1s:
        for splits in (0, 3):
            runs += one_row(c, q1, k1, v1, splits)
    torch.cuda.synchronize()
    print(f"regs sanitize done: {runs} runs ({cfg.name}, {cfg64.name}, {', '.join(c.name for c in ahead + b1s)})")


if __name__ == "__main__":
    main()
