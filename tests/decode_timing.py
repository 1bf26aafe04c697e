"""Decode timing for picking decode_splitkv's heuristic from one H100 run (issue 13): per
batch x context cell (bf16, d 128, 32 query heads on 8 KV heads, one query row, the cache full),
CUDA-graph timing (cuflash.bench.decode.time_graph: a graph of 20 calls, the median replay / 20)
of

  * ``heuristic``: flash_attn_with_kvcache as users call it (today's heuristic config and splits);
  * forced configs (``kvcache_with_config``) at their split rule's count (``num_splits_for``) and,
    for some, at half and twice that (``--set``):
    - ``tma`` (default): the heuristic's tiles on the cp.async loop (``base``) next to the Hopper
      loop (``tma_*``: a producer warp streams K/V by TMA into an mbarrier ring) at ring depths
      3 and 2 with 8 warps (128-key blocks, 1 CTA per SM), 6 with 4 warps (64-key blocks), and 3
      with 4 warps (64-key blocks, 2 CTAs per SM), contiguous and paged;
    - ``old``: the earlier options (fused combine ``_fc``, 4 warps x 2 or 3 stages, page-id
      prefetch ``_pp``);
    - ``all``: both;
  * SDPA flash and cuDNN on the same cache (contiguous cells).

Every cuflash variant's output is first compared with the heuristic's (max |diff|, bf16: should be
<= 1.6e-2; a broken variant shows as ``BAD``). Prints one table per cell, fastest first, with
K+V TB/s and the ratio to SDPA flash and cuDNN; writes every record as JSON to --out:

    timeout 300 python tests/decode_timing.py --out /tmp/decode_timing.json
    python tests/decode_timing.py --cells 1x8k 1x32k --pages 16 --out t.json   # a subset

Not a test (no assertions); the lead reads the table. Runs in about 2-3 minutes on an H100 with
the default set, most of it compiling the 5 forced kernel sets (``--set all``: 9).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash import registry  # noqa: E402
from cuflash.bench.decode import D, HK, HQ, _cache, _fn, time_graph  # noqa: E402
from cuflash.decode import flash_attn_with_kvcache, kvcache_with_config  # noqa: E402
from cuflash.families.decode_splitkv import num_splits_for  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

CELLS = {"1x8k": (1, 8192), "1x32k": (1, 32768), "1x64k": (1, 65536), "1x128k": (1, 131072),
         "8x32k": (8, 32768), "32x8k": (32, 8192), "64x32k": (64, 32768)}
PAGED_CELLS = ("1x32k", "32x8k")
TOL = 1.6e-2  # bf16 outputs of |O| <~ 1: a couple of ulps


def variants(base, paged: bool, which: str = "tma") -> list:
    """(label, config, split multipliers) of the forced configs to time (see the docstring)."""
    out = []
    if which in ("tma", "all"):
        tma = base.replace(tma=True)
        if paged:
            out += [("base", base, (1,)), ("tma_w8s3", tma, (1, 2)), ("tma_w4s6", tma.replace(warps=4, stages=6), (1,)),
                    ("tma_w4s3", tma.replace(warps=4, stages=3), (1,))]
        else:
            out += [("base", base, (0.5, 1, 2)), ("tma_w8s3", tma, (0.5, 1, 2)),
                    ("tma_w8s2", tma.replace(stages=2), (1,)), ("tma_w4s6", tma.replace(warps=4, stages=6), (1, 2)),
                    ("tma_w4s3", tma.replace(warps=4, stages=3), (1, 2))]
    if which in ("old", "all"):
        out += [v for v in _old_variants(base, paged) if which == "old" or v[0] != "base"]
    return out


def _old_variants(base, paged: bool) -> list:
    fc = dict(fused_combine=True)
    if paged:
        return [("base", base, (1,)), ("base_pp", base.replace(page_prefetch=True), (1,)),
                ("base_fc", base.replace(**fc), (1,)),
                ("base_fc_pp", base.replace(page_prefetch=True, **fc), (1,))]
    return [("base", base, (0.5, 1, 2)), ("base_fc", base.replace(**fc), (0.5, 1, 2)),
            ("w4s2", base.replace(warps=4, stages=2), (1,)),
            ("w4s2_fc", base.replace(warps=4, stages=2, **fc), (1, 2)),
            ("w4s3_fc", base.replace(warps=4, stages=3, **fc), (1,))]


def run_cell(name, batch, ctx, page, reps, log, which="tma") -> list:
    dt = torch.bfloat16
    fam = registry.get("decode_splitkv")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    problem = Problem("decode", "bf16", batch, 1, ctx, HQ, HK, D, False, False,
                      ("paged_kv",) if page else ())
    base = fam.heuristic(problem).replace(page_prefetch=False, fused_combine=False, tma=False)
    kv_bytes = 2 * batch * ctx * HK * D * 2
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=dt)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    kc, vc, table = _cache(batch, ctx, page, dt)
    args = dict(cache_seqlens=seqlens, block_table=table)
    want = flash_attn_with_kvcache(q, kc, vc, **args)
    records = []

    def one(impl, config_name, splits, f):
        rec = dict(cell=name, batch=batch, ctx=ctx, page_size=page or 0, hq=HQ, hk=HK, d=D,
                   impl=impl, config=config_name, splits=splits)
        try:
            if impl.startswith("cuflash"):
                got = f()
                got = got[0] if isinstance(got, tuple) else got     # kvcache_with_config: (out, lse)
                diff = (got.float() - want.float()).abs().max().item()
                rec["max_diff"] = diff
                if not diff <= TOL:
                    rec["error"] = f"BAD: max |O - heuristic's| = {diff:.3g}"
            us = time_graph(f, reps)
            rec.update(us=us, kv_TBps=kv_bytes / (us * 1e-6) / 1e12)
        except Exception as exc:  # noqa: BLE001 - the record says why
            rec.update(us=None, kv_TBps=None, error=f"{type(exc).__name__}: {str(exc)[:160]}")
        records.append(rec)
        log(f"  {impl:10s} {config_name:44s} x{splits!s:>4}  "
            + (f"{rec['us']:8.1f} us {rec['kv_TBps']:5.2f} TB/s" if rec.get("us") else "")
            + (f"  {rec['error']}" if rec.get("error") else ""))

    if not page:
        for impl in ("sdpa_flash", "sdpa_cudnn"):
            one(impl, "", "", _fn(impl, q, kc, vc, None, seqlens))
    heur_splits = num_splits_for(fam.heuristic(problem), problem, sms)
    one("cuflash", "heuristic", heur_splits, lambda: flash_attn_with_kvcache(q, kc, vc, **args))
    for label, cfg, mults in variants(base, bool(page), which):
        rule = num_splits_for(cfg, problem, sms)
        done = set()
        for mult in mults:
            s = max(1, min(128, round(rule * mult)))
            if s in done:
                continue
            done.add(s)
            one("cuflash", f"{label}:{cfg.name}", s,
                lambda cfg=cfg, s=s: kvcache_with_config(cfg, q, kc, vc, num_splits=s, **args))
    del kc, vc, table
    torch.cuda.empty_cache()
    return records


def table(records: list) -> str:
    out = []
    for cell in dict.fromkeys((r["cell"], r["page_size"]) for r in records):
        recs = [r for r in records if (r["cell"], r["page_size"]) == cell]
        ref = {r["impl"]: r["us"] for r in records
               if r["cell"] == cell[0] and r["impl"].startswith("sdpa") and r.get("us")}
        out.append(f"\n{cell[0]} page {cell[1] or '-'}"
                   + "".join(f"   {k} {v:.1f} us" for k, v in ref.items()))
        out.append(f"{'impl':10s} {'config':44s} {'splits':>6s} {'us':>8s} {'TB/s':>6s}"
                   f" {'x flash':>8s} {'x cuDNN':>8s}")
        for r in sorted(recs, key=lambda r: r.get("us") or float("inf")):
            if not r.get("us"):
                out.append(f"{r['impl']:10s} {r['config']:44s} {r['splits']!s:>6s}  {r.get('error')}")
                continue
            ratio = [f"{ref[k] / r['us']:8.2f}" if k in ref else f"{'':8s}"
                     for k in ("sdpa_flash", "sdpa_cudnn")]
            bad = "  " + r["error"] if r.get("error") else ""
            out.append(f"{r['impl']:10s} {r['config']:44s} {r['splits']!s:>6s} {r['us']:8.1f} "
                       f"{r['kv_TBps']:6.2f} {ratio[0]} {ratio[1]}{bad}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the raw records")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--pages", nargs="*", type=int, default=[16, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--set", default="tma", choices=("tma", "old", "all"), dest="which",
                    help="which forced configs to time (default: the cp.async loop vs the Hopper loop)")
    a = ap.parse_args()
    t0 = time.time()
    records = []
    for name in a.cells:
        batch, ctx = CELLS[name]
        for page in [0] + ([p for p in a.pages] if name in PAGED_CELLS else []):
            print(f"{name} page {page or '-'} ({time.time() - t0:.0f} s)", flush=True)
            records += run_cell(name, batch, ctx, page, a.reps, lambda s: print(s, flush=True), a.which)
    print(table(records))
    env = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, seconds=time.time() - t0)
    with open(a.out, "w") as fh:
        json.dump({"env": env, "records": records}, fh, indent=1)
    print(f"\nwrote {a.out} ({len(records)} records, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
