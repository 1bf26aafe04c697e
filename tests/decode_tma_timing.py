"""Decode bandwidth on the H100 for picking decode_splitkv's defaults (issue 13): bf16, d 128, 32
query heads on 8 KV heads, one query row, the cache full; batch 1 / 8 / 32 / 64 x context 8k /
32k / 128k, each contiguous and paged (page 16 and 256, over a shuffled block table that views the same
memory), CUDA-graph timing. In the same process, per cell:

  * ``sdpa_flash`` / ``sdpa_cudnn``: scaled_dot_product_attention (enable_gqa) on (b, h, s, d)
    views of the same cache (contiguous cells);
  * ``heuristic``: flash_attn_with_kvcache as users call it (today's defaults), and ``prop``
    (``prop2`` ...): the config it would run with the module switches of each ``--propose``
    set (e.g. ``--propose "L2_PREFETCH_DEFAULT=256 SMALL_PAGE_WARPS=4"``);
  * every candidate of ``candidates``, forced through kvcache_with_config at its split rule's
    count (``num_splits_for``; ``_res``: the count of the co-resident model, which fills every
    resident CTA slot, SPLIT_RULE_RESIDENT_CONTIGUOUS; ``_xN``: N splits):
    - ``base``         the heuristic's tiles on the cp.async loop (8 warps x 16 keys, 3 stages:
                       one CTA per SM), no option;
    - contiguous cells with more than one split (batch <= 8), each with the L2 prefetch hint (256)
                       and the fused combine: ``em`` (the heuristic's tiles with early_merge: the
                       merging CTA's first partial-O loads before its LSE loads), ``w4em`` (4
                       warps x 3 stages, two CTAs per SM, at the co-resident rule's count; batch 1
                       also 33 splits), ``w4n32em`` (4 warps of 32 keys, 2 stages: 128-key blocks
                       as cuDNN's kernel); where the heuristic's tiles are 4 x 3
                       (CONTIGUOUS_SMALL_TILE_MIN_GROUPS): ``w8s3`` (8 warps, 3 stages);
    - paged cells: at page 256 with at most 256k keys in all, ``tma4``: the Hopper loop, 4 warps,
                       3 stages (LARGE_PAGE_TMA_MAX_KEYS);
    (session 17 round A timed the bulk rows, ``bulk`` 1 / 2, against these: slower everywhere; see
    BULK_DEFAULT's note)
  * the ``1x8k_cold`` cell: the graph cycles over 4 caches (134 MB, more than the 50 MB L2), so
    no call finds its K/V in L2 (1x8k's 34 MB fit: a replayed graph of one cache may hit);
  * ``--profile``: in the batch-1 contiguous cells, each of PROFILE_LABELS' graphs replays once
    under torch.profiler: per call, each kernel's device time, the busy time, the first start to
    the last end and the idle gaps between kernels (where the fixed costs go).

Each timing is a CUDA graph of n calls (about 2 ms a replay); every record's graph is captured
once, then the cell's graphs replay ``--repeat`` times in shuffled order (a new permutation per
round: cuflash.timing.round_orders), ``--reps`` replays each time; ``us`` is the median over the repeats' medians and ``spread``
the largest over the smallest (a noisy cell shows there). Every cuflash output is compared with
the heuristic's on the same cache (max |diff| <= 1.6e-2, bf16), and the heuristic with SDPA
cuDNN on contiguous cells; a mismatch shows as ``BAD``. Prints one table per cell (fastest
first: us, K+V TB/s, x flash, x cuDNN, spread), then a summary per candidate (geometric mean of
base's time over its own, worst cell, cells where it is fastest), the module switches the
numbers support, and per cell the proposal against cuDNN and paged against contiguous; writes
every record as JSON to --out. The kernels compile first, in parallel worker processes
(``--no-precompile`` after tests/decode_precompile.py); ``--max-seconds`` stops starting new
cells after that long:

    CUPY_CACHE_DIR=/tmp/cupy_cache timeout 170 python tests/decode_tma_timing.py --out /tmp/dec_tma.json
    python tests/decode_tma_timing.py --precompile                      # compile only
    python tests/decode_tma_timing.py --no-precompile --out t.json      # after decode_precompile.py
    python tests/decode_tma_timing.py --cells 1x8k 1x32k --pages 0 --out t.json   # a subset

Not a test (no assertions); the lead reads the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

HQ, HK, D = 32, 8, 128
CELLS = {  # name: (batch, ctx, caches the graph cycles over), smallest K+V first
    "1x8k": (1, 8192, 1), "1x8k_cold": (1, 8192, 4), "1x32k": (1, 32768, 1), "8x8k": (8, 8192, 1),
    "1x64k": (1, 65536, 1), "1x128k": (1, 131072, 1), "8x32k": (8, 32768, 1), "32x8k": (32, 8192, 1),
    "64x8k": (64, 8192, 1), "8x128k": (8, 131072, 1), "32x32k": (32, 32768, 1), "64x32k": (64, 32768, 1),
    "32x128k": (32, 131072, 1), "64x128k": (64, 131072, 1),
}
PAGES = (0, 16, 256)
TOL = 1.6e-2                     # bf16 outputs of |O| <~ 1: a couple of ulps
TARGET_REPLAY_US = 2000.0        # calls per graph: about this long a replay
SWITCH_NAMES = ("TMA_DEFAULT", "TMA_PAGED_DEFAULT", "L2_PREFETCH_DEFAULT", "WARP_LOADS_DEFAULT",
                "SMALL_PAGE_WARPS", "PAGED_SPLIT_RULE_RESIDENT", "FUSED_COMBINE_DEFAULT",
                "PAGE_PREFETCH_DEFAULT", "PAGE_GATHER_DEFAULT", "COMBINE_LAUNCH_COST",
                "SMALL_PAGE_TMA_MAX_KEYS", "CONTIGUOUS_WARPS", "CONTIGUOUS_STAGES",
                "SPLIT_RULE_RESIDENT_CONTIGUOUS", "LARGE_PAGE_TMA_MAX_KEYS", "LEAN_DEFAULT",
                "BULK_DEFAULT", "BULK_PAGED_DEFAULT", "EARLY_MERGE_DEFAULT", "RING_FILL_DEFAULT",
                "DYNAMIC_DEFAULT", "DYNAMIC_MAX_GROUPS", "DYNAMIC_MIN_KEYS", "STREAM_DEFAULT", "STREAM_PAGED",
                "STREAM_FORCE_CTAS", "LIGHT_FENCE_DEFAULT", "STREAM_WHOLE_GROUPS", "REGS_DEFAULT",
                "REGS_WARPS", "REGS_PREFETCH_DEFAULT")


def base_config(problem, arch=(9, 0)):
    """The heuristic's tiles for ``problem`` on the cp.async loop, no option."""
    from cuflash.registry import get

    return get("decode_splitkv").heuristic(problem, arch).replace(
        tma=False, fused_combine=False, page_prefetch=False, l2_prefetch=0, warp_loads=False, bulk=0,
        early_merge=False, light_fence=False, stream=False, splits=0)


