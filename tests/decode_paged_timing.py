"""Paged against contiguous decode (issue 13), in one process: bf16, d 128, 32 query heads on 8 KV
heads, one query row, the cache full; per cell (batch x context) SDPA flash and cuDNN, cuflash on
the contiguous cache (``cuflash``, as users call it) and on paged views of the same memory
(``page16``, ``page256``: the bench's shuffled block tables, cuflash.bench.decode.paged_view), and
every ``--variant``, all by CUDA-graph replay in shuffled rounds (cuflash.timing.round_orders):

    --variant "LABEL PAGE TOKEN ..."   PAGE: 0 (contiguous) or a page size; tokens:
        field=VALUE   a DecodeConfig field replaced in the config the call runs (regs_page_table=1,
                      regs_prefetch=1, warps=4, ...); splits=N forces N splits (else the split rule's);
                      table=sorted: the page's table in order (page j of a row at physical page j: the
                      bytes laid out as the contiguous cache's, still read through the table)
    --switch NAME=VALUE   a decode_splitkv module switch for the whole process (every record)

Every impl of a cell reads the same bytes, so one load hint per process (the L2 state one leaves
is what the next finds: session 24, dec15); the variants here keep the heuristic's hint. ``us``:
the median over rounds of each round's median replay; ``spread``: the slowest round's over the
fastest's. Outputs are checked against SDPA cuDNN (max |diff| <= 1.6e-2). Not a test:

    python tests/decode_paged_timing.py --precompile --variant "rpt 16 regs_page_table=1"
    python tests/decode_paged_timing.py --no-precompile --cells 1x8k --variant "rpt 16 regs_page_table=1"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_b1_timing as b1  # noqa: E402  (checked graphs, shuffled rounds)
import decode_tma_timing as dt  # noqa: E402  (graphs, replay timing, SDPA impls)

CELLS = {"1x4k": (1, 4096), "1x8k": (1, 8192), "1x16k": (1, 16384), "1x32k": (1, 32768), "1x64k": (1, 65536), "1x128k": (1, 131072),
         "2x32k": (2, 32768), "4x16k": (4, 16384), "8x8k": (8, 8192), "8x32k": (8, 32768), "8x128k": (8, 131072),
         "16x8k": (16, 8192), "32x8k": (32, 8192), "32x32k": (32, 32768), "64x8k": (64, 8192)}
PAGES = (16, 256)


def parse_variant(text: str) -> dict:
    """'LABEL PAGE field=VALUE ...' -> {label, page, fields, splits}."""
    from cuflash.families.decode_splitkv import DecodeConfig

    label, page, *tokens = text.split()
    out = dict(label=label, page=int(page), fields={}, splits=0, sorted=False)
    for tok in tokens:
        name, _, value = tok.partition("=")
        if name == "splits":
            out["splits"] = int(value)
        elif name == "table" and value in ("sorted", "shuffled"):
            out["sorted"] = value == "sorted"
        elif name in DecodeConfig.__dataclass_fields__:
            cur = getattr(DecodeConfig, name, None)
            out["fields"][name] = bool(int(value)) if isinstance(cur, bool) else int(value)
        else:
            raise ValueError(f"--variant {text!r}: {tok!r} is neither a DecodeConfig field=VALUE nor splits=N")
    return out


def problem_for(batch, ctx, page):
    from cuflash.problem import Problem

    return Problem("decode", "bf16", batch, 1, ctx, dt.HQ, dt.HK, dt.D, False, False, ("paged_kv",) if page else ())


def variant_config(var, batch, ctx, sms=132):
    """The config (with its split count) a variant runs: the call's config with its fields."""
    from cuflash.families import decode_splitkv as mod

    p = problem_for(batch, ctx, var["page"])
    cfg = dt.proposal_config({}, p, var["page"], sms=sms)
    if var["fields"]:
        cfg = cfg.replace(**var["fields"], splits=0)
        cfg = cfg.replace(splits=mod.num_splits_for(cfg, p, sms))
    return cfg.replace(splits=var["splits"]) if var["splits"] else cfg


def all_configs(cells, pages, variants) -> list:
    out = []
    for cell in cells:
        batch, ctx = CELLS[cell]
        for page in (0,) + tuple(pages):
            out.append(dt.proposal_config({}, problem_for(batch, ctx, page), page).replace(splits=0))
        out += [variant_config(v, batch, ctx).replace(splits=0) for v in variants if v["page"] in (0,) + tuple(pages)]
    return list(dict.fromkeys(out))


