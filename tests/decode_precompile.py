"""Fill CuPy's kernel cache, in parallel worker processes, with every decode_splitkv kernel set
that the decode GPU round compiles (not a test; run it first so the tests and the timing find
their kernels on disk):

  * tests/decode_tma_timing.py's candidates (every cell and page size);
  * tests/test_decode_bulk_gpu.py: the bulk configs of its cases;
  * tests/test_decode_tma_gpu.py: the Hopper loop's configs of its grid, leftpad, page-crossing,
    ring-depth and small-page tests;
  * tests/test_decode_bandwidth_gpu.py: the l2_prefetch / warp_loads configs of its cases;
  * tests/gpu_sanitize.py --quick --families decode_splitkv: its decode shapes under each pass of
    decode_loops (the default selection, the bandwidth options, TMA_DEFAULT, TMA_PAGED_DEFAULT);
  * tests/test_decode_latency_gpu.py: the split merge (plain and fused) and page_gather configs;
  * tests/test_decode_resident_gpu.py: the 4-warp contiguous tiles and page 256 on the Hopper loop;
  * tests/test_decode_regs_gpu.py: the regs kernel's configs (REGS_DEFAULT 1 .. 6);
  * tests/test_decode_pdl_gpu.py and tests/decode_pdl_sanitize.py: the regs kernel's configs with pdl 1, 2;
  * tests/test_decode_staged_gpu.py and tests/decode_staged_sanitize.py: the regs kernel's configs with regs_staged;
  * tests/test_decode_pair_gpu.py: the regs kernel's 2 splits as a cluster of 2 (REGS_CLUSTER_PAIRS);
  * tests/test_decode_page_shift_gpu.py and tests/decode_page_shift_sanitize.py: regs_page_shift.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/decode_precompile.py [--processes 16] [--list]
        [--only page_table2_tests,page_table2_b1,page_shift_tests,shipped_b1,spec_tests,staged_tests,pair_tests,pdl_tests,shape_tests,page_table_tests,cluster_tests,regs_tests,stream_tests,claims_tests,ringfill_tests,core_tests,host_tests,timing,bulk_tests,resident_tests,tma_tests,bandwidth_tests,sanitize,latency_tests] [--propose 'NAME=VALUE ...' (as the timing)]
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the tests' modules; cuflash from the checkout

from cuflash.families import decode_splitkv as mod  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import get  # noqa: E402

FAM = get("decode_splitkv")
ARCH = (9, 0)


def _problem(b, sq, ctx, h, hk, d, dtype="bf16", page=None):
    return Problem("decode", dtype, b, sq, max(ctx, 1), h, hk, d, sq > 1, False,
                   ("paged_kv",) if page else ())


SWITCHES = ("TMA_DEFAULT", "TMA_PAGED_DEFAULT", "L2_PREFETCH_DEFAULT", "WARP_LOADS_DEFAULT",
            "SMALL_PAGE_WARPS")


def _heuristic(problem, page=0, tma=False, tma_paged=False, l2=None, warp_loads=False, small_page_warps=None,
               **extra):
    """The config a call of ``problem`` with caches of ``page`` keys per page runs under the
    given module switches (the heuristic, then call_config), with splits 0; ``extra``: other
    switches by name (FUSED_COMBINE_DEFAULT=True ...)."""
    old = {k: getattr(mod, k) for k in SWITCHES + tuple(extra)}
    for k, v in zip(SWITCHES, (tma, tma_paged, l2, warp_loads, small_page_warps)):
        if v is not None:  # None: the module's value (L2_PREFETCH_DEFAULT, SMALL_PAGE_WARPS)
            setattr(mod, k, v)
    for k, v in extra.items():
        setattr(mod, k, v)
    try:
        cfg = FAM.heuristic(problem, ARCH)
        cfg = FAM.call_config(cfg, problem, ARCH, page or 0, chosen=True, heuristic=True)
    finally:
        for k, v in old.items():
            setattr(mod, k, v)
    return cfg.replace(splits=0)


PROPOSALS = []  # --propose 'NAME=VALUE ...' (as tests/decode_tma_timing.py takes them)


def timing_configs():
    import decode_tma_timing as dt

    return dt.all_configs(list(dt.CELLS), list(dt.PAGES), ARCH, [dt.parse_switches(p) for p in PROPOSALS])


def tma_test_configs():
    import test_decode_tma_gpu as t

    out = []
    for b, sq, ctx, h, hk, d, dtype, _, page in t.CASES:                          # test_tma_grid
        out.append(t.tma_config(_problem(b, sq, ctx, h, hk, d, dtype, page)))
    out.append(t.tma_config(_problem(4, 2, 1200, 8, 2, 128)))                    # test_tma_leftpad
    p = _problem(3, 1, 2049, 32, 8, 128)                                         # ring depths
    out += [t.tma_config(p, **c) for c in (dict(stages=2), dict(warps=4, stages=6), dict(warps=4, stages=3))]
    for page, d, sq, heads in ((48, 96, 16, (16, 4)), (64, 128, 1, (32, 8))):   # page-crossing boxes
        out.append(t.tma_config(_problem(2, sq, 2049, *heads, d, page=page), warps=4, stages=3))
    for page in (16, 256):                                                        # small pages
        out.append(_heuristic(_problem(3, 1, 2050, 32, 8, 128, page=page), page, tma_paged=True))
    out.append(t.tma_config(_problem(4, 1, 3001, 32, 8, 128)))                   # cuda graph
    out.append(t.tma_config(_problem(3, 1, 1003, 8, 8, 128)))                    # cache_batch_idx
    out.append(t.tma_config(_problem(2, 4, 304, 8, 2, 128, "fp16")))             # append + rotary
    out.append(t.tma_config(_problem(2, 4, 902, 16, 4, 128)))                    # features
    return [c.replace(splits=0) for c in out]


def bandwidth_test_configs():
    import test_decode_bandwidth_gpu as t

    out = [_heuristic(_problem(b, sq, ctx, h, hk, d, dtype, page), page, l2=size, warp_loads=wl,
                      SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0)
           for b, sq, ctx, h, hk, d, dtype, _, page, size, wl in t.CASES]
    leftpad = _heuristic(_problem(3, 1, 2050, 32, 8, 128, page=48), 48, l2=0,   # forced: both options, 8 / 4 warps
                         SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0)
    out += [leftpad.replace(l2_prefetch=256, warp_loads=True, warps=w, stages=3) for w in (8, 4)]
    out.append(_heuristic(_problem(3, 2, 4098, 32, 8, 128, page=16), 16, small_page_warps=4, l2=0,
                          SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0))
    return out


def sanitize_configs():
    """--quick's decode shapes (bf16) under each of decode_loops' passes."""
    import gpu_sanitize as g

    g._quick()
    out = []
    for b, sq, lens, h, hk, d, page, new, _, _ in g.DECODE_SHAPES:
        p = _problem(b, sq, max(lens) + new, h, hk, d, page=page)
        for switches in ({}, dict(l2=256, warp_loads=True, SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0), dict(tma=True),
                         dict(tma_paged=True),
                         dict(FUSED_COMBINE_DEFAULT=True, PAGE_GATHER_DEFAULT=True, SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0),
                         dict(CONTIGUOUS_WARPS=4, CONTIGUOUS_STAGES=3, SPLIT_RULE_RESIDENT_CONTIGUOUS=True,
                              LARGE_PAGE_TMA_MAX_KEYS=1 << 20), dict(LEAN_DEFAULT=True, warp_loads=True),
                         dict(SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0, BULK_DEFAULT=1,
                              BULK_PAGED_DEFAULT=1, EARLY_MERGE_DEFAULT=True),
                         dict(SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0, FUSED_COMBINE_DEFAULT=True,
                              RING_FILL_DEFAULT=2, DYNAMIC_DEFAULT=1, DYNAMIC_MAX_GROUPS=1 << 30, DYNAMIC_MIN_KEYS=0,
                              LEAN_DEFAULT=True)):
            for dtype in g.DTYPES:
                out.append(_heuristic(p.replace(dtype=dtype), page, **switches))
    return out


def latency_test_configs():
    """tests/test_decode_latency_gpu.py: its split-merge cases (plain and fused combine) and its
    page_gather cases (8 and 4 warps), under the switches each test sets."""
    import test_decode_latency_gpu as t

    def under(problem, page=0, **switches):
        old = {k: getattr(mod, k) for k in switches}
        try:
            for k, v in switches.items():
                setattr(mod, k, v)
            cfg = FAM.heuristic(problem, ARCH)
            return FAM.call_config(cfg, problem, ARCH, page, chosen=True, heuristic=True).replace(splits=0)
        finally:
            for k, v in old.items():
                setattr(mod, k, v)

    out = []
    for b, sq, ctx, h, hk, d, dtype, _ in t.COMBINE_CASES:
        for fused in (False, True):
            out.append(under(_problem(b, sq, ctx, h, hk, d, dtype), FUSED_COMBINE_DEFAULT=fused))
    for b, sq, ctx, h, hk, page, _, _, warps in t.GATHER_CASES:
        out.append(under(_problem(b, sq, ctx + 1, h, hk, 128, page=page), page, PAGE_GATHER_DEFAULT=True,
                         SMALL_PAGE_WARPS=warps, TMA_PAGED_DEFAULT=False))
    return out


def resident_test_configs():
    """tests/test_decode_resident_gpu.py: contiguous 4-warp tiles (3 / 2 / 6 stages), 6 x 2, and
    page 256 on the Hopper loop, under the switches each test sets."""
    import test_decode_resident_gpu as t

    out = []
    for case in t.CASES:
        b, sq, ctx, h, hk, d, dtype, _ = case
        for warps, stages in t.TILES:
            if t.tiles_run((warps, stages), case):
                out.append(_heuristic(_problem(b, sq, ctx + 1, h, hk, d, dtype), 0, CONTIGUOUS_WARPS=warps,
                                      CONTIGUOUS_STAGES=stages, SPLIT_RULE_RESIDENT_CONTIGUOUS=True))
    for case in t.CASES:                                                          # lean
        b, sq, ctx, h, hk, d, dtype, _ = case
        for wl in (False, True):
            if not wl or (d == 128 and dtype == "bf16" and sq * h // hk <= 16):
                out.append(_heuristic(_problem(b, sq, ctx + 1, h, hk, d, dtype), 0, LEAN_DEFAULT=True,
                                      warp_loads=wl))
    for b, sq, ctx, h, hk in (1, 1, 8192 + 113, 32, 8), (3, 2, 2049, 16, 2), (2, 4, 17, 8, 8):
        out.append(_heuristic(_problem(b, sq, ctx + 1, h, hk, 128, page=256), 256, LARGE_PAGE_TMA_MAX_KEYS=1 << 20))
    return out


def bulk_test_configs():
    """tests/test_decode_bulk_gpu.py: its grid, page 48 leftpad + append, and the 16k ring-wrap
    case, each under BULK_DEFAULT / BULK_PAGED_DEFAULT as the test sets them."""
    import test_decode_bulk_gpu as t

    sw = dict(SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0)
    out = [_heuristic(_problem(b, sq, ctx, h, hk, d, dtype, page), page or 0, BULK_DEFAULT=bulk,
                      BULK_PAGED_DEFAULT=bulk, **sw)
           for b, sq, ctx, h, hk, d, dtype, _, page, bulk in t.CASES]
    out.append(_heuristic(_problem(3, 1, 2050, 32, 8, 128, page=48), 48, BULK_PAGED_DEFAULT=1, **sw))
    out.append(_heuristic(_problem(1, 1, 16384, 32, 8, 128), 0, BULK_DEFAULT=1, **sw))
    for bulk in (0, 1):                                                           # early_merge
        out.append(_heuristic(_problem(3, 2, 8191, 32, 8, 128), 0, BULK_DEFAULT=bulk, EARLY_MERGE_DEFAULT=True, **sw))
    return out


def host_test_configs():
    """tests/test_decode_host_gpu.py: its cases under the fused-combine switch each sets (the graph
    and stride tests, and tests/decode_host_timing.py, run the first's kernel set)."""
    import test_decode_host_gpu as t

    return [_heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0,
                       FUSED_COMBINE_DEFAULT=fused)
            for b, sq, lens, h, hk, d, dtype, page, _, fused in t.CASES]


