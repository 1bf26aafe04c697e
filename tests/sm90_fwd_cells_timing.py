"""Timing of sm90_fwd's last forward cells against SDPA cuDNN on an H100 (issue 11): the cell below
1.0x in the last bench (d256 non-causal 2k) and the other non-causal cells whose tiles leave a partial
last wave (1024 tiles on 132 SMs at d256, 2048 at d128 2k), each with the heuristic and stream_tail
(st*: the last stretch balanced by K/V blocks, kernels_cu/sm90_tail.cuh), and controls (d256 causal 2k,
d64 full 2k). Not a test; < 90 s with its compiles (done first, in parallel):

    timeout 300 python tests/sm90_fwd_cells_timing.py --out /tmp/cells_timing.json

Regime: the bench's (cuflash.bench: samples of --b2b back-to-back calls, no L2 flush, the
benchmark's shape: dim 2048, heads 2048 / d, batch x seqlen 16k), with the rows' samples
interleaved in a new (seeded) order every round (cuflash.timing.round_orders' shuffle: back to back, a
kernel right after a slow one runs at a recovered clock, so with a fixed or rotated order the row after
a slow row gains every sample). "x cuDNN" is
a row's TFLOPs over cuDNN's in the same rounds. Every row's output is checked against the first row's
(NaN-free, max difference < 2e-2).

--tuner-check also times each cell's heuristic through the tuner's measure (tuning/measure.py
GpuMeasure) in both its timing modes, "bench" (back to back, the new default) and "flush" (single
calls after an L2 flush), next to the shuffled bench-regime figure: the tuner should rank configs as
the bench does (bf16 cells).

--order-check times, for the bf16 d128 16k and d256 2k cells, exactly what ``cuflash bench --mode fwd``
times (every fwd family's selected config, SDPA flash, SDPA cuDNN: cuflash.bench.common) twice: in the
bench's fixed order of old (A B C D A B C D ...), rotated and shuffled (cuflash.timing.time_interleaved's
default now): the position bias, measured.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# row -> changes to the heuristic's config of the cell (None: the heuristic as it is)
CANDIDATES = {
    "heur": None,
    # schedules
    "pp": dict(pingpong=True),
    "nopp": dict(pingpong=False),
    "dyn": dict(dynamic=True, persistent=True),
    "dyn_pp": dict(dynamic=True, persistent=True, pingpong=True),
    "static": dict(dynamic=False, persistent=True),       # static persistent
    "grid": dict(dynamic=False, persistent=False),        # a CTA per tile
    "sec1": dict(dynamic=True, persistent=True, section=1),
    "rf": dict(rescale_first=True),
    # tiles
    "bn64": dict(BN=64, tma_store=False),
    "bn112": dict(BN=112),
    "bn144": dict(BN=144, tma_store=False),
    "bn160_tmao": dict(BN=160, tma_store=True),
    "bn176": dict(BN=176, tma_store=False),
    "bn176_nopp": dict(BN=176, tma_store=False, pingpong=False),
    "bn192": dict(BN=192, tma_store=False),
    "bn128_s3": dict(BN=128, stages=3, tma_store=False),
    "c1_bn96": dict(BM=64, consumers=1, pingpong=False, BN=96, tma_store=False, dynamic=False, persistent=False),
    "c2_bn192": dict(BM=128, consumers=2, BN=192, pingpong=True),
    "q2": dict(q_double=True),
    "tree": dict(tree_max=True),
    # tile_overlap (kTileOverlap): the next tile's S_0 behind the last P V; static persistent, no pingpong
    "tov": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=False, tma_store=False, lazy_rescale=False),
    "tov_bn176": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=False, tma_store=False,
                      BN=176),
    "tov_pp": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=True, tma_store=False),
    "tov_pp_bn176": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=True, tma_store=False,
                         BN=176),
    # stream_tail (kStreamTail): the static persistent schedule with the last stretch cut by K/V blocks
    "st": dict(stream_tail=True),
    "st_pp": dict(stream_tail=True, pingpong=True),
    "st_static": dict(stream_tail=True, dynamic=False, persistent=True),
    "nost": dict(stream_tail=False),       # the heuristic's tile without it (where HEURISTIC_STREAM_TAIL has it)
    # pv_overlap (kPvOverlap): the K/V loop rotated, the softmax of S_j under the warpgroup's own P V
    "pvo": dict(pv_overlap=True),
    "tov_pvo": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=False, tma_store=False,
                    pv_overlap=True),
    "st_pvo": dict(stream_tail=True, pv_overlap=True),
    "nost_pvo": dict(stream_tail=False, pv_overlap=True),
    # cluster (kCluster): clusters of 2 CTAs sharing every K/V load by TMA multicast (static persistent, no stream_tail)
    "cl": dict(cluster=True),
    "cl_pvo": dict(cluster=True, pv_overlap=True),
    "nost_cl": dict(stream_tail=False, cluster=True),
    "nost_cl_pvo": dict(stream_tail=False, cluster=True, pv_overlap=True),
    # lazy_rescale (kLazyRescale, FA4's: O rescaled only when a row's max moves by > 2^8) on the plain call,
    # and even_waves (the static persistent grid sized to equal tile counts: 128 CTAs of 8 tiles for 1024)
    "lazy": dict(lazy_rescale=True),
    "ev": dict(even_waves=True),
    "lazy_ev": dict(lazy_rescale=True, even_waves=True),
    "nost_lazy": dict(stream_tail=False, lazy_rescale=True),
    "nost_ev": dict(stream_tail=False, even_waves=True),
    "nost_lazy_ev": dict(stream_tail=False, lazy_rescale=True, even_waves=True),
    # rag_keys (kRagKeys): the ragged last K/V block's P V at rag_keys / 16 steps (-1: the call's)
    "rag": dict(rag_keys=-1),
    "lazy_rag": dict(rag_keys=-1, lazy_rescale=True),
    "lazy_rag_ev": dict(rag_keys=-1, lazy_rescale=True, even_waves=True),
    "nost_rag": dict(stream_tail=False, rag_keys=-1),
    "nost_lazy_rag": dict(stream_tail=False, rag_keys=-1, lazy_rescale=True),
    # prefetch (kPrefetch): the next tile's Q into L2 by TMA prefetches (static persistent)
    "pf": dict(prefetch=True),
    "lazy_pf": dict(prefetch=True, lazy_rescale=True),
    "lazy_rag_pf": dict(prefetch=True, lazy_rescale=True, rag_keys=-1),
    "tov_pf": dict(tile_overlap=True, dynamic=False, persistent=True, pingpong=False, tma_store=False, prefetch=True,
                   lazy_rescale=False),
    # the heuristic before HEURISTIC_LAZY (d256 2k / 4k: its lazy_rescale off; 4k: with stream_tail)
    "nolazy": dict(lazy_rescale=False),
    "nolazy_pf": dict(lazy_rescale=False, prefetch=True),
    "st_nolazy": dict(lazy_rescale=False, stream_tail=True),
    "nost_pf": dict(stream_tail=False, prefetch=True),
    "nost_lazy_pf": dict(stream_tail=False, prefetch=True, lazy_rescale=True),
}
# (head dim, causal, seqlen) -> the rows of that cell, bf16 (rows equal to the heuristic's config or an
# earlier row's, or invalid, are left out)
CELLS = {
    (256, False, 2048): ("heur", "st", "tov", "pvo", "tov_pvo", "st_pvo", "cl", "cl_pvo", "lazy", "ev", "lazy_ev",
                         "tree", "rag", "lazy_rag", "lazy_rag_ev", "pf", "lazy_pf", "lazy_rag_pf", "tov_pf", "nolazy",
                         "nolazy_pf"),
    (256, False, 4096): ("heur", "st", "nost", "pvo", "nost_pvo", "nost_cl", "nost_lazy", "nost_ev", "nost_lazy_ev",
                         "nost_rag", "nost_lazy_rag", "nost_pf", "nost_lazy_pf", "st_nolazy", "nolazy"),
    (256, False, 8192): ("heur", "st", "nost", "pvo", "nost_lazy", "nost_pf", "nost_lazy_pf", "nolazy", "st_nolazy"),
    (256, False, 16384): ("heur", "st", "nost", "pvo", "nost_lazy", "nost_pf", "nost_lazy_pf", "nolazy", "st_nolazy"),
    (128, False, 2048): ("heur", "st", "nost", "pvo"),
    (128, False, 16384): ("heur", "st", "nost", "pvo", "nost_pvo", "nost_cl", "nost_lazy", "nost_ev", "nost_pf"),
    (64, False, 2048): ("heur", "st_static", "pvo"),
    (256, True, 2048): ("heur", "pvo", "lazy", "nolazy"),
    (256, True, 4096): ("heur", "lazy", "nolazy"),
    (256, True, 8192): ("heur", "lazy", "nolazy"),
    (256, True, 16384): ("heur", "lazy", "nolazy"),
    (128, True, 8192): ("heur", "pvo"),
    (64, False, 4096): ("heur", "pvo"),
    (64, True, 4096): ("heur", "pvo"),
}
# the fp16 cells' rows (fewer: the compile budget). tile_overlap (tov*, non-causal only): the version of
# session 16's round B was serialized by ptxas (0.5-0.8x); these rows time the loop-rotated one
FP16_CELLS = {
    (256, False, 2048): ("heur", "st", "pvo", "cl", "lazy", "ev", "lazy_ev", "tree", "rag", "lazy_rag",
                         "lazy_rag_ev", "pf", "lazy_pf", "lazy_rag_pf", "tov", "tov_pf", "nolazy",
                         "nolazy_pf"),
    (256, True, 2048): ("heur", "lazy", "nolazy"),
    (256, True, 4096): ("heur", "nolazy"),
    (256, True, 8192): ("heur", "nolazy"),
    (256, True, 16384): ("heur", "nolazy"),
    (256, False, 8192): ("heur", "nolazy", "st_nolazy"),
    (256, False, 16384): ("heur", "nolazy", "st_nolazy"),
    (256, False, 4096): ("heur", "st", "nost", "nost_cl", "nost_lazy", "nost_ev", "nost_lazy_ev",
                         "nost_rag", "nost_lazy_rag", "nost_pf", "nost_lazy_pf", "st_nolazy", "nolazy"),
    (128, False, 2048): ("heur", "st", "nost"),
    (128, False, 16384): ("heur", "st", "nost", "nost_cl", "nost_lazy", "nost_ev", "nost_pf"),
}


def cell_configs(dtype, d, causal, s, rows, quiet=False):
    """(problem, {row: config}) of one cell."""
    from cuflash import registry
    from cuflash.problem import Problem

    fam = registry.get("sm90_fwd")
    problem = Problem.fa_convention("fwd", dtype, d, causal, s)
    heur = fam.for_problem(fam.heuristic(problem), problem)
    out = {}
    for key in rows:
        change = CANDIDATES[key]
        try:
            cfg = heur if change is None else heur.replace(**change)
        except Exception as exc:  # noqa: BLE001 - a replace that breaks the dataclass's own rules
            if not quiet:
                print(f"  skipped {key}: {exc}")
            continue
        if getattr(cfg, "rag_keys", 0) == -1:   # the call's ragged block (sm90_fwd for_problem)
            cfg = fam.for_problem(cfg, problem)
        if key != "heur" and (cfg == heur or cfg in out.values()):
            continue
        why = cfg.problems(227 * 1024)
        if why:
            if not quiet:
                print(f"  skipped {key} {cfg.name}: {'; '.join(why)}")
            continue
        out[key] = cfg
    return problem, out


def cell_calls(problem, cfgs):
    """({row: cuflash's call with that config}, SDPA cuDNN's call) on new random inputs of the cell's
    shape (q, k, v (batch, seqlen, heads, head_dim); cuDNN takes their (batch, heads, seqlen, d) views)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    tdt = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    shape = (problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=tdt) for _ in range(3))
    causal = bool(problem.causal)
    fns = {key: (lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg))
           for key, cfg in cfgs.items()}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return fns, cudnn


