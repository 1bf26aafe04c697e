"""decode_splitkv_regs' regs_page_table 2 (kPageTable 2: the whole table row staged, every page id from shared memory)
calls for compute-sanitizer (memcheck, racecheck); not a test. bf16, d 128, 32:8 heads, one query row, the paged
batch-1 config (8 warps x 16 keys, the separate combine, pdl 1) with regs_page_table 2, with and without
regs_page_shift, at regs_order 0 / 1: one row of capacity 8192 at pages 16 and 256, 8192, 3001 and 0 keys, at the
split rule's count and 1 split; batch 3 with 3000, 0 and 17 keys at page 16 with a cache_leftpad (tiles across pages),
3 splits.

    compute-sanitizer --tool memcheck python tests/decode_page_table2_sanitize.py
    compute-sanitizer --tool racecheck python tests/decode_page_table2_sanitize.py --quick   (the first config, full rows
                                                                                            at the split rule's count)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_page_shift_sanitize import run_calls  # noqa: E402
from cuflash.families.decode_splitkv import DecodeConfig  # noqa: E402

BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=1, early_merge=True, pdl=1, regs_page_table=2)
CONFIGS = [BASE.replace(regs_page_shift=1), BASE, BASE.replace(regs_page_shift=1, regs_order=1)]


def main() -> int:
    return run_calls(CONFIGS, "--quick" in sys.argv, "decode_page_table2_sanitize")


if __name__ == "__main__":
    sys.exit(main())