def run_cell(cell, pages, variants, reps, rounds, log, fill=1.0) -> list:
    import torch

    from cuflash.bench.decode import paged_view
    from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config

    batch, ctx = CELLS[cell]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kc, vc, _ = dt.make_caches(batch, ctx, 0, 1, torch.bfloat16, gen)[0]
    keys = max(1, int(ctx * fill))   # --fill: rows of fewer keys than the capacity (the SDPA impls see them all)
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    caches = {0: (kc, vc, None)}
    for page in pages:
        caches[page] = paged_view(kc, vc, page, gen)
    jobs = [(impl, 0, "", dt.sdpa_fn(impl, q, kc, vc)) for impl in ("sdpa_flash", "sdpa_cudnn")]
    for page in (0,) + tuple(pages):
        ck, cv, table = caches[page]
        cfg = dt.proposal_config({}, problem_for(batch, ctx, page), page, sms=sms)
        jobs.append(("cuflash" if not page else f"page{page}", page, f"{cfg.name} x{cfg.splits}",
                     lambda ck=ck, cv=cv, table=table: flash_attn_with_kvcache(q, ck, cv, cache_seqlens=seqlens,
                                                                             block_table=table)))
    for v in variants:
        if v["page"] and v.get("sorted"):   # the table in order: physical page j holds logical page j
            ck, cv, table = caches.get(v["page"], (None, None, None))
            if table is None:
                continue
            blocks = table.shape[1]
            table = (torch.arange(blocks, device=table.device)[None, :]
                     + torch.arange(batch, device=table.device)[:, None] * blocks).to(torch.int32)
        elif v["page"] not in caches:
            continue
        else:
            ck, cv, table = caches[v["page"]]
        cfg = variant_config(v, batch, ctx, sms)
        jobs.append((v["label"], v["page"], f"{cfg.name} x{cfg.splits}",
                     lambda ck=ck, cv=cv, table=table, cfg=cfg: kvcache_with_config(
                         cfg, q, ck, cv, cache_seqlens=seqlens, block_table=table)[0]))
    ref = jobs[1][3]() if fill == 1.0 else jobs[2][3]()   # partial rows: against cuflash's contiguous call
    records, graphs = [], []
    for label, page, cfg_name, f in jobs:
        rec = dict(cell=cell, label=label, page=page, config=cfg_name, times=[], fill=fill)
        graphs.append(b1.checked_graph(rec, f, f, ref))
        records.append(rec)
    b1.time_rounds(records, graphs, rounds, reps)
    by = b1.summarize(records, 2 * batch * keys * dt.HK * dt.D * 2)
    for rec in records:
        if rec.get("us"):
            rec["x_contig"] = rec["us"] / by["cuflash"] if by.get("cuflash") and rec["page"] else None
    del graphs, caches, kc, vc
    torch.cuda.empty_cache()
    return records


def show(records) -> str:
    out = []
    for cell in dict.fromkeys(r["cell"] for r in records):
        out.append(f"{cell}:")
        for r in sorted((r for r in records if r["cell"] == cell), key=lambda r: (r["page"], r.get("us") or 1e9)):
            xc = f"x contig {r['x_contig']:.3f}" if r.get("x_contig") else " " * 14
            out.append(b1.record_line(r, f"{r['label']:12s} p{r['page']:<4d}", f"  {xc}"))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["1x8k", "1x32k"], choices=list(CELLS))
    ap.add_argument("--pages", nargs="*", type=int, default=list(PAGES))
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--switch", action="append", default=[], help="NAME=VALUE: a decode_splitkv module switch")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--processes", type=int, default=14)
    ap.add_argument("--max-seconds", type=float, default=90.0)
    ap.add_argument("--fill", type=float, default=1.0,
                    help="cache_seqlens = fill x the capacity (SDPA reads the whole capacity: compare cuflash only)")
    ap.add_argument("--out")
    a = ap.parse_args()
    from cuflash.families import decode_splitkv as mod

    for sw in a.switch:
        name, _, value = sw.partition("=")
        if not hasattr(mod, name):
            raise ValueError(f"--switch {name}: no such decode_splitkv module switch")
        setattr(mod, name, type(getattr(mod, name))(int(value)))
    variants = [parse_variant(v) for v in a.variant]
    t0 = time.time()
    if a.precompile or not a.no_precompile:
        from cuflash.compile import precompile

        res = precompile(all_configs(a.cells, a.pages, variants), processes=a.processes)
        bad = [(c.name, e) for c, _, e in res if e]
        print(f"compiled {len(res)} kernel sets in {time.time() - t0:.1f} s"
              + "".join(f"\n  FAILED {n}: {e[:400]}" for n, e in bad), flush=True)
        if a.precompile:
            return 1 if bad else 0
    import torch

    records = []
    for cell in a.cells:
        if time.time() - t0 > a.max_seconds:
            print(f"skipped {cell} (past --max-seconds)", flush=True)
            continue
        try:
            records += run_cell(cell, a.pages, variants, a.reps, a.rounds, lambda s: print(s, flush=True), a.fill)
        except Exception as exc:  # noqa: BLE001 - the other cells still run
            print(f"{cell}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        print(show([r for r in records if r["cell"] == cell]), flush=True)
    print(torch.cuda.get_device_name(0))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(0), "variants": a.variant, "switches": a.switch,
                       "records": records}, fh, indent=1, default=str)
    print(f"done {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