CANDIDATES = True   # --no-candidates: the heuristic, the proposals and SDPA only


def candidates(base, batch: int, page: int, cold: bool = False, ctx: int = 0) -> list:
    """(label, config, split choices) of the forced configs a cell times (see the docstring); a
    split choice is a multiplier of the config's split rule (1: the rule's count) or ``"res"``:
    the rule's count under the co-resident model (SPLIT_RULE_RESIDENT_CONTIGUOUS)."""
    if not CANDIDATES:
        return []
    opts = dict(l2_prefetch=256, fused_combine=True)
    fc = base.replace(**opts)                               # the heuristic's contiguous config
    em = fc.replace(early_merge=True)                       # the merge's early partial-O loads
    if cold:  # where no call finds its K/V in L2
        return [("base", base, (1,)), ("em", em, (1,))]
    if not page:
        if base.warps != 8:  # the small tiles (CONTIGUOUS_SMALL_TILE_MIN_GROUPS) against 8 x 3
            return [("base", base, (1,)), ("w8s3", base.replace(warps=8, stages=3, **opts), (1,))]
        if batch > 8:    # one split: the merge does not run
            return [("base", base, (1,))]
        # two CTAs per SM (64-key blocks) with the early merge, at the co-resident rule's count and
        # at batch 1 also 33 splits (264 CTAs: every slot of 132 SMs, as cuDNN's 256 CTAs of 4
        # warps); 4 warps of 32 keys (128-key blocks as cuDNN's kernel, one CTA per SM)
        return [("base", base, (1,)), ("em", em, (1,)),
                ("w4em", em.replace(warps=4, stages=3), ("res", 33 / 16) if batch == 1 else ("res",)),
                ("w4n32em", em.replace(warps=4, warp_n=32, stages=2), (1,))]
    out = [("base", base, (1,))]
    if page >= 128 and batch * ctx <= 262144:  # the Hopper loop at page 256 (LARGE_PAGE_TMA_MAX_KEYS)
        out.append(("tma4", base.replace(tma=True, warps=4, stages=3, l2_prefetch=0, fused_combine=False,
                                         split_cost=4), (1,)))
    return out


