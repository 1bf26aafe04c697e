"""Issue 13, one batch row x CTX keys: why ``bench --mode decode`` and the timing scripts disagree on
cuflash / SDPA cuDNN (session 28). Not a test; one process, one cache (1 x ctx, bf16, d 128, 32:8 heads,
full), every impl reading the same bytes:

  impls  cuflash (as users call it: cache_seqlens a tensor), cf_intlens (cache_seqlens an int: no device
         read before the loads), sdpa_cudnn, sdpa_flash, cf_page16 / cf_page256 (the bench's paged views);
  graphs of N calls per impl, N in --calls (default 1 20 100);
  procedures, all in shuffled rounds (cuflash.timing.round_orders) with every replay kept as
  (impl, N, round, place in its block, impl replayed before):
    bench    the bench's: the 5 impls at N 20, 2 replays per block (``us``: the median of all replays);
    b1       decode_b1_timing's: cuflash, flash, cuDNN at N 20, 7 replays per block (``us``: the median
             of the rounds' medians);
    calls    cuflash, cf_intlens, cuDNN at every N, 7 replays per block: per call at N 1 (a lone call in
             a graph), and the slope between the largest two N (the back-to-back per-call time without
             the replay's fixed cost);
  then cuflash.bench.decode.run itself twice (the bench as the CLI runs it).
Per procedure and impl: the median, the first replay of a block against the later ones, the first replay
by the impl before it, and per round the ratio cuDNN / cuflash (spread over rounds). nvidia-smi's SM clock
and temperature before and after each procedure.

    python tests/decode_harness_gap.py --precompile
    python tests/decode_harness_gap.py --ctx 8192 --rounds 9 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def med(xs):
    return statistics.median(xs) if xs else None


def smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"nvidia-smi: {type(exc).__name__}"


def configs(ctxs) -> list:
    """The heuristic's kernel sets for the cells (contiguous, pages 16 and 256)."""
    from cuflash.problem import Problem
    from cuflash.registry import get

    fam = get("decode_splitkv")
    out = []
    for ctx in ctxs:
        for page in (0, 16, 256):
            p = Problem("decode", "bf16", 1, 1, ctx, 32, 8, 128, False, False, ("paged_kv",) if page else ())
            out.append(fam.call_config(fam.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True,
                                       heuristic=True).replace(splits=0))
    return list(dict.fromkeys(out))


def replay(graph, n) -> float:
    import torch

    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def procedure(graphs: dict, keys: list, rounds: int, per_block: int) -> list:
    """[(impl, n, round, place, key before, us per call)] over shuffled rounds of ``keys`` ((impl, n))."""
    from cuflash.timing import round_orders

    out, prev = [], None
    for r, order in enumerate(round_orders(keys, rounds, "shuffle")):
        for key in order:
            for i in range(per_block):
                out.append((key[0], key[1], r, i, prev, replay(graphs[key], key[1])))
            prev = f"{key[0]}@{key[1]}"
    return out


def summarize(samples, rounds) -> dict:
    out = {}
    for key in dict.fromkeys((x[0], x[1]) for x in samples):
        xs = [x for x in samples if (x[0], x[1]) == key]
        per_round = [med([x[5] for x in xs if x[2] == r]) for r in range(rounds)]
        out[f"{key[0]}@{key[1]}"] = dict(
            us=med([x[5] for x in xs]), us_rounds=med([u for u in per_round if u]), rounds=per_round,
            first=med([x[5] for x in xs if x[3] == 0]), later=med([x[5] for x in xs if x[3] > 0]),
            min=min(x[5] for x in xs), max=max(x[5] for x in xs), n=len(xs),
            after={p: med([x[5] for x in xs if x[3] == 0 and x[4] == p]) for p in dict.fromkeys(x[4] for x in xs if x[3] == 0)})
    return out


