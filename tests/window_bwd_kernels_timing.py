"""Where the window backward's fixed cost goes (issue 12: a window's backward pays ~0.17 ms that does not
shrink with the band), per kernel on an H100: the preprocess (D = rowsum(dO o O)), the main kernel and
the dQ convert (torch.profiler / CUPTI GPU times, mean over reps), and each backward's wall time (CUDA
events, interleaved), for the plain call (selection's backward) and the window's backward variants:

  heuristic  the window heuristic's backward (dq_first, wide_epi, dynamic; three launches)
  dqc        + dq_convert (the dQ convert inside the main kernel, at the grid's end)
  dqt        + dq_tail (session 31: the dQ convert a programmatic dependent of the main kernel, converting the
             pairs done on the SMs the grid's end leaves idle; its kernel time includes its waits)
  dqt0       without dq_tail (the heuristic's where it sets it: sm90_bwd WINDOW_DQ_TAIL)
  dqt2       + dq_tail 2 (the writer counts a tile behind the next tile's first Q block: no wait at the boundary)
  plain_dqt2 the plain call's backward (selection's) + dq_tail 2
  (session 23 also timed cve, convert_early: dq_convert's jobs by ticket at the dynamic loop's tile
  boundaries, on wip/win5 at 2ef362d: slower, not merged)

Columns: ms (CUDA events, interleaved with the other rows), prof ms (CUDA events over reps calls right after
the profiled ones: the same clocks as the kernel times, so that prof ms - sum is the launches' gaps and not a
clock difference between two runs),
x visible (ms over the plain call's, over the window's visible share), the kernels' GPU us, their sum.

Shape: bf16, d128, batch 2 x 16 heads x 8k (bench --mode features'), window (1024, 0) causal and
(1024, 1024) full, and at --widths the causal band's (L, 0) to fit ms = a + b x visits per variant.
Not a test:

    timeout 120 python tests/window_bwd_kernels_timing.py --out $RES/bwdk.json
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 8192, 16, 128
VARIANTS = {"heuristic": {}, "dqc": dict(dq_convert=True), "dqt": dict(dq_tail=1), "dqt2": dict(dq_tail=2),
            "dqt0": dict(dq_tail=0)}


def problem(causal, window=None):
    p = Problem("bwd", "bf16", BATCH, SEQLEN, SEQLEN, HEADS, HEADS, HEAD_DIM, causal)
    return p.replace(features=("window",), window=window) if window else p


def configs(variants=None):
    """{(mask, variant): (causal, window, config)}: the window variants (VARIANTS, or those named) and the
    plain call's backward (and plain_dqt2 when dqt2 is named)."""
    from cuflash import _gpu, select

    fam = registry.get("sm90_bwd")
    out = {}
    for causal, window in ((True, (1024, 0)), (False, (1024, 1024))):
        mask = "causal" if causal else "full"
        p = problem(causal, window)
        heur = fam.for_problem(fam.heuristic(p), p)
        for key, kw in VARIANTS.items():
            if variants and key not in variants:
                continue
            cfg = fam.for_problem(heur.replace(**kw), p)
            if not cfg.problems() and (key == "heuristic" or cfg != heur):
                out[(mask, key)] = (causal, window, cfg)
        plain = select.choose(problem(causal), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]
        out[(mask, "plain")] = (causal, None, plain)
        if plain.family == "sm90_bwd" and (not variants or "dqt2" in variants):
            pdqt = fam.for_problem(plain.replace(dq_tail=2), problem(causal))
            if pdqt.dq_tail and not pdqt.problems():
                out[(mask, "plain_dqt2")] = (causal, None, pdqt)
    return out


def role(name):
    if "preprocess" in name:
        return "pre"
    if "convert" in name or "dq_tail" in name:
        return "convert"
    if "sm90_bwd<" in name or "fa2_bwd<" in name:
        return "main"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", default="", help="comma-separated VARIANTS keys (default: all)")
    ap.add_argument("--no-precompile", action="store_true", help="the kernels are compiled already")
    args = ap.parse_args()

    import torch

    import cuflash
    from cuflash.band import visible_fraction
    from cuflash.compile import precompile
    from cuflash.timing import time_interleaved

    cfgs = configs(tuple(v for v in args.variants.split(",") if v))
    failed = [] if args.no_precompile else [(c.name, e) for c, _, e in precompile([c for _, _, c in cfgs.values()])
                                            if e]
    print("failed compiles:", failed, flush=True)
    rows = []
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for mask in ("causal", "full"):
        fns, outs = {}, {}
        for (m, key), (causal, window, cfg) in cfgs.items():
            if m != mask or any(cfg.name == n for n, _ in failed):
                continue
            kw = dict(causal=causal, window_size=window) if window else dict(causal=causal)
            o = cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw)
            outs[key] = o
            fns[key] = (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        # per-kernel times (sm90_bwd_pre_timing's profiler loop), by role
        from sm90_bwd_pre_timing import kernel_times

        per, prof_ms = {}, {}
        for key, fn in fns.items():
            t = {}
            for name, us in kernel_times(fn, args.reps).items():
                t[role(name)] = round(t.get(role(name), 0.0) + us, 1)
            # right after the profiled calls (the same clocks): reps calls back to back under CUDA events
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            per[key], prof_ms[key] = t, start.elapsed_time(end) / args.reps
        wall = time_interleaved(fns, reps=20)
        plain_ms = wall["plain"].median_ms if "plain" in wall else None
        causal = mask == "causal"
        vis = visible_fraction(SEQLEN, SEQLEN, causal, (1024, 0) if causal else (1024, 1024))
        # the dQ of each variant against the heuristic's (bulk additions in any order: not bit for bit)
        ref = fns["heuristic"]() if "heuristic" in fns else None
        for key in fns:
            ms = wall[key].median_ms
            row = {"mask": mask, "variant": key, "config": cfgs[(mask, key)][2].name, "ms": round(ms, 4),
                   "prof_ms": round(prof_ms[key], 4),
                   "us_by_kernel": per[key], "sum_us": round(sum(per[key].values()), 1)}
            if plain_ms and key != "plain":
                row["x_visible"] = round(ms / plain_ms / vis, 4)
            if ref is not None and key != "plain":
                got = fns[key]()
                row["dq_rel"] = ((got[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()).item()
                row["dkdv_equal"] = bool(torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'mask':<7} {'variant':<10} {'ms':>8} {'prof ms':>8} {'x vis':>7} {'pre us':>7} {'main us':>8} "
          f"{'conv us':>8} {'sum us':>7} {'prof - sum':>10}")
    for r in rows:
        k = r["us_by_kernel"]
        print(f"{r['mask']:<7} {r['variant']:<10} {r['ms']:>8.4f} {r['prof_ms']:>8.4f} {r.get('x_visible', 0):>7.3f} "
              f"{k.get('pre', 0):>7.1f} {k.get('main', 0):>8.1f} {k.get('convert', 0):>8.1f} {r['sum_us']:>7.1f} "
              f"{r['prof_ms'] * 1000 - r['sum_us']:>10.1f}")
    return rows


if __name__ == "__main__":
    _args = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else ""
    _rows = main()
    if _args:
        open(_args, "w").write(json.dumps(_rows, indent=1))