def resident_splits(cfg, problem, sms: int) -> int:
    """The split rule's count for ``cfg`` under the co-resident model (every resident CTA slot
    streams: SPLIT_RULE_RESIDENT_CONTIGUOUS, as PAGED_SPLIT_RULE_RESIDENT for paged caches)."""
    from cuflash.families import decode_splitkv as mod

    old = mod.SPLIT_RULE_RESIDENT_CONTIGUOUS, mod.PAGED_SPLIT_RULE_RESIDENT
    mod.SPLIT_RULE_RESIDENT_CONTIGUOUS = mod.PAGED_SPLIT_RULE_RESIDENT = True
    try:
        return mod.num_splits_for(cfg, problem, sms)
    finally:
        mod.SPLIT_RULE_RESIDENT_CONTIGUOUS, mod.PAGED_SPLIT_RULE_RESIDENT = old


def parse_switches(text: str) -> dict:
    """'NAME=VALUE NAME=VALUE' -> {NAME: value} (ints, True / False), names from SWITCH_NAMES."""
    out = {}
    for item in text.split():
        name, _, value = item.partition("=")
        if name not in SWITCH_NAMES or not value:
            raise ValueError(f"--propose: {item!r} is not NAME=VALUE with NAME in {SWITCH_NAMES}")
        out[name] = {"true": True, "false": False}.get(value.lower(), None)
        if out[name] is None:
            out[name] = int(value)
    return out


def proposal_config(switches: dict, problem, page: int, arch=(9, 0), sms: int = 132):
    """The config flash_attn_with_kvcache would run for ``problem`` (caches of ``page`` keys per
    page) under the module switches ``switches``: the heuristic, then call_config, then the split
    count (shapes only, as cuflash.decode does)."""
    from cuflash.families import decode_splitkv as mod
    from cuflash.registry import get

    fam = get("decode_splitkv")
    old = {k: getattr(mod, k) for k in switches}
    try:
        for k, v in switches.items():
            setattr(mod, k, v)
        cfg = fam.heuristic(problem, arch)
        cfg = fam.call_config(cfg, problem, arch, page, chosen=True, heuristic=True)
        return cfg.replace(splits=mod.num_splits_for(cfg, problem, sms))
    finally:
        for k, v in old.items():
            setattr(mod, k, v)


def all_configs(cells, pages, arch=(9, 0), proposals=()) -> list:
    """Every kernel set the run compiles (splits 0: one module per tile set and option)."""
    from cuflash.problem import Problem

    out = []
    for name in cells:
        batch, ctx, rotate = CELLS[name]
        for page in pages:
            if rotate > 1 and page:
                continue
            p = Problem("decode", "bf16", batch, 1, ctx, HQ, HK, D, False, False,
                        ("paged_kv",) if page else ())
            base = base_config(p, arch)
            out.append(proposal_config({}, p, page, arch).replace(splits=0))
            out += [proposal_config(s, p, page, arch).replace(splits=0) for s in proposals]
            out += [cfg.replace(splits=0) for _, cfg, _ in candidates(base, batch, page, rotate > 1, ctx)]
    return list(dict.fromkeys(out))