def core_test_configs():
    """tests/test_decode_gpu.py's grid (contiguous caches, the heuristic's configs)."""
    import test_decode_gpu as t

    return [_heuristic(_problem(b, sq, ctx, h, hk, d, dtype)) for b, sq, ctx, h, hk, d, dtype, _ in t.CASES]


def ringfill_test_configs():
    """tests/test_decode_ringfill_gpu.py: its grid under each (RING_FILL_DEFAULT, DYNAMIC_DEFAULT)
    mode, and the window / lean and CUDA-graph cases."""
    import test_decode_ringfill_gpu as t

    sw = dict(SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0, DYNAMIC_MAX_GROUPS=1 << 30, DYNAMIC_MIN_KEYS=0)
    out = [_heuristic(_problem(b, sq, ctx, h, hk, d, dtype, page), page or 0, RING_FILL_DEFAULT=rf,
                      DYNAMIC_DEFAULT=dyn, **sw)
           for b, sq, ctx, h, hk, d, dtype, _, page in t.CASES for rf, dyn in t.MODES]
    out.append(_heuristic(_problem(3, 2, 40000, 32, 8, 128), 0, RING_FILL_DEFAULT=2, DYNAMIC_DEFAULT=1,
                          LEAN_DEFAULT=True, **sw))
    out.append(_heuristic(_problem(1, 1, 65536, 32, 8, 128), 0))   # the heuristic's own dynamic call
    return out