def write_rows(path, rows):
    """rows as JSON with the run's environment (device, torch, cuDNN, cuflash)."""
    import torch

    import cuflash

    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               cudnn=torch.backends.cudnn.version(), cuflash=cuflash.__version__)
    with open(path, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"wrote {path}")


def cells_of(dtypes):
    return [(dt, d, c, s, rows) for dt in dtypes
            for (d, c, s), rows in (CELLS if dt == "bf16" else FP16_CELLS).items()]


def all_configs(dtypes):
    by_kernel = {}
    for dt, d, c, s, rows in cells_of(dtypes):
        for cfg in cell_configs(dt, d, c, s, rows, True)[1].values():
            by_kernel.setdefault(cfg.kernel_name(), cfg.replace(section=0))
    return list(by_kernel.values())


def test_kernel_configs():
    """The kernels of tests/test_sm90_tile_overlap_gpu.py (and the plain tiles it compares with) and of
    tests/test_sm90_d64_q2_gpu.py (the d64 causal heuristic with / without q_double)."""
    import cuflash
    from cuflash import registry

    import test_sm90_tile_overlap_gpu as t

    fam = registry.get("sm90_fwd")
    out = []
    cases = list(t.KERNELS) + list(t.PLAIN.values()) + [(dt, 64, True, q2) for dt in ("bf16", "fp16")
                                                         for q2 in ({}, {"q_double": False})]
    for dtype, d, causal, change in cases:
        p = cuflash.Problem("fwd", dtype, 2, 2049, 2049, 16, 4, d, causal)
        cfg = fam.for_problem(fam.heuristic(p), p).replace(persistent=True, tma_store=False, stream_tail=False,
                                                           lazy_rescale=False).replace(**change)
        out.append(cfg.replace(section=0))
    return out


