"""Where a sliding window's forward (and backward) time goes, measured: the shipped window kernels
timed over a sweep of window widths in one process, so that a line through (K/V blocks visited,
ms) splits the time into a per-tile part (the intercept: every width runs the same 2048 tiles) and
a per-block part (the slope), next to the plain call of the same process. Not a test:

    timeout 150 python tests/window_accounting_timing.py --out $RES/acc.json

Shape: bf16, d128, batch 2 x 16 heads x 8k (bench --mode features'). Widths: (L, 0) causal and
(L, L) full (rows L<L>; VARIANTS' rows at VARIANT_LEFT); L = 1088 and 1152 visit the same 10 blocks per Q block at BN 128, with 3 and 2 of
them masked, so their difference is one masked block's extra cost. Rows: ms, tiles, K/V block
visits (cuflash.band.block_stats at the kernel's BM / BN), masked visits, x plain / visible share.
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.band import Band, block_stats, visible_fraction  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 8192, 16, 128
SM_COUNT = 132
FWD_LEFT = {True: (128, 256, 512, 768, 1024, 1088, 1152, 2048, 4096, 7936),
            False: (128, 256, 512, 1024, 1088, 1152, 2048, 4096)}
BWD_LEFT = (256, 512, 1024, 2048, 4096)
# variants of the window heuristic's forward, timed at VARIANT_LEFT's widths too (rows <prefix><L>): band_order
# (kBandOrder), two Q buffers (q_double: the producer does not wait for the last S to load the next Q, nor
# the next K/V behind it), both; edge_half (kEdgeHalf: the edge blocks' S and P V on the visible 64-key half)
# (session 22 round 1, an H200: B, Q and QB were slower than the heuristic at every width: dropped)
# (session 22: E / E2 / E3, edge_half 1 / 2 / 3, and band_order on wip/win4; session 23: U / U2, unmasked_first
# 1 / 2, a band's masked last block visited second / last, on wip/win5 at 2ef362d: none faster, not merged; an
# H100's numbers in results/NVIDIA_H100_80GB_HBM3/logs/session23_win5/round2.md; session 24: E / F / G, edge_half
# 1 / 2 / 3, the edge halves with the body per consumer warpgroup, on wip/win6 at 3bca9b2: none faster, not merged;
# logs/session24_win6/round2.md, round4.md). Rows here: q_double.
VARIANTS = {"Q": dict(q_double=True, tile_overlap=False)}
VARIANT_LEFT = (512, 1024, 2048, 4096)


def problem(causal, window=None, op="fwd"):
    p = Problem(op, "bf16", BATCH, SEQLEN, SEQLEN, HEADS, HEADS, HEAD_DIM, causal)
    if window is not None:
        p = p.replace(features=("window",), window=window)
    return p


def window_of(causal, left):
    return (left, 0) if causal else (left, left)


def configs(extra=None):
    """{name: (causal, config)}: the window heuristic's forward per mask (at (1024, .): the
    kernel is the same for every width), the plain call by selection, and the plain causal call
    at the window's tile and schedule (static persistent, TMA store; no tile_overlap, which the
    plain causal kernel refuses)."""
    from cuflash import _gpu, select

    fam = registry.get("sm90_fwd")
    out = {}
    for causal in (True, False):
        tag = "causal" if causal else "full"
        p = problem(causal, window_of(causal, 1024))
        heur = fam.for_problem(fam.heuristic(p), p)
        out[f"win_{tag}"] = (causal, heur)
        for pre, kw in VARIANTS.items():   # (session 22)
            out[f"win{pre}_{tag}"] = (causal, fam.for_problem(heur.replace(**kw), p))
        p0 = problem(causal)
        out[f"plain_{tag}"] = (causal, select.choose(p0, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1])
        out[f"plain128_{tag}"] = (causal, fam.for_problem(
            heur.replace(features=(), tile_overlap=False), p0) if hasattr(heur, "features") else
            fam.for_problem(heur.replace(tile_overlap=False), p0))
    for name, (causal, cfg) in (extra or {}).items():
        out[name] = (causal, cfg)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--widths", default="", help="comma-separated L: the forward rows at these widths only")
    args = ap.parse_args()

    import numpy as np
    import torch

    import cuflash
    from cuflash.compile import precompile
    from cuflash.timing import time_interleaved

    cfgs = configs()
    plain_window_cfg = {}
    for name, (causal, cfg) in cfgs.items():
        print(f"{name:<18} {cfg.name}")
    todo = [c for _, c in cfgs.values()]
    bfam = registry.get("sm90_bwd")
    bwd_cfgs = {}
    if not args.no_bwd:
        for causal in (True, False):
            pb = problem(causal, window_of(causal, 1024), "bwd")
            bwd_cfgs[causal] = bfam.for_problem(bfam.heuristic(pb), pb)
            todo.append(bwd_cfgs[causal])
            print(f"bwd_{causal}: {bwd_cfgs[causal].name}")
    if args.precompile:   # and features_overhead_timing --quick --mask both --features window's
        import features_overhead_timing as feat
        todo += feat.all_configs(quick=True, mask="both", features=("window",))
    failed = [(c.name, e) for c, _, e in precompile(todo) if e]
    print(f"compiled {len(todo)}; failed {failed}", flush=True)
    if args.precompile:
        return
    b, s, h, d = BATCH, SEQLEN, HEADS, HEAD_DIM
    rows = []

    def measure(fns):
        """({name: Timing}, the plain row's median ms): every callable run once (plans, compiles), then timed with
        the samples interleaved."""
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=3)
        return times, times["plain"].median_ms
    for causal in (True, False):
        tag = "causal" if causal else "full"
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        win_cfg = cfgs[f"win_{tag}"][1]
        fns, meta = {}, {}
        widths = [int(x) for x in args.widths.split(",") if x]
        for left in [x for x in FWD_LEFT[causal] if not widths or x in widths]:
            w = window_of(causal, left)
            st = block_stats(Band(s, s, causal, w), win_cfg.BM, win_cfg.BN, 64)
            for pre, cfg in [("L", win_cfg)] + [(v, cfgs[f"win{v}_{tag}"][1]) for v in VARIANTS]:
                if pre != "L" and left not in VARIANT_LEFT:
                    continue
                fns[f"{pre}{left}"] = (lambda w=w, cfg=cfg: cuflash.flash_attn_func(q, k, v, causal=causal,
                                                                                     window_size=w, config=cfg))
                meta[f"{pre}{left}"] = dict(window=w, tiles=st.q_blocks * b * h, visits=st.kv_visits * b * h,
                                            masked=st.masked * b * h, vis=visible_fraction(s, s, causal, w),
                                            overcompute=st.overcompute, config=cfg.name)
        for key in ("plain", "plain128"):
            cfg = cfgs[f"{key}_{tag}"][1]
            fns[key] = (lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg))
            st = block_stats(Band(s, s, causal), cfg.BM, cfg.BN, 64)
            meta[key] = dict(window=None, tiles=st.q_blocks * b * h, visits=st.kv_visits * b * h,
                             masked=st.masked * b * h, vis=1.0, overcompute=st.overcompute, config=cfg.name)
        times, plain = measure(fns)
        print(f"\n{tag} forward: name ms tiles visits masked overcompute x_plain x_visible")
        for name, t in times.items():
            mm = meta[name]
            xv = t.median_ms / plain / mm["vis"]
            print(f"{tag:<7}{name:<10}{t.median_ms:8.4f} {mm['tiles']:6d} {mm['visits']:7d} {mm['masked']:9.1f} "
                  f"{mm['overcompute']:6.3f} {t.median_ms / plain:7.3f} {xv:7.3f}  {mm['config']}")
            rows.append(dict(mask=tag, pass_="fwd", name=name, ms=t.median_ms, spread=t.spread, x_plain=t.median_ms / plain,
                             x_visible=xv, **mm))
        # the line through the widths >= 512 (the short ones are bound by other things)
        pts = [(meta[n]["visits"], times[n].median_ms) for n in times if n.startswith("L")
               and meta[n]["window"][0] >= 512]
        x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        slope, icpt = np.polyfit(x, y, 1)
        tiles = meta["plain"]["tiles"]
        print(f"{tag} fit (L >= 512): ms = {icpt:.4f} + {slope * 1e3:.4e} us x visits -> per SM: "
              f"tile {icpt * 1e3 * SM_COUNT / tiles:.2f} us, block {slope * 1e3 * SM_COUNT:.3f} us")
        for n in ("plain", "plain128"):
            mm = meta[n]
            bt = times[n].median_ms * 1e3 * SM_COUNT / mm["visits"]
            print(f"{tag} {n}: {bt:.3f} us per block visit per SM (all time / visits)")
        rows.append(dict(mask=tag, pass_="fwd", name="fit", intercept_ms=icpt, slope_ms_per_visit=slope,
                         tile_us=icpt * 1e3 * SM_COUNT / tiles, block_us=slope * 1e3 * SM_COUNT))
        if args.no_bwd:
            continue
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(q)
        bfns, bmeta = {}, {}
        outs = {}
        for left in BWD_LEFT:
            w = window_of(causal, left)
            outs[left] = cuflash.flash_attn_func(qg, kg, vg, causal=causal, window_size=w, config=win_cfg,
                                                 bwd_config=bwd_cfgs[causal])
            bfns[f"L{left}"] = (lambda o=outs[left]: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
            st = block_stats(Band(s, s, causal, w), 64, 128, 64)
            bmeta[f"L{left}"] = dict(vis=visible_fraction(s, s, causal, w), visits=st.kv_visits * b * h)
        out0 = cuflash.flash_attn_func(qg, kg, vg, causal=causal)
        bfns["plain"] = lambda: torch.autograd.grad(out0, (qg, kg, vg), dout, retain_graph=True)
        bmeta["plain"] = dict(vis=1.0, visits=block_stats(Band(s, s, causal), 64, 128, 64).kv_visits * b * h)
        times, plain = measure(bfns)
        print(f"\n{tag} backward alone: name ms visits(64x128) x_plain x_visible")
        for name, t in times.items():
            mm = bmeta[name]
            xv = t.median_ms / plain / mm["vis"]
            print(f"{tag:<7}{name:<10}{t.median_ms:8.4f} {mm['visits']:8d} {t.median_ms / plain:7.3f} {xv:7.3f}")
            rows.append(dict(mask=tag, pass_="bwd", name=name, ms=t.median_ms, x_plain=t.median_ms / plain,
                             x_visible=xv, **mm))
        pts = [(bmeta[n]["visits"], times[n].median_ms) for n in times if n.startswith("L")]
        x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        slope, icpt = np.polyfit(x, y, 1)
        print(f"{tag} bwd fit: ms = {icpt:.4f} + {slope * 1e3:.4e} us x visits(64x128)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
