"""decode_splitkv_regs' kSpec (regs_spec with regs_order 2) for compute-sanitizer (memcheck, racecheck, synccheck);
not a test. bf16, d 128, 32:8 heads, one query row: the shipped batch-1 config (separate combine, early partial-O
loads, pdl 1, regs_order 2, kSpec 1; then kSpec 2 at 16 splits) on one batch row of capacity 8192 at 8192 and 3001 keys and at 1, 3, 16 and 40 splits
(each call a programmatic dependent of the previous call's combine; 40 splits: splits past the row's blocks, whose
early loads are dropped), then (unless --b1) batch 3 with 3000, 0 and 17 keys and a leftpad (no early loads) and
without it, contiguous and in pages of 16, at 1 and 3 splits, with the fused combine.

    compute-sanitizer --tool memcheck python tests/decode_spec_sanitize.py [--b1]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import get  # noqa: E402
from decode_regs_sanitize import _regs_config, batch3_inputs, one_row  # noqa: E402

SPEC = {"regs_order": 2, "regs_spec": 1}   # REGS_BATCH1_RULES' 8k entry (session 28)


def configs():
    """(the batch-1 candidate, the batch-3 config): tests/decode_precompile.py's spec_tests compiles them."""
    b1 = get("decode_splitkv").heuristic(Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128))
    assert b1.early_merge and b1.pdl == 1 and not b1.fused_combine and b1 == b1.replace(**SPEC), b1.name
    b3 = _regs_config(Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128)).replace(**SPEC)
    return b1, b3, b1.replace(regs_spec=2)


def main():
    b1, b3, b1s2 = configs()
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs = sum(one_row(b1, q1, k1, v1, splits) + one_row(b1, q1, k1, v1, splits) for splits in (1, 3, 16, 40))
    runs += one_row(b1s2, q1, k1, v1, 16)   # kSpec 2
    if "--b1" not in sys.argv:
        q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
        for splits in (1, 3):
            for leftpad in (pad, None):
                for _ in range(2):
                    kvcache_with_config(b3, q, kc, vc, cache_seqlens=lens, cache_leftpad=leftpad, num_splits=splits)
                    runs += 1
            kvcache_with_config(b3, q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=splits)
            runs += 1
    torch.cuda.synchronize()
    print(f"{runs} kSpec calls ok: {b1.name}, {b1s2.name}, {b3.name}")


if __name__ == "__main__":
    main()