def build_graph(f, est_us: float):
    """(graph, n): a CUDA graph of n calls of f (about TARGET_REPLAY_US a replay, 1..20)."""
    from cuflash.bench.decode import capture_graph

    n = max(1, min(20, round(TARGET_REPLAY_US / max(est_us, 1.0))))
    return capture_graph(f, n), n


def replay_us(graph, n: int, reps: int) -> float:
    """Median microseconds per call over ``reps`` replays of ``graph`` (n calls each)."""
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    times.sort()
    return times[len(times) // 2]


def profile_graph(graph, n: int) -> dict:
    """Kernel activity of one replay of ``graph`` (n calls) under torch.profiler (CUPTI):
    {kernels: [(short name, mean us per call, launches per call)], busy_us, span_us, gap_us}
    per call: the kernels' device time, the first start to the last end, and the idle time
    between consecutive kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not evs:
        return {}
    per: dict = {}
    for e in evs:
        name = e.name.split("<")[0].split("(")[0].replace("void ", "").replace("cuflash::", "")[-40:]
        d = per.setdefault(name, [0.0, 0])
        d[0] += e.time_range.end - e.time_range.start
        d[1] += 1
    busy = sum(e.time_range.end - e.time_range.start for e in evs)
    span = evs[-1].time_range.end - evs[0].time_range.start
    gaps = sum(max(0.0, b.time_range.start - a.time_range.end) for a, b in zip(evs, evs[1:]))
    return dict(kernels=[(k, v[0] / n, v[1] / n) for k, v in per.items()], busy_us=busy / n,
                span_us=span / n, gap_us=gaps / n)


def eager_us(f) -> float:
    """One eager call's time (after a warm-up call), to size the graph."""
    import torch

    f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


HEURISTIC = object()  # a record's check: compare with the heuristic's output


def _try(f):
    """f(), or None where it raises (the timing record of f says why)."""
    try:
        return f()
    except Exception:  # noqa: BLE001
        return None


def planned_config(keys):
    """The config of the plan made for the call-shape keys ``keys`` (the heuristic's first call of
    a cell), or None."""
    from cuflash import decode as decode_mod

    for k in keys:
        entry = decode_mod._gpu_plans.get(k)
        if entry is not None and entry.plan is not None:
            return entry.plan.config
    return None


class Cycle:
    """f() calls fns[0], fns[1], ... in turn (the cold cell's graph cycles over its caches)."""

    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def __call__(self):
        out = self.fns[self.i % len(self.fns)]()
        self.i += 1
        return out


def make_caches(batch, ctx, page, rotate, dt, gen):
    """``rotate`` (q, k_cache, v_cache, block_table) sets: contiguous (batch, ctx, hk, d) caches;
    paged ones view the same memory as (batch·ctx / page, page, hk, d) pages over a shuffled
    block table (so the page cells cost no extra memory)."""
    import torch

    sets = []
    for _ in range(rotate):
        kc = torch.randn(batch, ctx, HK, D, device="cuda", dtype=dt, generator=gen)
        vc = torch.randn_like(kc)
        q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=dt, generator=gen)
        table = None
        if page:
            blocks = ctx // page
            kc, vc = kc.view(batch * blocks, page, HK, D), vc.view(batch * blocks, page, HK, D)
            table = torch.randperm(batch * blocks, device="cuda", generator=gen).view(batch, blocks)
            table = table.to(torch.int32)
        sets.append((q, kc, vc, table))
    return sets


def sdpa_fn(impl, q, kc, vc):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from cuflash.bench.common import sdpa_backend

    backend = sdpa_backend(impl)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def f():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    return f


PROFILE_LABELS = ("sdpa_cudnn", "heuristic", "prop", "base", "em", "w4em_res", "w4em_x33", "w4n32em") + tuple(
    f"prop{i}" for i in range(2, 8))


