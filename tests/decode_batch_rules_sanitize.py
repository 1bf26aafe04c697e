"""The large-batch device rules' decode calls (session 30, issue 13: decode_splitkv_regs at 4 warps, fixed split
counts) for compute-sanitizer; not a test. Each rule of tests/test_decode_batch_rules_gpu.py's RULE_SETS is
installed (cuflash.select.device_rules replaced) and runs batch 4 (8200, 0, 1, 4097 keys), batch 3 (8192,
8191, 100) and batch 3 (4096, 0, 4095), contiguous, 32:8 heads, d 128, bf16, each twice (the second call finds the counters reset).

    compute-sanitizer --tool memcheck python tests/decode_batch_rules_sanitize.py
"""
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from cuflash import decode, select  # noqa: E402
from cuflash.decode import flash_attn_with_kvcache  # noqa: E402

from test_decode_batch_rules_gpu import RULE_SETS  # noqa: E402


def main():
    names = []
    for params in RULE_SETS:
        rule = select.Rule(family="decode_splitkv", set=dict(params), match={"paged": False, "batch": [2, None]})
        select.device_rules = lambda family, *a, _r=rule, **k: [(_r, pathlib.Path("sanitize_rule.yaml"))]
        decode._drop_gpu_plans()
        for lens in ([8200, 0, 1, 4097], [8192, 8191, 100], [4096, 0, 4095]):
            b, cap = len(lens), max(lens)
            q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            kc, vc = (torch.randn(b, cap, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
            for _ in range(2):
                flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
            torch.cuda.synchronize()
        names += [e.plan.config.name + f" x{e.plan.config.splits}" for e in decode._gpu_plans.values() if e.plan]
    print("ran:", *sorted(set(names)), sep="\n  ")
    print("done")


if __name__ == "__main__":
    main()