def claims_test_configs():
    """tests/test_decode_ringfill_gpu.py's dynamic-claims cases only (ring_fill 1 + dynamic 1: the
    heuristic's; its -k "rf1_dyn1 or window or graph or heuristic")."""
    import test_decode_ringfill_gpu as t

    sw = dict(SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0, DYNAMIC_MAX_GROUPS=1 << 30, DYNAMIC_MIN_KEYS=0)
    out = [_heuristic(_problem(b, sq, ctx, h, hk, d, dtype, page), page or 0, RING_FILL_DEFAULT=1, DYNAMIC_DEFAULT=1, **sw)
           for b, sq, ctx, h, hk, d, dtype, _, page in t.CASES]
    out.append(_heuristic(_problem(3, 2, 40000, 32, 8, 128), 0, RING_FILL_DEFAULT=2, DYNAMIC_DEFAULT=1,
                          LEAN_DEFAULT=True, **sw))
    out.append(_heuristic(_problem(1, 1, 131072, 32, 8, 128), 0, RING_FILL_DEFAULT=2, DYNAMIC_DEFAULT=1, **sw))  # graph
    out.append(_heuristic(_problem(1, 1, 65536, 32, 8, 128), 0))   # the heuristic's own dynamic call
    return out


def stream_test_configs():
    """tests/test_decode_stream_gpu.py (STREAM_DEFAULT, contiguous and page 16; LIGHT_FENCE_DEFAULT)
    and tests/decode_stream_sanitize.py."""
    import test_decode_stream_gpu as t

    sw = dict(STREAM_DEFAULT=True, STREAM_PAGED=True, TMA_PAGED_DEFAULT=False, SMALL_PAGE_TMA_MAX_KEYS=0,
              LARGE_PAGE_TMA_MAX_KEYS=0, SMALL_PAGE_WARPS=8)
    return [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                       **sw)
            for b, sq, lens, h, hk, d, dtype, page, extra in t.CASES] + [
        _heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0, **dict(sw, STREAM_DEFAULT=False),
                   LIGHT_FENCE_DEFAULT=True)
        for b, sq, lens, h, hk, d, dtype, page, extra in t.LF_CASES]


