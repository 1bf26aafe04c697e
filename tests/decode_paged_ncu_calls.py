"""decode_paged_timing.py's variants (``"LABEL PAGE field=VALUE ... [table=sorted]"``; PAGE 0: the contiguous cache)
called eagerly on one 1 x 8k cache (bf16, d 128, 32:8 heads, the row full), each profiled call inside
cudaProfilerStart / Stop after ``--warm`` unprofiled calls of the same variant, for ``ncu --profile-from-start off
--cache-control none`` (a warm L2, as graph replays see it). Not a test (issue 13: where the paged split kernel's
time goes when it reads the very addresses the contiguous one reads).

    ncu --profile-from-start off --cache-control none -k regex:decode_splitkv_regs --section WarpStateStats \\
        python tests/decode_paged_ncu_calls.py "c_ro0 0 regs_order=0 regs_spec=0" "u256s 256 regs_page_table=0 table=sorted"
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--warm", type=int, default=3)
    a = ap.parse_args()
    import torch

    import decode_paged_timing as pt
    from cuflash.bench.decode import paged_view
    from cuflash.decode import kvcache_with_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, a.ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), a.ctx, dtype=torch.int32, device="cuda")
    for text in a.variants:
        v = pt.parse_variant(text)
        cfg = pt.variant_config(v, 1, a.ctx, sms)
        ck, cv, table = (kc, vc, None)
        if v["page"]:
            ck, cv, table = paged_view(kc, vc, v["page"], gen)
            if v["sorted"]:
                table = torch.arange(table.shape[1], device="cuda", dtype=torch.int32)[None, :].contiguous()
        for _ in range(a.warm):
            kvcache_with_config(cfg, q, ck, cv, cache_seqlens=seqlens, block_table=table)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        kvcache_with_config(cfg, q, ck, cv, cache_seqlens=seqlens, block_table=table)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{v['label']}: {cfg.name} x{cfg.splits}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
