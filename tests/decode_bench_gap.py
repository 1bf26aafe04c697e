"""Issue 13, batch 1 x 8k keys: why ``bench --mode decode`` puts cuflash at ~16 us and
tests/decode_b1_timing.py at ~13.5 us on the same cell while SDPA cuDNN gets ~12 us in both.
Not a test; one process:

1. the two scripts as they are (cuflash.bench.decode.run and decode_b1_timing.run_cell), twice in
   turn, and what each cuflash call shape's plan runs (config, splits, counters' streams);
2. one set of CUDA graphs (20 calls each) over one cache, timed under several procedures, every
   sample kept with its impl, its place in its block of replays and the impl replayed before it:
     bench      the bench's: 5 impls (cuflash, SDPA flash, cuDNN, pages 16 and 256 viewing the same
                memory) in shuffled rounds, 2 replays per impl per round;
     bench3     the same without the paged impls;
     bench7     the 5 impls, 7 replays per impl per round (the batch-1 timing's block);
     b1         the batch-1 timing's: cuflash, flash, cuDNN, 7 replays per impl per round;
   and cuflash variants in the bench procedure: load hints (plain loads regs 1, evict-last regs 7,
   the default evict-first regs 6), an int cache_seqlens, the separate combine launch.

    python tests/decode_bench_gap.py --precompile    (compile only; --precompile-bench: the bench's batch-1 sets)
    python tests/decode_bench_gap.py --bench 4096 8192 [--switch REGS_BATCH1=0]   (the bench's cells only)
    python tests/decode_bench_gap.py --json out.json
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]


def med(xs):
    return statistics.median(xs) if xs else None


def procedure(graphs: dict, rounds: int, per_block: int, calls: int, seed_names=None) -> list:
    """[(impl, round, place in block, impl before, us)] over shuffled rounds."""
    import torch

    from cuflash.timing import round_orders

    names = list(graphs) if seed_names is None else seed_names
    out, prev = [], None
    for r, order in enumerate(round_orders(names, rounds, "shuffle")):
        for name in order:
            for i in range(per_block):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graphs[name].replay()
                e.record()
                e.synchronize()
                out.append((name, r, i, prev, s.elapsed_time(e) * 1e3 / calls))
            prev = name
    return out


def summarize(samples) -> dict:
    out = {}
    for name in dict.fromkeys(x[0] for x in samples):
        xs = [x for x in samples if x[0] == name]
        out[name] = dict(us=med([x[4] for x in xs]), first=med([x[4] for x in xs if x[2] == 0]),
                         later=med([x[4] for x in xs if x[2] > 0]), min=min(x[4] for x in xs),
                         max=max(x[4] for x in xs), n=len(xs),
                         after={p: med([x[4] for x in xs if x[2] == 0 and x[3] == p])
                                for p in dict.fromkeys(x[3] for x in xs if x[2] == 0)})
    return out


def configs() -> list:
    """The kernel sets this script runs (for --precompile): the heuristic's at 1 x 8k, contiguous and
    pages 16 / 256, and the cuflash variants."""
    from cuflash.families import decode_splitkv as mod
    from cuflash.problem import Problem
    from cuflash.registry import get

    fam = get("decode_splitkv")
    out = []
    for switches in ({}, {"REGS_BATCH1": False}, {"REGS_PAGED_TMA_MAX_KEYS": 0}):   # --bench's processes
        old = {k: getattr(mod, k) for k in switches}
        for k, v in switches.items():
            setattr(mod, k, v)
        try:
            for ctx in (4096, 8192):
                for page in (0, 16, 256):
                    p = Problem("decode", "bf16", 1, 1, ctx, 32, 8, 128, False, False, ("paged_kv",) if page else ())
                    cfg = fam.call_config(fam.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True, heuristic=True)
                    out.append(cfg.replace(splits=0))
        finally:
            for k, v in old.items():
                setattr(mod, k, v)
    heur = [c for c in out if c.regs == 6][0]   # the evict-first default of section 2
    out += [heur.replace(regs=1), heur.replace(regs=7), heur.replace(fused_combine=False, light_fence=False)]
    if mod.REGS_CLUSTER_VALUES:
        out.append(heur.replace(regs_cluster=16, fused_combine=False, light_fence=False))
    return list(dict.fromkeys(out))


def bench_only():
    """--bench CTX ... [--switch NAME=VALUE ...]: the bench's batch-1 cells (cuflash.bench.decode.run,
    its 5 impls on one cache, 10 rounds of 2 replays each) twice, under decode_splitkv module switches
    set for the whole process (one load hint per process: no other hint's L2 state)."""
    import torch

    from cuflash.bench import decode as bd
    from cuflash.families import decode_splitkv as mod

    ctxs = [int(x) for x in sys.argv[sys.argv.index("--bench") + 1:] if x.isdigit()]
    for i, arg in enumerate(sys.argv):
        if arg == "--switch":
            name, _, value = sys.argv[i + 1].partition("=")
            if not hasattr(mod, name):
                raise ValueError(f"--switch {name}: no such decode_splitkv module switch")
            setattr(mod, name, int(value))
    print(torch.cuda.get_device_name(0), "switches", [a for a in sys.argv if "=" in a], flush=True)
    tmp = tempfile.mkdtemp()
    for rep in range(2):
        for r in bd.run(batches=(1,), ctxs=ctxs, reps=20, out=tmp, rounds=10, log=lambda s: None):
            print(f"run {rep} 1 x {r['ctx']:6d} {r['impl']:16s} {r['us'] or 0:7.2f} us", flush=True)
    return 0


def bench_configs(batches=(1,)) -> list:
    """The kernel sets of ``bench --mode decode --decode-batches <batches>`` (its contexts, contiguous
    and pages 16 / 256), for --precompile-bench."""
    from cuflash.bench import decode as bd
    from cuflash.problem import Problem
    from cuflash.registry import get

    fam = get("decode_splitkv")
    out = []
    for b in batches:
        for ctx in bd.CTXS:
            for page in (0, 16, 256):
                p = Problem("decode", "bf16", b, 1, ctx, bd.HQ, bd.HK, bd.D, False, False, ("paged_kv",) if page else ())
                out.append(fam.call_config(fam.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True,
                                           heuristic=True).replace(splits=0))
    return list(dict.fromkeys(out))


def main():
    if "--bench" in sys.argv:
        return bench_only()
    if "--precompile" in sys.argv or "--precompile-bench" in sys.argv:
        from cuflash.compile import precompile

        res = precompile(bench_configs() if "--precompile-bench" in sys.argv else configs(), processes=8)
        print("precompiled " + ", ".join(c.name + (f" FAILED {e[:200]}" if e else "") for c, _, e in res), flush=True)
        return 0
    import torch

    import decode_b1_timing as b1
    from cuflash import decode
    from cuflash.bench import decode as bd
    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config
    from cuflash.families import decode_splitkv as mod

    res = {"gpu": torch.cuda.get_device_name(0)}
    t0 = time.time()
    # 1. the scripts as they are
    tmp = tempfile.mkdtemp()
    for rep in range(2):
        recs = bd.run(batches=(1,), ctxs=(8192,), reps=10, out=tmp, rounds=5, log=lambda s: None)
        res[f"bench_run{rep}"] = {r["impl"]: r.get("us") for r in recs}
        print(f"bench run {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in res[f"bench_run{rep}"].items() if v), flush=True)
        recs = b1.run_cell("1x8k", [], 7, 5, False, lambda s: None)
        res[f"b1_run{rep}"] = {r["label"]: r.get("us") for r in recs}
        print(f"b1 run {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in res[f"b1_run{rep}"].items() if v), flush=True)
    res["plans"] = []
    for e in decode._gpu_plans.values():
        if e.plan is None:
            continue
        c = e.plan.config
        sc = e.plan.counters.get("split_counters")
        res["plans"].append(dict(config=c.name, splits=c.splits, fused=c.fused_combine, launches=[
            (s.role, s.grid, s.threads) for s in e.plan.launches], counter_streams=len(sc.buffers) if sc else 0))
    for p in res["plans"]:
        print("plan", p, flush=True)
    print(f"[{time.time() - t0:.0f} s]", flush=True)

    # 2. one set of graphs, several procedures
    dt = torch.bfloat16
    calls = bd.GRAPH_CALLS
    q = torch.randn(1, 1, bd.HQ, bd.D, device="cuda", dtype=dt)
    seqlens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    kc, vc, _ = bd._cache(1, 8192, 0, dt)
    fns = {impl: bd._fn(impl, q, kc, vc, None, seqlens) for impl in ("cuflash", "sdpa_flash", "sdpa_cudnn")}
    for page in (16, 256):
        pk, pv, table = bd.paged_view(kc, vc, page)
        fns[f"cuflash_page{page}"] = bd._fn(f"cuflash_page{page}", q, pk, pv, table, seqlens)
    heur = next(e.plan.config for e in decode._gpu_plans.values()
                if e.plan is not None and e.plan.problem.seqlen_k == 8192 and e.plan.problem.batch == 1
                and "paged_kv" not in e.plan.problem.features)
    res["heuristic"] = heur.name
    variants = {"cf_regs1": heur.replace(regs=1), "cf_regs7": heur.replace(regs=7),
                "cf_nofuse": heur.replace(fused_combine=False, light_fence=False)}
    for name, cfg in variants.items():
        fns[name] = lambda cfg=cfg: kvcache_with_config(cfg, q, kc, vc, cache_seqlens=seqlens)[0]
    fns["cf_intlens"] = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8192)
    if mod.REGS_CLUSTER_VALUES:
        cl = heur.replace(regs_cluster=16, fused_combine=False, light_fence=False, splits=0)
        fns["cf_cluster16"] = lambda: kvcache_with_config(cl, q, kc, vc, cache_seqlens=seqlens)[0]
    graphs = {}
    for name, f in fns.items():
        try:
            graphs[name] = bd.capture_graph(f, calls)
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    print(f"graphs {list(graphs)} [{time.time() - t0:.0f} s]", flush=True)
    five = [n for n in ("cuflash", "sdpa_flash", "sdpa_cudnn", "cuflash_page16", "cuflash_page256") if n in graphs]
    three = five[:3]
    procs = {"bench": (five, 20, 2), "bench3": (three, 20, 2), "bench7": (five, 8, 7), "b1": (three, 8, 7),
             "variants": ([n for n in graphs if n.startswith("cf_")] + five, 12, 2)}
    res["procedures"] = {}
    for pname, (names, rounds, per) in procs.items():
        samples = procedure(graphs, rounds, per, calls, names)
        s = summarize(samples)
        res["procedures"][pname] = dict(summary=s, samples=samples)
        print(f"{pname}: " + "; ".join(f"{k} {v['us']:.2f} (first {v['first']:.2f}, later "
                                       f"{v['later'] if v['later'] is None else round(v['later'], 2)}, "
                                       f"min {v['min']:.2f}, max {v['max']:.2f})" for k, v in s.items()), flush=True)
        if "cuflash" in s:
            print(f"  cuflash's first replay by the impl before it: "
                  + ", ".join(f"{p}: {u:.2f}" for p, u in s["cuflash"]["after"].items() if u), flush=True)
    print(f"done [{time.time() - t0:.0f} s]", flush=True)
    if "--json" in sys.argv:
        from cuflash.bench.common import write_json

        write_json(Path(sys.argv[sys.argv.index("--json") + 1]), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