def regs_test_configs():
    """tests/test_decode_regs_gpu.py (REGS_DEFAULT 1 .. 6) and tests/decode_regs_sanitize.py."""
    import test_decode_regs_gpu as t

    def cfg(case, regs):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                          REGS_DEFAULT=regs, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=())

    pf = [_heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0, REGS_DEFAULT=1, REGS_PREFETCH_DEFAULT=True, REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                     REGS_HEAD_DIM_DEFAULT=(64, 128))
          for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.PREFETCH_CASES]
    ahead = [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                        REGS_DEFAULT=regs, REGS_AHEAD_DEFAULT=ra, REGS_AHEAD_L1_DEFAULT=l1, REGS_ORDER_DEFAULT=ro, REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                        REGS_HEAD_DIM_DEFAULT=(64, 128))
             for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.AHEAD_CASES + [(4, 1, [65536], 32, 8, 128, "bf16", pg, {}, {})
                                                                                 for pg in (None, 16)]
             for regs, ra, l1, ro in t.AHEAD_OPTIONS + [(7, 3, False, 2)]]
    b1 = [_heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0, REGS_DEFAULT=6, REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                     REGS_BATCH1_RULES=((1 << 30, dict(f)),))
          for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.BATCH1_CASES + [(1, 1, [65536], 32, 8, 128, "bf16", None, {}, {})]
          for f in t.BATCH1_OPTIONS]
    return pf + ahead + b1 + [cfg(c, 1) for c in t.CASES] + [cfg(c, regs) for c in t.HINT_CASES for regs in t.REGS[1:]] + [
        cfg((2, 4, [1999], 8, 2, 64, "bf16", None, {}, {}), 3)] + [   # decode_regs_sanitize.py's d 64 call
        cfg((3, 1, [3000], 32, 8, 128, "bf16", None, {}, {}), 1).replace(**kw)   # and its calls ahead
        for kw in ({"regs_ahead": 3}, {"regs": 7, "regs_ahead": 2, "regs_ahead_l1": True},
                   {"regs_order": 2, "regs_ahead": 2}, {"regs": 6, "regs_prefetch": True},
                   {"regs": 6, "regs_prefetch": True, "regs_prefetch_blocks": 2},
                   {"regs": 6, "regs_prefetch": True, "regs_prefetch_blocks": 3},
                   {"regs": 6, "regs_prefetch": True, "warps": 4}, {"regs": 6, "regs_order": 2})]


