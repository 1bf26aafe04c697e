"""Batch-1 decode timing (issue 13): bf16, d 128, 32 query heads on 8 KV heads, one query row,
contiguous cache full; cells 1 x 8k / 32k / 64k / 128k (and 1x8k_cold: the graph cycles over 4
caches, 134 MB, so no call finds its K/V in the 50 MB L2), CUDA-graph timing. In one process, per
cell: SDPA flash and cuDNN on views of the same cache, ``heuristic`` (flash_attn_with_kvcache as
users call it) and every ``--variant``:

    --variant "LABEL TOKEN TOKEN ..."   tokens:
        NAME=VALUE   upper case: a decode_splitkv module switch (REGS_DEFAULT=0: the older loop),
                     applied before the heuristic and call_config pick the config;
        field=VALUE  lower case: a DecodeConfig field replaced in that config (regs=1, warps=4,
                     fused_combine=0, ...);
        splits=N     forced split count (xsplits=F: F times the config's rule);
        intlens=1    cache_seqlens passed as an int (no per-batch tensor read before the loads).
    --switch NAME=VALUE   a module switch for the whole process, the heuristic's record included.

The impls of a cell share its cache, so one's L2 cache hints change what the others find in L2
(session 24, dec15: the default's evict-first loads ran 13.3-14.4 us at 1 x 8k right after a plain-load
or evict-last variant, 15.4-16.2 after SDPA or among themselves): compare load hints (regs) in
separate processes (--switch REGS_DEFAULT=N), not as variants of one.

Each record's graph (n calls, about 2 ms a replay) is captured once; the cell's graphs then
replay ``--repeat`` times in shuffled order (cuflash.timing.round_orders), ``--reps`` replays
each; ``us`` is the median of the repeats' medians. Outputs are compared with SDPA cuDNN's
(max |diff| <= 1.6e-2; ``BAD`` otherwise). ``--profile``: one replay of each graph under
torch.profiler (per call: kernels' device time, first start to last end, idle gaps).
``--ncu``: instead of timing, 3 calls per record (the third inside a profiler range) of each
cell, for ``ncu --profile-from-start off``. Not a test:

    python tests/decode_b1_timing.py --precompile --variant "old REGS_DEFAULT=0"
    python tests/decode_b1_timing.py --no-precompile --out t.json --variant "old REGS_DEFAULT=0"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_tma_timing as dt  # noqa: E402  (its caches, graphs and replay timing)

dt.CELLS.setdefault("1x16k", (1, 16384, 1))   # between the rule's 8k and the measured 32k
dt.CELLS.setdefault("1x4k", (1, 4096, 1))
dt.CELLS.setdefault("8x64k", (8, 65536, 1))
dt.CELLS.setdefault("32x64k", (32, 65536, 1))   # issue 13's batch-32 row
dt.CELLS.setdefault("64x64k", (64, 65536, 1))
dt.CELLS.setdefault("32x16k", (32, 16384, 1))
dt.CELLS.setdefault("64x16k", (64, 16384, 1))
dt.CELLS.setdefault("32x4k", (32, 4096, 1))
dt.CELLS.setdefault("64x4k", (64, 4096, 1))
CELLS = ("1x8k", "1x32k", "1x64k", "1x128k")
TOL = 1.6e-2


def parse_variant(text: str) -> dict:
    """'LABEL TOKEN ...' -> {label, switches, fields, splits, xsplits, intlens}."""
    from cuflash.families.decode_splitkv import DecodeConfig

    label, *tokens = text.split()
    out = dict(label=label, switches={}, fields={}, splits=0, xsplits=0.0, intlens=False)
    fields = set(DecodeConfig.__dataclass_fields__)
    for tok in tokens:
        name, _, value = tok.partition("=")
        if not value:
            raise ValueError(f"--variant {text!r}: {tok!r} is not NAME=VALUE")
        v = {"true": 1, "false": 0}.get(value.lower(), None)
        if name == "splits":
            out["splits"] = int(value)
        elif name == "xsplits":
            out["xsplits"] = float(value)
        elif name == "intlens":
            out["intlens"] = bool(int(value))
        elif name.isupper():
            out["switches"][name] = int(value) if v is None else bool(v)
        elif name in fields:
            cur = getattr(DecodeConfig, name, None)
            out["fields"][name] = (bool(int(value)) if isinstance(cur, bool) else int(value)) if v is None else v
        else:
            raise ValueError(f"--variant {text!r}: {name!r} is neither a switch, a DecodeConfig field, "
                             "splits, xsplits nor intlens")
    return out


def variant_config(var: dict, problem, sms: int = 132):
    """(config with its split count) a variant runs for ``problem``."""
    from cuflash.families import decode_splitkv as mod

    cfg = dt.proposal_config(var["switches"], problem, 0, sms=sms)
    if var["fields"]:
        cfg = cfg.replace(**var["fields"])
        cfg = cfg.replace(splits=0)
        cfg = cfg.replace(splits=mod.num_splits_for(cfg, problem, sms))
    if var["xsplits"]:
        cfg = cfg.replace(splits=max(1, min(128, round(cfg.splits * var["xsplits"]))))
    if var["splits"]:
        cfg = cfg.replace(splits=var["splits"])
    return cfg


def problem_for(cell: str):
    from cuflash.problem import Problem

    batch, ctx, _ = dt.CELLS[cell]
    return Problem("decode", "bf16", batch, 1, ctx, dt.HQ, dt.HK, dt.D, False, False, ())


def all_configs(cells, variants) -> list:
    """Every config the cells' records load, with the cluster-pair kernel the heuristic's 2-split call switches
    to (DecodeSplitKV.pair_cluster, decided per call: else it compiles inside the timing)."""
    from cuflash.registry import get

    fam = get("decode_splitkv")
    out = []
    for cell in cells:
        p = problem_for(cell)
        heur = dt.proposal_config({}, p, 0)   # the heuristic record's call may pair it; a variant's config call does not
        out += [heur.replace(splits=0), fam.pair_cluster(heur, p, heur.splits).replace(splits=0)]
        device = device_config(p)             # this GPU's choice (its tuned table's device rules)
        if device is not None:
            out.append(device.replace(splits=0))
        out += [variant_config(v, p).replace(splits=0) for v in variants]
    return list(dict.fromkeys(out))


def device_config(problem):
    """The config flash_attn_with_kvcache runs for ``problem`` on GPU 0 (cuflash.decode.call_config: the tuned
    table's device rules, the split count, the pair), or None without a GPU."""
    from cuflash import _gpu

    if not _gpu.available():
        return None
    from cuflash.decode import call_config

    return call_config(problem, 0, 0, 0)[1]


def jobs_for(cell, variants, sets, seqlens, sms):
    """(label, config name, splits, [fn per cache set], check against cuDNN)."""
    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config

    batch, ctx, _ = dt.CELLS[cell]
    p = problem_for(cell)
    jobs = [(impl, "", "", [dt.sdpa_fn(impl, q, kc, vc) for q, kc, vc, _ in sets]) for impl in ("sdpa_flash", "sdpa_cudnn")]
    heur_cfg = device_config(p) or dt.proposal_config({}, p, 0, sms=sms)   # as the call runs it (device rules)
    jobs.append(("heuristic", heur_cfg.name, heur_cfg.splits,
                 [lambda q=q, kc=kc, vc=vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
                  for q, kc, vc, _ in sets]))
    for v in variants:
        cfg = variant_config(v, p, sms)
        lens = ctx if v["intlens"] else seqlens
        jobs.append((v["label"], cfg.name, cfg.splits,
                     [lambda q=q, kc=kc, vc=vc, cfg=cfg, lens=lens: kvcache_with_config(
                         cfg, q, kc, vc, cache_seqlens=lens)[0] for q, kc, vc, _ in sets]))
    return jobs


def checked_graph(rec, f, graph_f, ref):
    """f's output against ref into rec (max_diff; error BAD past TOL), and the CUDA graph of graph_f
    (dt.build_graph: (graph, n)); None where either raised (rec's error says why)."""
    try:
        got = f()
        got = got[0] if isinstance(got, tuple) else got
        diff = (got.float() - ref.float()).abs().max().item()
        rec["max_diff"] = diff
        if not diff <= TOL:
            rec["error"] = f"BAD: max |O - cuDNN| = {diff:.3g}"
        return dt.build_graph(graph_f, dt.eager_us(graph_f))
    except Exception as exc:  # noqa: BLE001 - the record says why
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return None


def time_rounds(records, graphs, rounds, reps) -> None:
    """Each record's graph replayed ``reps`` times per round, the records in a new shuffled order each
    of ``rounds`` rounds (cuflash.timing.round_orders); each round's median appended to its times."""
    from cuflash.timing import round_orders

    for order in round_orders(list(range(len(records))), rounds, "shuffle"):
        for i in order:
            if graphs[i] is not None:
                records[i]["times"].append(dt.replay_us(*graphs[i], reps))


def summarize(records, kv_bytes) -> dict:
    """Each timed record's us (the median of its rounds' medians), spread (slowest round / fastest),
    kv_TBps and x_cudnn / x_flash (the SDPA records' us over its own); returns {label: us}."""
    for rec in records:
        t = sorted(rec["times"])
        if t:
            rec.update(us=t[len(t) // 2], spread=t[-1] / t[0], kv_TBps=kv_bytes / (t[len(t) // 2] * 1e-6) / 1e12)
    by = {r["label"]: r.get("us") for r in records}
    for rec in records:
        if rec.get("us"):
            rec["x_cudnn"] = by["sdpa_cudnn"] / rec["us"] if by.get("sdpa_cudnn") else None
            rec["x_flash"] = by["sdpa_flash"] / rec["us"] if by.get("sdpa_flash") else None
    return by


def run_cell(cell, variants, reps, repeat, profile, log) -> list:
    import torch

    batch, ctx, rotate = dt.CELLS[cell]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = dt.make_caches(batch, ctx, 0, rotate, torch.bfloat16, gen)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * ctx * dt.HK * dt.D * 2
    jobs = jobs_for(cell, variants, sets, seqlens, sms)
    ref = jobs[1][3][0]()
    records, graphs = [], []
    for label, cfg_name, splits, fns in jobs:
        rec = dict(cell=cell, label=label, config=cfg_name, splits=splits, times=[])
        graphs.append(checked_graph(rec, fns[0], dt.Cycle(fns) if len(fns) > 1 else fns[0], ref))
        records.append(rec)
    time_rounds(records, graphs, repeat, reps)
    if profile:
        for rec, g in zip(records, graphs):
            if g is None:
                continue
            try:
                pr = dt.profile_graph(*g)
                rec["profile"] = pr
                log(f"  profile {cell} {rec['label']:12s} busy {pr['busy_us']:.1f} us, span {pr['span_us']:.1f}, gaps "
                    f"{pr['gap_us']:.1f}; " + ", ".join(f"{k} {us:.2f} us x{c:g}" for k, us, c in pr["kernels"]))
            except Exception as exc:  # noqa: BLE001 - a diagnostic only
                log(f"  profile {rec['label']}: {type(exc).__name__}: {str(exc)[:120]}")
    summarize(records, kv_bytes)
    del graphs, sets
    torch.cuda.empty_cache()
    return records


def record_line(r, head: str, mid: str = "") -> str:
    """One record: ``head`` (its label ...), us, TB/s, x cuDNN, x flash, ``mid``, spread, config, error."""
    if not r.get("us"):
        return f"  {head} {r.get('error')}"
    return (f"  {head} {r['us']:8.2f} us {r['kv_TBps']:5.2f} TB/s  xcuDNN {r['x_cudnn'] or 0:5.3f} xflash "
            f"{r['x_flash'] or 0:5.3f}{mid}  sp {r['spread']:.3f}  {r['config']}"
            + (f"  {r['error']}" if r.get("error") else ""))


def show(records) -> str:
    out = []
    for cell in dict.fromkeys(r["cell"] for r in records):
        recs = sorted((r for r in records if r["cell"] == cell), key=lambda r: r.get("us") or 1e9)
        out.append(f"{cell}:")
        out += [record_line(r, f"{r['label']:14s}", f"  x{r['splits']!s:>3}") for r in recs]
    return "\n".join(out)


def ncu_probe(cell, variants):
    """3 calls per record of ``cell`` (the third in a profiler range: ncu --profile-from-start off)."""
    import torch

    batch, ctx, _ = dt.CELLS[cell]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = dt.make_caches(batch, ctx, 0, 1, torch.bfloat16, gen)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    for label, cfg_name, splits, fns in jobs_for(cell, variants, sets, seqlens, sms):
        for i in range(3):
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.start()
            fns[0]()
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.profiler.stop()
        print(f"profiled {cell} {label} {cfg_name} x{splits}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(dt.CELLS))
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--max-seconds", type=float, default=90.0)
    ap.add_argument("--out")
    ap.add_argument("--switch", action="append", default=[],
                    help="NAME=VALUE: a decode_splitkv module switch for the whole process (the heuristic's "
                         "record too), e.g. REGS_DEFAULT=1: one hint per process, no other's L2 state")
    a = ap.parse_args()
    if a.switch:
        from cuflash.families import decode_splitkv as mod

        for name, value in parse_variant("switches " + " ".join(a.switch))["switches"].items():
            if not hasattr(mod, name):
                raise ValueError(f"--switch {name}: no such decode_splitkv module switch")
            setattr(mod, name, value)
    variants = [parse_variant(v) for v in a.variant]
    t0 = time.time()
    if a.precompile or not a.no_precompile:
        from cuflash.compile import precompile

        res = precompile(all_configs(a.cells, variants), processes=a.processes)
        bad = [(c.name, e) for c, _, e in res if e]
        print(f"compiled {len(res)} kernel sets in {time.time() - t0:.1f} s"
              + "".join(f"\n  FAILED {n}: {e[:400]}" for n, e in bad), flush=True)
        if a.precompile:
            return 1 if bad else 0
    if a.ncu:
        for cell in a.cells:
            ncu_probe(cell, variants)
        return 0
    import torch

    records = []
    for cell in a.cells:
        if time.time() - t0 > a.max_seconds:
            print(f"skipped {cell} (past --max-seconds)")
            continue
        try:
            records += run_cell(cell, variants, a.reps, a.repeat, a.profile, lambda s: print(s, flush=True))
        except Exception as exc:  # noqa: BLE001 - the other cells still run
            print(f"{cell}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"{torch.cuda.get_device_name(0)}")
    print(show(records))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(0), "variants": a.variant, "records": records}, fh,
                      indent=1, default=str)
    print(f"done {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
