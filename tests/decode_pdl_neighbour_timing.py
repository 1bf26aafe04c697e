"""Decode next to a non-PDL neighbour (issue 13, session 26 dec17): in a real model a decode call's stream
neighbours are projections (torch GEMMs), not other decode calls, so a PDL launch finds a predecessor that
never triggers early. CUDA graphs of n = 20 steps, bf16, d 128, 32:8 heads, contiguous cache full, per cell:

    alone      [decode] x n                      (the back-to-back graph of decode_b1_timing.py)
    proj       [x (batch, 4096) @ W (4096, 4096), decode] x n     (a decode step's projection: W is 32 MB)
    gemm       [A (4096, 4096) @ B (4096, 4096), decode] x n      (a large GEMM)
and the neighbours alone ([proj] x n, [gemm] x n); decode's share of a step = step - neighbour alone. Impls in
one process: SDPA cuDNN, SDPA flash, cuflash (heuristic, pdl as the module's rule gives), cuflash with pdl
0 / 1 / 2 forced, and each --variant (decode_b1_timing.py's: a config's fields replaced). Graphs replayed in shuffled rounds (cuflash.timing.round_orders), median of the rounds'
medians. Not a test:

    python tests/decode_pdl_neighbour_timing.py --cells 1x8k 8x32k --out t.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_tma_timing as dt  # noqa: E402

dt.CELLS.setdefault("1x16k", (1, 16384, 1))
dt.CELLS.setdefault("1x4k", (1, 4096, 1))
N = 20


def main():
    import torch

    from cuflash.bench.decode import capture_graph
    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config
    from cuflash.problem import Problem
    from cuflash.timing import round_orders

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["1x8k", "8x32k"], choices=list(dt.CELLS))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pdl", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--neighbours", nargs="+", default=["alone", "proj", "gemm"])
    ap.add_argument("--variant", action="append", default=[],
                    help="'LABEL field=value ...': a config as decode_b1_timing.py's --variant makes it, one more impl")
    ap.add_argument("--out")
    a = ap.parse_args()
    records = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cell in a.cells:
        batch, ctx, _ = dt.CELLS[cell]
        (q, kc, vc, _), = dt.make_caches(batch, ctx, 0, 1, torch.bfloat16, gen)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        p = Problem("decode", "bf16", batch, 1, ctx, dt.HQ, dt.HK, dt.D, False, False, ())
        base = dt.proposal_config({}, p, 0)
        impls = {"sdpa_cudnn": dt.sdpa_fn("sdpa_cudnn", q, kc, vc), "sdpa_flash": dt.sdpa_fn("sdpa_flash", q, kc, vc),
                 "cuflash": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)}
        for pdl in a.pdl:
            cfg = base.replace(pdl=pdl)
            impls[f"pdl{pdl}"] = (lambda cfg=cfg: kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens)[0])
        for text in a.variant:   # decode_b1_timing.py's variants (fields, switches, splits)
            import decode_b1_timing as b1

            var = b1.parse_variant(text)
            cfg = b1.variant_config(var, p)
            impls[var["label"]] = (lambda cfg=cfg: kvcache_with_config(cfg, q, kc, vc, cache_seqlens=lens)[0])
        x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        ga, gb = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        neighbours = {"alone": None, "proj": lambda: torch.matmul(x, w), "gemm": lambda: torch.matmul(ga, gb)}
        graphs, recs = [], []

        def add(label, neighbour, fn):
            def step():
                if neighbour is not None:
                    neighbour()
                if fn is not None:
                    fn()
            try:
                step()
                torch.cuda.synchronize()
                graphs.append(capture_graph(step, N))
                recs.append(dict(cell=cell, label=label, times=[]))
            except Exception as exc:  # noqa: BLE001 - the record says why
                print(f"{cell} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)

        for nb in a.neighbours:
            if nb != "alone":
                add(f"{nb}_only", neighbours[nb], None)
            for name, fn in impls.items():
                add(f"{nb}+{name}", neighbours[nb], fn)
        for order in round_orders(list(range(len(graphs))), a.repeat, "shuffle"):
            for i in order:
                recs[i]["times"].append(dt.replay_us(graphs[i], N, a.reps))
        by = {}
        for r in recs:
            t = sorted(r["times"])
            r["us"] = t[len(t) // 2]
            by[r["label"]] = r["us"]
        for r in recs:
            nb = r["label"].split("+")[0]
            if "+" in r["label"] and nb != "alone":
                r["decode_share_us"] = r["us"] - by[f"{nb}_only"]
            elif "+" in r["label"]:
                r["decode_share_us"] = r["us"]
        records += recs
        print(f"{cell} (config {base.name}, x{base.splits}), us per step (decode's share = step - neighbour alone):")
        for nb in a.neighbours:
            if nb != "alone":
                print(f"  {nb}_only {by.get(f'{nb}_only', float('nan')):9.2f}")
            for r in recs:
                if r["label"].startswith(nb + "+"):
                    share = r["decode_share_us"]
                    cud = next((x["decode_share_us"] for x in recs if x["label"] == f"{nb}+sdpa_cudnn"), None)
                    print(f"  {r['label']:18s} step {r['us']:9.2f}  decode {share:8.2f}"
                          + (f"  x cuDNN {cud / share:5.3f}" if cud and share > 0 else "")
                          + f"  spread {max(r['times']) / min(r['times']):.3f}")
        del graphs
        torch.cuda.empty_cache()
    print(torch.cuda.get_device_name(0))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(0), "n": N, "records": records}, fh, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done {time.time() - t0:.0f} s")