def pdl_test_configs():
    """tests/test_decode_pdl_gpu.py (PDL_DEFAULT 1, 2; FUSED_COMBINE_DEFAULT off for its separate-combine test)
    and tests/decode_pdl_sanitize.py."""
    import test_decode_pdl_gpu as t

    def cfg(case, pdl, fused=True):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                          PDL_DEFAULT=pdl, PDL_RULES=(), REGS_HEAD_DIM_DEFAULT=(64, 128), FUSED_COMBINE_DEFAULT=fused)

    chain = [(b, 1, [4095], 32, 8, 128, "bf16", page, {"seqlen_new": 1} if append else {}, {})
             for b in (1, 3) for page in (None, 16) for append in (False, True)]
    base = _heuristic(_problem(3, 1, 3000, 32, 8, 128), 0, REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128))
    sanitize = [c for pdl in (1, 2) for c in (
        base.replace(pdl=pdl), base.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3, pdl=pdl),
        base.replace(pdl=pdl, fused_combine=False, light_fence=False))]
    return ([cfg(c, pdl) for c in t.GRID + chain for pdl in (1, 2, 3)]
            + [cfg(c, 1, fused=False) for c in (t.CASES[2], t.CASES[7], t.CASES[10])] + sanitize)


def staged_test_configs():
    """tests/test_decode_staged_gpu.py (REGS_STAGED_DEFAULT 1 .. 4 at 4 and 8 warps, the separate combine,
    REGS_STAGED_RULES' batch-1 entry) and tests/decode_staged_sanitize.py."""
    import decode_staged_sanitize as san
    import test_decode_staged_gpu as t

    def cfg(case, staged, warps, fused=True):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                          REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                          REGS_STAGED_DEFAULT=staged, REGS_STAGED_RULES=(), REGS_WARPS=warps,
                          FUSED_COMBINE_DEFAULT=fused)

    rule = [_heuristic(_problem(1, 1, n, 32, 8, 128), 0, REGS_STAGED_RULES=((1, 8192, {"warps": 4, "regs_staged": 2}),))
            for n in (8192, 4096, 8001)]
    graph = [(3, 1, [16384], 32, 8, 128, "bf16", page, {}, {}) for page in (None, 16)]
    early = [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                        REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                        PDL_DEFAULT=0, PDL_RULES=(),
                        REGS_STAGED_RULES=((1 << 20, 1 << 30, dict(t.SEPARATE, early_merge=True, pdl=pdl)),))
             for b, sq, lens, h, hk, d, dtype, page, extra, kw in [t.CASES[i] for i in (0, 5, 7, 8, 10, 12)]
             for pdl in (0, 1)]
    shipped = [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0)
               for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.B1_CASES]
    base, cfgs, d64 = san.configs()
    return (early + shipped + [cfg(c, 2, 4) for c in t.CASES] + [cfg(c, s, w) for c in t.DEPTH_CASES for s, w in t.DEPTHS]
            + [cfg(c, 2, 4, fused=False) for c in (t.CASES[5], t.CASES[7], t.CASES[13])]
            + [cfg(c, s, 4) for c in graph for s in (1, 2)] + rule + cfgs + [d64, base.replace(regs=1)])