def ratio_line(s, a, b, n) -> str:
    ka, kb = f"{a}@{n}", f"{b}@{n}"
    if ka not in s or kb not in s:
        return ""
    rs = [y / x for x, y in zip(s[ka]["rounds"], s[kb]["rounds"]) if x and y]
    return (f"    {b}/{a} at N {n}: all-replay median {s[kb]['us'] / s[ka]['us']:.3f}, rounds' medians "
            f"{s[kb]['us_rounds'] / s[ka]['us_rounds']:.3f}; per round min {min(rs):.3f} med {med(rs):.3f} max {max(rs):.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[8192])
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 20, 100])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.time()
    if a.precompile:
        from cuflash.compile import precompile

        res = precompile(configs(a.ctx), processes=8)
        print("precompiled " + ", ".join(c.name + (f" FAILED {e[:200]}" if e else "") for c, _, e in res), flush=True)
        return 0
    import torch

    from cuflash.bench import decode as bd
    from cuflash.decode import flash_attn_with_kvcache

    res = {"gpu": torch.cuda.get_device_name(0), "cells": {}}
    print(res["gpu"], smi(), flush=True)
    for ctx in a.ctx:
        cell = res["cells"][ctx] = {"procedures": {}, "clocks": [smi()]}
        dt = torch.bfloat16
        q = torch.randn(1, 1, bd.HQ, bd.D, device="cuda", dtype=dt)
        seqlens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        kc, vc, _ = bd._cache(1, ctx, 0, dt)
        fns = {"cuflash": bd._fn("cuflash", q, kc, vc, None, seqlens),
               "cf_intlens": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=ctx),
               "sdpa_cudnn": bd._fn("sdpa_cudnn", q, kc, vc, None, seqlens),
               "sdpa_flash": bd._fn("sdpa_flash", q, kc, vc, None, seqlens)}
        for page in (16, 256):
            pk, pv, table = bd.paged_view(kc, vc, page)
            fns[f"cf_page{page}"] = bd._fn(f"cuflash_page{page}", q, pk, pv, table, seqlens)
        ref = fns["sdpa_cudnn"]().transpose(1, 2).float()
        for name, f in fns.items():
            got = f()
            got = (got[0] if isinstance(got, tuple) else got)
            got = got.transpose(1, 2) if name.startswith("sdpa") else got
            print(f"  {name}: max |O - cuDNN| {(got.float() - ref).abs().max().item():.3g}", flush=True)
        graphs = {}
        ns = sorted(set(a.calls) | {20})
        for name, f in fns.items():
            for n in ns:
                if n != 20 and name not in ("cuflash", "cf_intlens", "sdpa_cudnn"):
                    continue
                graphs[(name, n)] = bd.capture_graph(f, n)
        print(f"ctx {ctx}: {len(graphs)} graphs [{time.time() - t0:.0f} s]", flush=True)
        five = [(k, 20) for k in ("cuflash", "sdpa_flash", "sdpa_cudnn", "cf_page16", "cf_page256")]
        procs = {"bench": (five, 2 * a.rounds, 2), "b1": (five[:3], a.rounds, 7),
                 "calls": ([(k, n) for k in ("cuflash", "cf_intlens", "sdpa_cudnn") for n in ns], a.rounds, 7)}
        for pname, (keys, rounds, per) in procs.items():
            samples = procedure(graphs, keys, rounds, per)
            s = summarize(samples, rounds)
            cell["procedures"][pname] = dict(summary=s, samples=samples)
            cell["clocks"].append(smi())
            print(f"1 x {ctx} {pname} ({rounds} rounds x {per} replays per block) [{time.time() - t0:.0f} s] "
                  f"clock {cell['clocks'][-1]}", flush=True)
            for k, v in s.items():
                print(f"  {k:16s} {v['us']:7.2f} us (rounds' medians {v['us_rounds']:7.2f}; first {v['first']:.2f}, "
                      f"later {v['later'] if v['later'] is None else round(v['later'], 2)}, min {v['min']:.2f}, "
                      f"max {v['max']:.2f}, n {v['n']})", flush=True)
            for n in ns:
                for b in ("cuflash", "cf_intlens", "cf_page16", "cf_page256"):
                    line = ratio_line(s, "sdpa_cudnn", b, n)
                    if line:
                        print(line.replace(f"{b}/sdpa_cudnn", f"{b}/cuDNN"), flush=True)
            if "cuflash@20" in s:
                print("    cuflash@20's first replay by the impl before it: " + ", ".join(
                    f"{p}: {u:.2f}" for p, u in s["cuflash@20"]["after"].items() if u), flush=True)
                print("    sdpa_cudnn@20's first replay by the impl before it: " + ", ".join(
                    f"{p}: {u:.2f}" for p, u in s["sdpa_cudnn@20"]["after"].items() if u), flush=True)
            if pname == "calls" and len(ns) >= 2:
                n1, n2 = ns[-2], ns[-1]
                for k in ("cuflash", "cf_intlens", "sdpa_cudnn"):
                    t1, t2 = s[f"{k}@{n1}"]["us_rounds"] * n1, s[f"{k}@{n2}"]["us_rounds"] * n2
                    slope = (t2 - t1) / (n2 - n1)
                    cell.setdefault("slope", {})[k] = slope
                    print(f"  {k:16s} per call back to back (slope N {n1}..{n2}) {slope:.2f} us, fixed cost per replay "
                          f"{t1 - slope * n1:.2f} us; a lone call (N {ns[0]}) {s[f'{k}@{ns[0]}']['us_rounds']:.2f}",
                          flush=True)
                if "sdpa_cudnn" in cell.get("slope", {}):
                    print(f"    slope cuDNN/cuflash {cell['slope']['sdpa_cudnn'] / cell['slope']['cuflash']:.3f}, "
                          f"cuDNN/intlens {cell['slope']['sdpa_cudnn'] / cell['slope']['cf_intlens']:.3f}", flush=True)
        del graphs, kc, vc
        torch.cuda.empty_cache()
    if not a.no_bench:
        tmp = tempfile.mkdtemp()
        for rep in range(2):
            recs = bd.run(batches=(1,), ctxs=tuple(a.ctx), reps=10, out=tmp, rounds=5, log=lambda s: None)
            res[f"bench_run{rep}"] = [(r["ctx"], r["impl"], r.get("us")) for r in recs]
            print(f"bench.run {rep}: " + ", ".join(f"{c} {i} {u:.2f}" for c, i, u in res[f"bench_run{rep}"] if u),
                  flush=True)
    print(f"done [{time.time() - t0:.0f} s]", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