def stream_tail_test_configs():
    """The kernels of tests/test_sm90_stream_tail_gpu.py."""
    import cuflash
    from cuflash import registry

    import test_sm90_stream_tail_gpu as t

    fam = registry.get("sm90_fwd")
    out = []
    for dtype, d, causal, change in t.KERNELS:
        p = cuflash.Problem("fwd", dtype, 2, 2049, 2049, 16, 4, d, causal)
        cfg = fam.for_problem(fam.heuristic(p), p).replace(persistent=True, tma_store=False, stream_tail=False,
                                                           lazy_rescale=False).replace(**change)
        out.append(cfg.replace(section=0))
    return out


def fp8_configs(cells):
    """The configs tests/fp8_timing.py --ignore-stamps chooses for these cells (e4m3 and bf16)."""
    from cuflash import _gpu, select
    from cuflash.problem import Problem

    select.stale_reasons = lambda entry, stamp: []
    out = []
    for d, c, s in (x.split(":") for x in cells.split(",")):
        d, c, s = int(d), bool(int(c)), int(s)
        for dtype in ("bf16", "e4m3"):
            p = Problem("fwd", dtype, max(1, 16384 // s), s, s, 2048 // d, 2048 // d, d, c)
            out.append(select.choose(p, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1])
    return out


def order_check(reps):
    """The bench's callables (cuflash.bench.common: family_choices + op_callable, SDPA_IMPLS) timed
    in the fixed order, rotated and shuffled; rows of x cuDNN per regime."""
    import torch

    from cuflash.bench import common
    from cuflash.problem import Problem
    from cuflash.timing import time_interleaved

    out = []
    for d, s in ((128, 16384), (256, 2048)):
        problem = Problem.fa_convention("fwd", "bf16", d, False, s)
        tensors = common.inputs(problem, 3)
        fns = {f"cuflash:{fam.name}": common.op_callable("cuflash", problem, tensors, cfg)
               for fam, cfg, _ in common.family_choices(problem)}
        fns.update({impl: common.op_callable(impl, problem, tensors) for impl in common.SDPA_IMPLS})
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for order in ("fixed", "rotate", "shuffle"):
            times = time_interleaved(fns, reps=reps, order=order)
            base = times["sdpa_cudnn"].median_ms
            for name, t in times.items():
                regime = order
                print(f"bench order {regime:<7} bf16 d{d} s{s} full {name:<22} {t.median_ms:8.3f} ms "
                      f"{base / t.median_ms:6.3f}x cuDNN", flush=True)
                out.append(dict(cell=f"bf16 d{d} s{s} full", row=name, regime=f"bench_{regime}",
                                median_ms=t.median_ms, x_cudnn=base / t.median_ms))
        del tensors, fns
        common.release()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--b2b", type=int, default=10, help="back-to-back calls per sample (the bench's 10)")
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--only", default="", help="cells as d:causal:seqlen,... (e.g. 256:0:2048)")
    ap.add_argument("--rows", default="", help="only these rows of each cell, e.g. heur,pvo (default: all)")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--with-tests", action="store_true",
                    help="also compile tests/test_sm90_tile_overlap_gpu.py's kernels")
    ap.add_argument("--with-st-tests", action="store_true",
                    help="also compile tests/test_sm90_stream_tail_gpu.py's kernels")
    ap.add_argument("--with-fp8", default="",
                    help="also compile tests/fp8_timing.py's kernels of these cells, d:causal:seqlen,... "
                         "(its tuned e4m3 entries, stamps ignored as its --ignore-stamps)")
    ap.add_argument("--tuner-check", action="store_true",
                    help="also time each cell's heuristic through tuning.measure.GpuMeasure in both modes")
    ap.add_argument("--order", default="shuffle", choices=["shuffle", "rotate", "fixed"],
                    help="the rows' order in each round of samples (cuflash.timing.round_orders)")
    ap.add_argument("--order-check", action="store_true",
                    help="the bench's own callables in its old fixed order, rotated and shuffled (bf16 d128 16k, d256 2k)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtypes = args.dtype.split(",")
    assert set(dtypes) <= {"bf16", "fp16"}, args.dtype
    if args.only:
        keep = {(int(d), bool(int(c)), int(s)) for d, c, s in (x.split(":") for x in args.only.split(","))}
        for table in (CELLS, FP16_CELLS):
            for k in list(table):
                if k not in keep:
                    del table[k]
    if args.rows:
        keep_rows = args.rows.split(",")
        for table in (CELLS, FP16_CELLS):
            for k, rows in table.items():
                table[k] = tuple(r for r in rows if r in keep_rows)

    from cuflash.compile import precompile

    t0 = time.time()
    kernels = all_configs(dtypes)
    if args.order_check:   # the bench's selected configs of every fwd family (fa2_fwd's tuned ones)
        from cuflash.bench import common
        from cuflash.problem import Problem

        have = {c.kernel_name() for c in kernels if hasattr(c, "kernel_name")}
        for d, s in ((128, 16384), (256, 2048)):
            for _, cfg, _ in common.family_choices(Problem.fa_convention("fwd", "bf16", d, False, s)):
                if not hasattr(cfg, "kernel_name") or cfg.kernel_name() not in have:
                    kernels.append(cfg)
    if args.with_tests:
        have = {c.kernel_name() for c in kernels if hasattr(c, "kernel_name")}
        kernels += [c for c in test_kernel_configs() if c.kernel_name() not in have]
    if args.with_st_tests:
        have = {c.kernel_name() for c in kernels if hasattr(c, "kernel_name")}
        kernels += [c for c in stream_tail_test_configs() if c.kernel_name() not in have]
    if args.with_fp8:
        kernels += fp8_configs(args.with_fp8)
    failed = [(c.name, e[-1500:]) for c, _, e in precompile(kernels) if e]
    print(f"compiled {len(kernels)} kernels in {time.time() - t0:.0f} s", flush=True)
    assert not failed, failed
    if args.precompile_only:
        return

    import torch

    from cuflash.registry import op_flops
    from cuflash.timing import time_interleaved

    results = []
    print(f"{'cell':<22} {'row':<11} {'config':<68} {'ms':>8} {'TFLOPs':>7} {'x cuDNN':>8} {'spread':>6}")
    for dtype, d, causal, s, rows in cells_of(dtypes):
        problem, cfgs = cell_configs(dtype, d, causal, s, rows)
        fns, cudnn = cell_calls(problem, cfgs)

        cell = f"{dtype} d{d} s{s} {'causal' if causal else 'full'}"
        ref = None
        for key, fn in fns.items():
            out = fn()
            assert not out.isnan().any(), f"{cell} {key}: NaN in the output"
            if ref is None:
                ref = out
            else:
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, f"{cell} {key}: differs from the first row by {err:.3g}"
        fns["sdpa_cudnn"] = cudnn
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=args.b2b, order=args.order)
        flops = op_flops(problem)
        base = flops / times["sdpa_cudnn"].median_ms / 1e9
        for key, t in times.items():
            tf = flops / t.median_ms / 1e9
            name = cfgs[key].name if key in cfgs else ""
            print(f"{cell:<22} {key:<11} {name:<68} {t.median_ms:8.3f} {tf:7.1f} {tf / base:8.3f} "
                  f"{t.spread:6.3f}", flush=True)
            results.append(dict(cell=cell, dtype=dtype, head_dim=d, causal=causal, seqlen=s, row=key,
                                config=name, median_ms=t.median_ms, tflops=tf, x_cudnn=tf / base,
                                spread=t.spread, regime=f"b2b{args.b2b}_{args.order}"))
        if args.tuner_check and dtype == "bf16":
            from cuflash import registry
            from cuflash.tuning.measure import GpuMeasure

            fam = registry.get("sm90_fwd")
            for mode in ("bench", "flush"):
                m = GpuMeasure(fam, problem, reps=args.reps, seed=0, timing=mode)
                r = m(cfgs["heur"])
                assert r.ok, (mode, r.status, r.reason)
                tf = flops / r.median_ms / 1e9
                print(f"{cell:<22} tuner:{mode:<5} {cfgs['heur'].name:<68} {r.median_ms:8.3f} {tf:7.1f} "
                      f"{tf / base:8.3f}", flush=True)
                results.append(dict(cell=cell, dtype=dtype, head_dim=d, causal=causal, seqlen=s,
                                    row=f"tuner_{mode}", config=cfgs["heur"].name, median_ms=r.median_ms,
                                    tflops=tf, x_cudnn=tf / base, regime=f"tuner_{mode}"))
        del fns, cudnn, ref
        torch.cuda.empty_cache()
    if args.order_check:
        results += order_check(args.reps)
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        write_rows(args.out, results)


if __name__ == "__main__":
    main()