def shipped_b1_configs():
    """tests/test_decode_staged_gpu.py -k batch1_rule / batch1_paged_rule and tests/decode_staged_sanitize.py --shipped:
    the configs the shipped batch-1 rules give (REGS_BATCH1_RULES, REGS_BATCH1_PAGED_RULES up to 8k keys)."""
    import test_decode_staged_gpu as t

    return [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0)
            for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.B1_CASES + t.B1_PAGED_CASES]


def spec_test_configs():
    """tests/test_decode_spec_gpu.py (every regs call on regs_order 2 with kSpec; the batch-1 rule with them) and
    tests/decode_spec_sanitize.py."""
    import test_decode_spec_gpu as t

    def every(case, spec):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                          REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                          REGS_ORDER_DEFAULT=2, REGS_SPEC_DEFAULT=spec, REGS_BATCH1=False)

    def rule(case):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page or 0,
                          REGS_BATCH1_RULES=((8192, t.SPEC_RULE),) + mod.REGS_BATCH1_RULES[1:],
                          REGS_BATCH1_PAGED_RULES=((8192, t.SPEC_RULE),))

    graph = [(3, 1, [16384], 32, 8, 128, "bf16", None, {}, {})]
    b1 = [(1, 1, [8192], 32, 8, 128, "bf16", page, {}, {}) for page in (None, 16)]
    import decode_spec_sanitize as san

    return [every(c, spec) for c in t.CASES + graph for spec in (1, 2)] + [rule(c) for c in t.B1_CASES + t.B1_PAGED_CASES + b1] + list(san.configs())


def cluster_test_configs():
    """tests/test_decode_regs_gpu.py's cluster tests (REGS_CLUSTER_DEFAULT 2 .. 16) and
    tests/decode_cluster_sanitize.py."""
    import test_decode_regs_gpu as t

    out = []
    for cl in t.CLUSTERS:
        for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.CLUSTER_CASES + [(1, 1, [65536], 32, 8, 128, "bf16", None, {}, {})]:
            out.append(_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page),
                                  page or 0, REGS_DEFAULT=6, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_CLUSTER_DEFAULT=cl,
                                  REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=()))
    import decode_cluster_sanitize as san   # its configs

    base = mod.DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=6)
    out += [c for cl in san.CLUSTERS for c in (base.replace(regs_cluster=cl),
                                               base.replace(head_dim=64, m_tiles=2, regs=3, causal=True,
                                                            regs_cluster=cl))]
    for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.CLUSTER_CASES[:3]:   # num_splits 3: without the cluster
        out.append(FAM.without_cluster(_heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0,
                                                  REGS_DEFAULT=6, REGS_CLUSTER_DEFAULT=16,
                                                  REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=())))
    return out


def page_table_test_configs():
    """tests/test_decode_regs_gpu.py's page-table tests (REGS_PAGE_TABLE_DEFAULT 1; 8 and 4 warps; at
    batch 1 regs_prefetch of 1 and 3 blocks)."""
    import test_decode_regs_gpu as t

    def cfg(case, warps=8, prefetch=0):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page,
                          REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(), REGS_PAGE_TABLE_DEFAULT=1,
                          REGS_PAGED_TMA_MAX_KEYS=0, REGS_WARPS=warps, REGS_PAGED_BATCH1_PREFETCH=((1 << 30, prefetch),))

    graphs = [(4, 1, [65536], 32, 8, 128, "bf16", pg, {}, {}) for pg in (16, 256)]
    base = mod.DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, light_fence=True, regs=1)
    sanitize = [base.replace(regs_page_table=1), base.replace(regs_page_table=1, regs_prefetch=True),   # decode_regs_sanitize.py --page-table
                base.replace(regs=6, regs_page_table=1, regs_prefetch=True, regs_prefetch_blocks=3),
                base.replace(regs=6, regs_page_table=1, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3),
                base.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3)]
    return (sanitize + [cfg(c) for c in t.PAGE_TABLE_CASES + graphs] + [cfg(c, warps=4) for c in t.PAGE_TABLE_CASES[:5]]
            + [cfg(c, prefetch=pf) for c in t.PAGE_TABLE_B1_CASES + [(1, 1, [65536], 32, 8, 128, "bf16", 16, {}, {})]
               for pf in (1, 3)])


