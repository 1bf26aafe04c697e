"""One call each of SDPA cuDNN and a few decode_splitkv configs (bf16, d 128, 32:8 heads, one query
token), each inside its own profiler range, for ncu --profile-from-start off (issue 13: where the
last 3-4% of HBM bandwidth against cuDNN goes). Not a test.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,\
smsp__issue_active.avg.per_cycle_active python tests/decode_ncu_probe.py 32 8192

ncu names each kernel: cuDNN's, then decode_splitkv<warps, warp_n, stages, m_tiles, d, bf16,
fused_combine, page_prefetch, l2_prefetch, warp_loads, ...> for the heuristic's config, its tiles
without options (``base``), and with warp_loads (``wl``), in that order.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config
    from cuflash.problem import Problem
    from cuflash.registry import get

    b, ctx = int(sys.argv[1]), int(sys.argv[2])
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    heur = get("decode_splitkv").heuristic(Problem("decode", "bf16", b, 1, ctx, 32, 8, 128, False, False, ()))
    base = heur.replace(fused_combine=False, l2_prefetch=0)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                  enable_gqa=True)

    runs = [("sdpa_cudnn", cudnn),
            ("heuristic", lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)),
            ("base", lambda: kvcache_with_config(base, q, kc, vc, cache_seqlens=lens)),
            ("wl", lambda: kvcache_with_config(heur.replace(warp_loads=True), q, kc, vc, cache_seqlens=lens))]
    for name, f in runs:
        for i in range(3):
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.start()
            f()
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.stop()
        print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main()