def run_cell(name, page, reps, repeat, proposals, log, profile=False) -> list:
    import torch

    from cuflash import decode as decode_mod
    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config
    from cuflash.families.decode_splitkv import num_splits_for
    from cuflash.problem import Problem

    batch, ctx, rotate = CELLS[name]
    dt = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    problem = Problem("decode", "bf16", batch, 1, ctx, HQ, HK, D, False, False,
                      ("paged_kv",) if page else ())
    base = base_config(problem)
    kv_bytes = 2 * batch * ctx * HK * D * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = make_caches(batch, ctx, page, rotate, dt, gen)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    heur = [lambda q=q, kc=kc, vc=vc, t=t: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=t)
            for q, kc, vc, t in sets]
    before = set(decode_mod._gpu_plans)
    want = heur[0]()
    heur_cfg = planned_config([k for k in decode_mod._gpu_plans if k not in before])

    def forced(cfg, splits):
        if getattr(cfg, "stream", False):   # its CTA count (may pass flash-attn's 128-split limit) in the config
            cfg, splits = cfg.replace(splits=splits), 0
        return [lambda q=q, kc=kc, vc=vc, t=t: kvcache_with_config(
            cfg, q, kc, vc, cache_seqlens=seqlens, block_table=t, num_splits=splits) for q, kc, vc, t in sets]

    # (impl, label, config name, splits, fns, check)
    jobs = []
    cudnn_out = None
    if not page:
        for impl in ("sdpa_flash", "sdpa_cudnn"):
            fns = [sdpa_fn(impl, q, kc, vc) for q, kc, vc, _ in sets]
            jobs.append((impl, impl, "", "", fns, None))
            if impl == "sdpa_cudnn":
                cudnn_out = _try(fns[0])
    jobs.append(("cuflash", "heuristic", heur_cfg.name if heur_cfg else "?",
                 heur_cfg.splits if heur_cfg else "", heur,
                 cudnn_out if cudnn_out is not None else HEURISTIC))
    for i, switches in enumerate(proposals):
        cfg = proposal_config(switches, problem, page, sms=sms)
        jobs.append(("cuflash", "prop" if i == 0 else f"prop{i + 1}", cfg.name, cfg.splits,
                     forced(cfg, cfg.splits), HEURISTIC))
    for label, cfg, mults in candidates(base, batch, page, rotate > 1, ctx):
        rule = num_splits_for(cfg, problem, sms)
        choices = {}
        for m in mults:
            s = resident_splits(cfg, problem, sms) if m == "res" else max(1, min(128, round(rule * m)))
            choices.setdefault(s, label if s == rule else f"{label}_res" if m == "res" else f"{label}_x{s}")
        for s, job_label in choices.items():
            jobs.append(("cuflash", job_label, cfg.name, s, forced(cfg, s),
                         HEURISTIC))

    records, graphs = [], []
    for impl, label, config_name, splits, fns, check in jobs:
        rec = dict(cell=name, batch=batch, ctx=ctx, page_size=page, hq=HQ, hk=HK, d=D, impl=impl,
                   label=label, config=config_name, splits=splits, caches=rotate, times=[])
        try:
            got = fns[0]()
            got = got[0] if isinstance(got, tuple) else got
            ref = want if check is HEURISTIC else check
            if ref is not None:
                diff = (got.float() - ref.float()).abs().max().item()
                rec["max_diff"] = diff
                if not diff <= TOL:
                    rec["error"] = (f"BAD: max |O - reference| = {diff:.3g} "
                                    f"({'heuristic' if check is HEURISTIC else 'cuDNN'})")
            f = Cycle(fns) if len(fns) > 1 else fns[0]
            graphs.append(build_graph(f, eager_us(f)))
        except Exception as exc:  # noqa: BLE001 - the record says why
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            graphs.append(None)
        records.append(rec)
    from cuflash.timing import round_orders

    for order in round_orders(list(range(len(jobs))), repeat, "shuffle"):  # shuffled rounds
        for i in order:
            if graphs[i] is not None:
                try:
                    records[i]["times"].append(replay_us(*graphs[i], reps))
                except Exception as exc:  # noqa: BLE001
                    records[i]["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if profile and batch == 1 and not page:  # where the fixed costs weigh: kernel times and gaps
        for rec, g in zip(records, graphs):
            if g is not None and rec["label"] in PROFILE_LABELS:
                try:
                    rec["profile"] = profile_graph(*g)
                except Exception as exc:  # noqa: BLE001 - a diagnostic only
                    rec["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                pr = rec["profile"]
                if "kernels" in pr:
                    log(f"  profile {rec['label']:12s} per call: busy {pr['busy_us']:.1f} us, first-to-last "
                        f"{pr['span_us']:.1f}, gaps {pr['gap_us']:.1f}; "
                        + ", ".join(f"{k} {us:.1f} us x{c:g}" for k, us, c in pr["kernels"]))
                elif pr:
                    log(f"  profile {rec['label']:12s} {pr}")
    for rec in records:
        t = sorted(rec["times"])
        if t:
            rec.update(us=t[len(t) // 2], spread=t[-1] / t[0], kv_TBps=kv_bytes / (t[len(t) // 2] * 1e-6) / 1e12)
        else:
            rec.update(us=None, kv_TBps=None)
        log(f"  {rec['impl']:10s} {rec['label']:16s} {rec['config']:50s} x{rec['splits']!s:>4} "
            + (f"{rec['us']:9.1f} us {rec['kv_TBps']:5.2f} TB/s  spread {rec['spread']:.3f}" if rec.get("us") else "")
            + (f"  {rec['error']}" if rec.get("error") else ""))
    del graphs, sets, want
    torch.cuda.empty_cache()
    return records


def table(records: list) -> str:
    out = []
    for cell in dict.fromkeys((r["cell"], r["page_size"]) for r in records):
        recs = [r for r in records if (r["cell"], r["page_size"]) == cell]
        ref = {r["impl"]: r["us"] for r in records if r["cell"] == cell[0] and r.get("us")
               and r["impl"] in ("sdpa_flash", "sdpa_cudnn")}
        out.append(f"\n{cell[0]} page {cell[1] or '-'}"
                   + "".join(f"   {k} {v:.1f} us" for k, v in ref.items()))
        out.append(f"{'impl':10s} {'label':16s} {'config':50s} {'splits':>6s} {'us':>9s} {'TB/s':>6s}"
                   f" {'x flash':>8s} {'x cuDNN':>8s} {'spread':>7s}")
        for r in sorted(recs, key=lambda r: r.get("us") or float("inf")):
            if not r.get("us"):
                out.append(f"{r['impl']:10s} {r['label']:16s} {r['config']:50s} {r['splits']!s:>6s}  {r.get('error')}")
                continue
            ratio = [f"{ref[k] / r['us']:8.2f}" if k in ref else f"{'':8s}" for k in ("sdpa_flash", "sdpa_cudnn")]
            bad = "  " + r["error"] if r.get("error") else ""
            out.append(f"{r['impl']:10s} {r['label']:16s} {r['config']:50s} {r['splits']!s:>6s} {r['us']:9.1f} "
                       f"{r['kv_TBps']:6.2f} {ratio[0]} {ratio[1]} {r.get('spread', 1.0):7.3f}{bad}")
    return "\n".join(out)


def compact(records: list) -> str:
    """One line per cell: each record's label and us (fastest first; BAD / errors marked), the
    SDPA references first (``--compact``: the whole run fits a 12,000-character log tail)."""
    out = []
    for cell in dict.fromkeys((r["cell"], r["page_size"]) for r in records):
        recs = [r for r in records if (r["cell"], r["page_size"]) == cell]
        recs.sort(key=lambda r: (r["impl"] == "cuflash", r.get("us") or float("inf")))
        parts = []
        for r in recs:
            name = {"sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}.get(r["label"], r["label"])
            us = f"{r['us']:.1f}" if r.get("us") else "-"
            parts.append(f"{name} {us}" + ("!BAD" if str(r.get("error", "")).startswith("BAD") else
                                           "!ERR" if r.get("error") else ""))
        out.append(f"{cell[0]}/p{cell[1]}: " + ", ".join(parts))
    return "\n".join(out)


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(records: list) -> dict:
    """Per candidate label: over the warm cells where both it and ``base`` ran, the geometric mean
    of base's time over its own (> 1: faster), the worst and best cell, and the cells where it was
    the fastest cuflash record. Per proposal (``prop``, ``prop2``, ...): over the cells where its
    config differs from the heuristic's, the geometric mean of the heuristic's time over its own
    and the worst cell, for contiguous and paged cells apart, and the cold cell's ratio; ``flip``
    when every group gains >= 1% in the geometric mean and no cell (the cold one included) loses
    more than 2%. And per cell the proposals' and the heuristic's time over cuDNN's (contiguous)
    and over the same call's contiguous time (paged)."""
    ok = [r for r in records if r.get("us") and not r.get("error") and r.get("caches", 1) == 1]
    by_cell: dict = {}
    for r in ok:
        by_cell.setdefault((r["cell"], r["page_size"]), {})[r["label"]] = r["us"]
    labels = list(dict.fromkeys(r["label"] for r in ok if r["impl"] == "cuflash"))
    per_label = {}
    for label in labels:
        ratios = {f"{c[0]}/p{c[1]}": t["base"] / t[label] for c, t in by_cell.items()
                  if label in t and "base" in t}
        if not ratios:
            continue
        fastest = [f"{c[0]}/p{c[1]}" for c, t in by_cell.items()
                   if label in t and t[label] == min(v for k, v in t.items() if not k.startswith("sdpa"))]
        per_label[label] = dict(geomean=_geomean(ratios.values()),
                                worst=min(ratios.items(), key=lambda kv: kv[1]),
                                best=max(ratios.items(), key=lambda kv: kv[1]), cells=len(ratios),
                                fastest_in=fastest)

    configs = {(r["cell"], r["page_size"], r["label"]): r["config"] for r in records}
    cold = {r["label"]: r["us"] for r in records if r.get("caches", 1) > 1 and r.get("us") and not r.get("error")}
    proposals = {}
    for label in [x for x in labels if x.startswith("prop")]:
        groups, all_ratios = {}, []
        for name, pages in (("contiguous", (0,)), ("paged", (16, 256))):
            ratios = [t["heuristic"] / t[label] for c, t in by_cell.items()
                      if c[1] in pages and label in t and "heuristic" in t
                      and configs.get((c[0], c[1], label)) != configs.get((c[0], c[1], "heuristic"))]
            all_ratios += ratios
            groups[name] = dict(geomean=_geomean(ratios), worst=min(ratios), cells=len(ratios)) if ratios else None
        cold_ratio = cold["heuristic"] / cold[label] if label in cold and "heuristic" in cold else None
        worst = min(all_ratios + ([cold_ratio] if cold_ratio else []), default=None)
        flip = bool(all_ratios) and all(g is None or g["geomean"] >= 1.01 for g in groups.values()) \
            and worst is not None and worst >= 0.98
        proposals[label] = dict(groups, cold=cold_ratio, worst=worst, flip=flip)
    cells = {}
    for (cell, page), t in by_cell.items():
        flat = by_cell.get((cell, 0), {})
        row = {}
        for label in [x for x in t if x == "heuristic" or x.startswith("prop")]:
            if page == 0 and "sdpa_cudnn" in t:
                row[f"{label}_x_cudnn"] = t["sdpa_cudnn"] / t[label]
                row[f"{label}_x_flash"] = t["sdpa_flash"] / t[label] if "sdpa_flash" in t else None
            if page and label in flat:
                row[f"{label}_over_contiguous"] = t[label] / flat[label]
        cells[f"{cell}/p{page}"] = row
    return dict(per_label=per_label, proposals=proposals, cells=cells)


def print_summary(s: dict) -> str:
    out = ["\ncandidates vs base (geomean of base us / its us over warm cells; > 1 is faster):"]
    for label, v in sorted(s["per_label"].items(), key=lambda kv: -kv[1]["geomean"]):
        out.append(f"  {label:16s} {v['geomean']:6.3f}  worst {v['worst'][1]:.3f} ({v['worst'][0]})  "
                   f"best {v['best'][1]:.3f} ({v['best'][0]})  cells {v['cells']}  "
                   f"fastest in {', '.join(v['fastest_in']) or '-'}")
    out.append("proposals vs heuristic (heuristic us / its us over the cells where its config differs; "
               "FLIP: every group >= 1.01 and no cell, the cold one included, < 0.98):")
    for label, v in s.get("proposals", {}).items():
        parts = [f"{g} " + (f"{v[g]['geomean']:.3f} (worst {v[g]['worst']:.3f}, {v[g]['cells']} cells)"
                            if v[g] else "same config") for g in ("contiguous", "paged")]
        cold = f"cold {v['cold']:.3f}" if v["cold"] else "cold -"
        out.append(f"  {label:6s} {'FLIP' if v['flip'] else 'keep'}   " + "   ".join(parts) + f"   {cold}")
    out.append("per cell (x cuDNN: cuDNN us / its us, contiguous; paged: its us / its contiguous us):")
    for cell, row in s.get("cells", {}).items():
        if row:
            out.append(f"  {cell:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if v is not None))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for the raw records and the summary")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--pages", nargs="+", type=int, default=list(PAGES))
    ap.add_argument("--reps", type=int, default=7, help="graph replays per timing")
    ap.add_argument("--repeat", type=int, default=3, help="timings per record, in alternating order")
    ap.add_argument("--propose", action="append", default=[],
                    help="module switches 'NAME=VALUE ...' whose heuristic config is timed as prop, prop2, ...")
    ap.add_argument("--profile", action="store_true",
                    help="batch-1 contiguous cells: kernel times and gaps of one replay (torch.profiler)")
    ap.add_argument("--max-seconds", type=float, default=60.0,
                    help="start no new cell after this long (the kernels' compile included)")
    ap.add_argument("--processes", type=int, default=0, help="compile workers (0: one per kernel set)")
    ap.add_argument("--compact", action="store_true",
                    help="print one line per cell (label us, fastest first) instead of the per-record log and the tables")
    ap.add_argument("--no-candidates", action="store_true",
                    help="time the heuristic, the --propose sets and SDPA only (a short run)")
    ap.add_argument("--precompile", action="store_true", help="compile the kernels and stop")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip the parallel compile step (tests/decode_precompile.py ran already)")
    a = ap.parse_args()
    if not a.precompile and not a.out:
        ap.error("--out is required (or --precompile)")
    proposals = [parse_switches(p) for p in a.propose]
    if a.no_candidates:
        global CANDIDATES
        CANDIDATES = False
    t0 = time.time()
    import torch

    from cuflash import _gpu
    from cuflash.compile import precompile

    if not a.no_precompile:
        configs = all_configs(a.cells, a.pages, _gpu.arch(), proposals)
        res = precompile(configs, processes=a.processes or None)
        bad = [(c.name, e) for c, _, e in res if e]
        print(f"compiled {len(res)} kernel sets in {time.time() - t0:.1f} s"
              + "".join(f"\n  FAILED {n}: {e[:300]}" for n, e in bad), flush=True)
        if a.precompile:
            return 1 if bad else 0
    records, skipped = [], []
    for name in a.cells:
        for page in a.pages:
            if CELLS[name][2] > 1 and page:
                continue  # the cold cell: contiguous only
            if time.time() - t0 > a.max_seconds:
                skipped.append(f"{name}/p{page}")
                continue
            if not a.compact:
                print(f"{name} page {page or '-'} ({time.time() - t0:.0f} s)", flush=True)
            log = (lambda s: print(s, flush=True) if s.lstrip().startswith("profile") else None) \
                if a.compact else (lambda s: print(s, flush=True))
            records += run_cell(name, page, a.reps, a.repeat, proposals, log, a.profile)
    print(compact(records) if a.compact else table(records))
    s = summary(records)
    print(print_summary(s))
    if proposals:
        print("proposals: " + "; ".join(f"{'prop' if i == 0 else f'prop{i + 1}'}: {p}" for i, p in enumerate(proposals)))
    if skipped:
        print(f"\nskipped (past --max-seconds {a.max_seconds:.0f}): {', '.join(skipped)}")
    env = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, seconds=time.time() - t0,
               skipped=skipped, proposals=proposals)
    with open(a.out, "w") as fh:
        json.dump({"env": env, "records": records, "summary": s}, fh, indent=1, default=str)
    print(f"\nwrote {a.out} ({len(records)} records, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
