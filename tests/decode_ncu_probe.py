"""One call each of SDPA cuDNN and a few decode_splitkv configs (bf16, d 128, 32:8 heads, one query
token), each inside its own profiler range, for ncu --profile-from-start off (issue 13: where the
last HBM bandwidth against cuDNN goes). Not a test.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,\
smsp__issue_active.avg.per_cycle_active,launch__grid_size,launch__block_size,\
launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_shared_mem \
python tests/decode_ncu_probe.py 32 8192 [1 8192 ...]   (batch ctx pairs)

``--cache-control none`` on the ncu line measures a warm L2 (each profiled call follows two
unprofiled ones on the same cache), as the CUDA-graph timing of 1 x 8k (34 MB of K/V in the
50 MB L2) sees it; ncu's default (``all``) flushes the caches before each profiled kernel.

ncu names each kernel: cuDNN's (its main kernel and its reduction), then decode_splitkv<warps,
warp_n, stages, m_tiles, d, bf16, fused_combine, page_prefetch, l2_prefetch, warp_loads, ...,
bulk> for the heuristic's config, its tiles with bulk rows (``bk1``) and with bulk rows and the
L2 evict-first policy (``bk2``), in that order; with ``--ring``, instead of the bulk rows, the
heuristic's config with ring_fill 2 (``rf2``: the prologue fills the ring, loads before S) and
with the dynamic block claims too (``rf2dyn``): ``sm__cycles_active.avg`` / ``.max`` then show
how evenly the SMs' CTAs end; with ``--regs``, instead, decode_splitkv_regs (K/V into registers)
with plain loads, 8 warps (``regs1``) and 4 warps at the co-resident split rule (``regs1w4``); with ``--stream``, instead, decode_splitkv_stream (stream-K) on
the SMs' slots (``stream``) and on 128 CTAs (``stream128``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def table(lines) -> str:
    """ncu --csv output (other lines skipped) as one line per profiled kernel: its short name,
    grid and block, then each metric's value (units as ncu gives them)."""
    import csv

    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    if not rows:
        return "no ncu csv rows"
    head, out, order = rows[0], {}, []
    col = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    extra = [c for c in ("Grid Size", "Block Size") if c in head]
    for r in rows[1:]:
        key = r[col["ID"]]
        if key not in out:
            name = r[col["Kernel Name"]].replace("void ", "").replace("cuflash::", "")
            name = name.split("(")[0] if name.startswith("decode") else name[:60]
            out[key] = [name + " " + " ".join(f"{c.split()[0].lower()} {r[head.index(c)]}" for c in extra)]
            order.append(key)
        metric = r[col["Metric Name"]].replace("launch__", "").replace(".avg.pct_of_peak_sustained_elapsed", "%")
        out[key].append(f"{metric}={r[col['Metric Value']]}{r[col['Metric Unit']] if r[col['Metric Unit']] not in ('', '%') else ''}")
    return "\n".join("  ".join(out[k]) for k in order)


def main():
    if sys.argv[1:2] == ["--table"]:  # ncu --csv output on stdin -> one line per kernel
        print(table(sys.stdin.read().splitlines()))
        return
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shapes = [(int(a), int(c)) for a, c in zip(args[0::2], args[1::2])]  # (batch, ctx) pairs
    for b, ctx in shapes:
        profile_shape(b, ctx)


def profile_shape(b, ctx):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config
    from cuflash.families.decode_splitkv import num_splits_for
    from cuflash.problem import Problem
    from cuflash.registry import get

    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    problem = Problem("decode", "bf16", b, 1, ctx, 32, 8, 128, False, False, ())
    heur = get("decode_splitkv").heuristic(problem)
    bk1 = heur.replace(bulk=1, l2_prefetch=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{b} x {ctx}: splits: heuristic {num_splits_for(heur, problem, sms)}, bk1 {num_splits_for(bk1, problem, sms)}")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                  enable_gqa=True)

    runs = [("sdpa_cudnn", cudnn),
            ("heuristic", lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))]
    if "--regs" in sys.argv:  # decode_splitkv_regs (K/V into registers), plain loads: 8 warps, and 4 warps at the co-resident split rule
        from cuflash.families import decode_splitkv as mod
        for label, sw in (("regs1", {}), ("regs1w4", {"REGS_WARPS": 4, "SPLIT_RULE_RESIDENT_CONTIGUOUS": True})):
            old = {k: getattr(mod, k) for k in ("REGS_DEFAULT", *sw)}
            try:
                for k, v in {"REGS_DEFAULT": 1, **sw}.items():
                    setattr(mod, k, v)
                cfg = get("decode_splitkv").heuristic(problem)
                cfg = cfg.replace(splits=num_splits_for(cfg, problem, sms))
            finally:
                for k, v in old.items():
                    setattr(mod, k, v)
            runs.append((label, lambda cfg=cfg: kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens)))
    elif "--stream" in sys.argv:  # decode_splitkv_stream (stream-K) on every SM, and on 128 CTAs
        st = heur.replace(stream=True, ring_fill=0, dynamic=0, fused_combine=True, early_merge=True, light_fence=False)
        runs += [("stream", lambda: kvcache_with_config(st, q, kc, vc, cache_seqlens=lens)),
                 ("stream128", lambda: kvcache_with_config(st.replace(splits=128), q, kc, vc, cache_seqlens=lens))]
    elif "--ring" in sys.argv:  # the full-ring prologue (loads before S) and the dynamic block claims
        rf2 = heur.replace(ring_fill=2)
        runs += [("rf2", lambda: kvcache_with_config(rf2, q, kc, vc, cache_seqlens=lens)),
                 ("rf2dyn", lambda: kvcache_with_config(rf2.replace(dynamic=True), q, kc, vc, cache_seqlens=lens))]
    else:
        runs += [("bk1", lambda: kvcache_with_config(bk1, q, kc, vc, cache_seqlens=lens)),
                 ("bk2", lambda: kvcache_with_config(bk1.replace(bulk=2), q, kc, vc, cache_seqlens=lens))]
    for name, f in runs:
        for i in range(3):
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.start()
            f()
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.stop()
        print(f"profiled {name} {b} x {ctx}", flush=True)


if __name__ == "__main__":
    main()