def shape_test_configs():
    """tests/test_decode_regs_gpu.py's REGS_SHAPE_RULES tests (the heuristic as shipped)."""
    import test_decode_regs_gpu as t

    cases = [c for c, _, _ in t.SHAPE_CASES] + [(8, 1, [16384], 32, 8, 128, "bf16", pg, {}, {}) for pg in (None, 16)]
    return [_heuristic(_problem(b, sq, max(lens), h, hk, d, dtype, page), page or 0)
            for b, sq, lens, h, hk, d, dtype, page, extra, kw in cases]


def pair_test_configs():
    """tests/test_decode_pair_gpu.py's calls (REGS_CLUSTER_PAIRS: the 2 splits as one cluster of 2 CTAs; paged
    with REGS_CLUSTER_PAIRS_PAGED; the switch off: the fused combine)."""
    import test_decode_pair_gpu as t

    out = []
    for b, sq, lens, h, hk, d, dtype, page, extra, kw in t.CASES + [(8, 1, [20000], 32, 8, 128, "bf16", pg, {}, {})
                                                                      for pg in (None, 16)]:
        p = _problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page)
        cfg = _heuristic(p, page or 0, REGS_HEAD_DIM_DEFAULT=(64, 128))
        out += [cfg, FAM.pair_cluster(cfg.replace(splits=0), p, 2) if not page else
                cfg.replace(regs_cluster=2, fused_combine=False, light_fence=False)]
    return out


def page_shift_test_configs():
    """tests/test_decode_page_shift_gpu.py (REGS_PAGE_SHIFT_DEFAULT 1 at REGS_ORDER_DEFAULT 0, 1; with the staged table)
    and tests/decode_page_shift_sanitize.py."""
    import decode_page_shift_sanitize as san
    import test_decode_page_shift_gpu as t

    def cfg(case, order, table=0):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page,
                          REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                          REGS_PAGED_TMA_MAX_KEYS=0, REGS_PAGE_SHIFT_DEFAULT=1, REGS_ORDER_DEFAULT=order,
                          REGS_PAGE_TABLE_DEFAULT=table)

    graphs = [(b, 1, [cap], 32, 8, 128, "bf16", pg, {}, {}) for b, cap in ((1, 8192), (3, 20000)) for pg in (16, 256)]
    return ([cfg(c, o) for c in t.CASES + graphs for o in (0, 1)] + [cfg(c, 0, 1) for c in t.CASES[:6]]
            + list(san.CONFIGS))


def page_table2_test_configs():
    """tests/test_decode_page_table2_gpu.py (REGS_PAGE_TABLE_DEFAULT 2 with REGS_PAGE_SHIFT_DEFAULT 1 / 0 at
    REGS_ORDER_DEFAULT 0, 1) and tests/decode_page_table2_sanitize.py."""
    import decode_page_table2_sanitize as san
    import test_decode_page_table2_gpu as t

    def cfg(case, order, shift):
        b, sq, lens, h, hk, d, dtype, page, extra, kw = case
        return _heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page,
                          REGS_DEFAULT=1, REGS_HEAD_DIM_DEFAULT=(64, 128), REGS_BATCH1_HINT=(), REGS_SHAPE_RULES=(),
                          REGS_PAGED_TMA_MAX_KEYS=0, REGS_PAGE_SHIFT_DEFAULT=shift, REGS_ORDER_DEFAULT=order,
                          REGS_PAGE_TABLE_DEFAULT=2)

    graphs = [(b, 1, [cap], 32, 8, 128, "bf16", pg, {}, {}) for b, cap in ((1, 8192), (3, 20000)) for pg in (16, 256)]
    return ([cfg(c, o, s) for c in t.CASES for o in (0, 1) for s in (1, 0)] + [cfg(c, 0, 1) for c in graphs]
            + list(san.CONFIGS) + page_table2_b1_configs())


