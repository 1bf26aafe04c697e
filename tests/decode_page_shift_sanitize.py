"""decode_splitkv_regs' regs_page_shift (kPageShift) calls for compute-sanitizer (memcheck, racecheck); not a test.
bf16, d 128, 32:8 heads, one query row, the paged batch-1 config (8 warps x 16 keys, the separate combine, pdl 1)
with regs_page_shift at regs_order 0 / 1: one row of capacity 8192 at pages 16 and 256, 8192, 3001 and 0 keys, at the
split rule's count and 1 split; batch 3 with 3000, 0 and 17 keys at page 16 with a cache_leftpad (tiles across
pages), 3 splits, with and without the staged page table.

    compute-sanitizer --tool memcheck python tests/decode_page_shift_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from cuflash.families.decode_splitkv import DecodeConfig  # noqa: E402

BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=1, early_merge=True, pdl=1, regs_page_shift=1)
CONFIGS = [BASE, BASE.replace(regs_order=1), BASE.replace(regs_page_table=1)]


def paged(kc, vc, page, gen):
    """(k pages, v pages, table): kc / vc's rows cut into pages of `page` keys, the table a permutation."""
    b, cap = kc.shape[:2]
    kp, vp = (x.reshape(b * cap // page, page, *x.shape[2:]) for x in (kc, vc))
    table = torch.randperm(b * cap // page, device="cuda", dtype=torch.int32, generator=gen).reshape(b, -1)
    return kp, vp, table


def run_calls(configs, quick: bool, name: str) -> int:
    """The sanitized calls of ``configs`` (quick: the first config, full rows at the split rule's count)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = 0
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q3 = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k3, v3 = (torch.randn(3, 3008, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens3 = torch.tensor([3000, 0, 17], device="cuda", dtype=torch.int32)
    pad3 = torch.tensor([5, 0, 3], device="cuda", dtype=torch.int32)
    for cfg in configs[:1] if quick else configs:
        for page in (16, 256):
            kp, vp, table = paged(k1, v1, page, gen)
            for n in (8192,) if quick else (8192, 3001, 0):
                for splits in (0,) if quick else (0, 1):
                    kvcache_with_config(cfg, q1, kp, vp, block_table=table, num_splits=splits,
                                        cache_seqlens=torch.tensor([n], device="cuda", dtype=torch.int32))
                    calls += 1
        kp, vp, table = paged(k3, v3, 16, gen)
        kvcache_with_config(cfg, q3, kp, vp, block_table=table, cache_seqlens=lens3, cache_leftpad=pad3, num_splits=3)
        calls += 1
    torch.cuda.synchronize()
    print(f"{name}: {calls} calls")
    return 0


def main() -> int:
    return run_calls(CONFIGS, "--quick" in sys.argv, "decode_page_shift_sanitize")


if __name__ == "__main__":
    sys.exit(main())