def page_table2_b1_configs():
    """tests/test_decode_staged_gpu.py -k batch1_paged_rule on the H200 (its table's paged batch-1 rule:
    regs_page_table 2) and tests/decode_page_table2_sanitize.py --quick."""
    import decode_page_table2_sanitize as san
    import test_decode_staged_gpu as st

    return [_heuristic(_problem(b, sq, max(lens) + extra.get("seqlen_new", 0), h, hk, d, dtype, page), page,
                       REGS_PAGE_TABLE_DEFAULT=2)
            for b, sq, lens, h, hk, d, dtype, page, extra, kw in st.B1_PAGED_CASES] + list(san.CONFIGS[:1])


GROUPS = {"page_table2_tests": page_table2_test_configs, "page_table2_b1": page_table2_b1_configs, "page_shift_tests": page_shift_test_configs, "shipped_b1": shipped_b1_configs, "spec_tests": spec_test_configs, "staged_tests": staged_test_configs, "pair_tests": pair_test_configs, "pdl_tests": pdl_test_configs, "shape_tests": shape_test_configs, "page_table_tests": page_table_test_configs, "cluster_tests": cluster_test_configs, "regs_tests": regs_test_configs, "stream_tests": stream_test_configs, "claims_tests": claims_test_configs, "ringfill_tests": ringfill_test_configs, "core_tests": core_test_configs, "host_tests": host_test_configs, "timing": timing_configs, "bulk_tests": bulk_test_configs, "resident_tests": resident_test_configs, "tma_tests": tma_test_configs,
          "bandwidth_tests": bandwidth_test_configs, "sanitize": sanitize_configs,
          "latency_tests": latency_test_configs}


# the groups of the test files that pin options of the older loops (tests/conftest.py
# DECODE_OLDER_LOOP_TESTS): their configs are the heuristic's with the regs kernel off
OLDER_LOOP_GROUPS = frozenset({"stream_tests", "claims_tests", "ringfill_tests", "bulk_tests", "resident_tests",
                               "tma_tests", "bandwidth_tests", "latency_tests"})


def all_configs(groups=tuple(GROUPS)):
    """The configs of ``groups``, one per kernel set (configs that differ only in run-time fields,
    causal or splits, share their compiled module)."""
    out = {}
    for name in groups:
        regs = mod.REGS_DEFAULT
        if name in OLDER_LOOP_GROUPS:   # as tests/conftest.py runs those files: the regs kernel off
            mod.REGS_DEFAULT = 0
        try:
            for c in GROUPS[name]():
                out.setdefault((c.dtype, tuple(FAM.kernel_names(c).values())), c)
        finally:
            mod.REGS_DEFAULT = regs
    return list(out.values())


def main():
    groups = tuple(GROUPS)
    argv = sys.argv
    PROPOSALS.extend(argv[i + 1] for i, x in enumerate(argv) if x == "--propose")
    if "--only" in sys.argv:
        groups = tuple(sys.argv[sys.argv.index("--only") + 1].split(","))
    configs = all_configs(groups)
    if "--list" in sys.argv:
        for c in configs:
            print(c.name)
        print(f"{len(configs)} kernel sets")
        return 0
    from cuflash import _gpu
    from cuflash.compile import precompile

    _gpu.require("tests/decode_precompile.py")
    processes = int(sys.argv[sys.argv.index("--processes") + 1]) if "--processes" in sys.argv else None
    t0 = time.time()
    res = precompile(configs, processes=processes)
    bad = [(c.name, e) for c, _, e in res if e]
    slow = max(res, key=lambda r: r[1])
    print(f"precompiled {len(res)} decode kernel sets in {time.time() - t0:.1f} s "
          f"(slowest {slow[0].name}: {slow[1]:.1f} s)")
    for name, err in bad:
        print(f"FAILED {name}: {err[:400]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
