"""Timing of sm90_bwd at the short seqlens on an H100 (issue 14: >= 1.0x SDPA cuDNN in every cell seqlen
>= 2k; the three cells below were 2k: bf16 / fp16 d128 non-causal, bf16 d256 causal): per case the
heuristic's kernel ("heur") and the candidates of session 17 next to SDPA cuDNN (and flash with --flash),
in one process, bf16 and fp16, head dims 64 / 128 / 256 (and 192, run by the d256 kernel: --hdims 192),
2k and 4k, causal and not, dim 2048 (heads = 2048 / d), batch x seqlen = 16k; the backward alone
(torch.autograd.grad of one forward's output, retain_graph; SDPA the same way), back-to-back samples of
10 calls in an order rotated per sample (sm90_bwd_d128_timing.time_rotated), median. Candidates:

    dqc      dq_convert (kDqConvert): the dQ convert inside the main kernel (jobs of 256 rows, queued by a
             pair's last tile, taken by the CTAs whose tiles are done) instead of fa2_bwd_convert_dq's launch
             (head dim 128 with the dynamic scheduler; 256 / 192 with roles)
    nodqc    the heuristic's kernel without dq_convert, where the heuristic has it (HEURISTIC_DQ_CONVERT)
    static   head dim 128: the plain grid (one CTA per K/V block) instead of the dynamic scheduler
    split    head dims 192 / 256: the query split (dq_writer, no roles), the kernel before roles
    dqf      dq_first (kDqFirst, session 18): the preprocess does not zero the dQ accumulator (half its
             bytes); the first CTA to reach a Q block zeroes its rows in the main kernel (producer warp 2)
    dqf_nodqc  dq_first without dq_convert, where the heuristic has dq_convert
    nodqf    the heuristic's kernel without dq_first, where the heuristic has it (HEURISTIC_DQ_FIRST)
    lpt, dqf_lpt  head dims 192 / 256, causal: the longest-first launch order (kLpt) with roles (measured
             before roles only: HEURISTIC_D256_LPT), without / with dq_first
    dqc_nodqf  head dim 128, non-causal, where the heuristic has dq_first without dq_convert: the other way
             round (fp16's heuristic before session 19)
    dyn      head dims 64 / 128 where the heuristic runs the plain grid: the dynamic scheduler; head dim 256
             (roles): the dynamic scheduler (session 20); dqf_dyn with dq_first too; nod256 roles' plain grid
             where the heuristic runs the dynamic one; dyn_lpt (causal) the dynamic scheduler claiming tiles in
             the lpt order (longest first across groups of pairs)
    nodyn    head dim 128: the heuristic's kernel on the plain grid (frag_pin kept; without dq_convert, which
             needs the dynamic scheduler there)
    w16      wide_epi (kWideEpi, session 20): the epilogue's 16-byte dK / dV stores (quad_transpose)
    now16    the heuristic's kernel without wide_epi, where the heuristic has it (HEURISTIC_WIDE_EPI)
    dqf_w16  dq_first and wide_epi; nodyn_w16  head dim 128: the plain grid (as nodyn) with wide_epi
    tab      the tuned entry selection would take from the tables in --table-dir (a tuner's output,
             before it ships), as for_problem makes it

--breakdown adds the GPU time per kernel role (preprocess / main / dQ convert; torch.profiler, mean of 3
calls) of the variants run and cuDNN at each case (--breakdown N: the first N cases only). Every kernel is
compiled first in parallel processes (cuflash.compile.precompile). dk, dv of every variant against heur's
must be equal bit for bit (the same sums in the same order; dq_convert changes only where dQ is converted),
dq within 1e-2 relative (fp32 additions in another order); else the row says MISMATCH.

    timeout 100 python tests/sm90_bwd_2k_timing.py --out /tmp/b2k_2k.json
    timeout 100 python tests/sm90_bwd_2k_timing.py --hdims 192 256 --seqlens 2048 4096 8192 --breakdown
    timeout 80 python tests/sm90_bwd_2k_timing.py --cells bf16:256:causal:2048:dqf,lpt fp16:128:full:16384

--cells replaces the cross product of --dtypes / --hdims / --seqlens / --causal by a list of cases, each
dtype:head_dim:full|causal:seqlen, optionally :variant,variant,... (the case's own variants, heur always
first; else --variants), run in the order given (put the most wanted first: a timeout cuts the rest).

Success: every row prints, no NaN / MISMATCH; the summary line per case gives each variant's x cuDNN
(cuDNN's time / ours: >= 1.0 is at least as fast). Not a test.
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402

from bwd_timing_common import CAUSALS, TORCH_DTYPES, compile_first, finish  # noqa: E402
from sm90_bwd_causal_timing import against, candidate_fns  # noqa: E402
import sm90_bwd_d128_timing as d128_timing  # noqa: E402
from sm90_bwd_d128_timing import time_rotated  # noqa: E402
from sm90_bwd_pre_timing import by_role, kernel_times  # noqa: E402

TOKENS, DIM = 16384, 2048
FAM = registry.get("sm90_bwd")
# name: the config of a case from the heuristic's (None: not for this case)
VARIANTS = {
    "heur": lambda c: c,
    "dqc": lambda c: c.replace(dq_convert=True),
    "nodqc": lambda c: c.replace(dq_convert=False) if c.dq_convert else None,
    "static": lambda c: c.replace(dynamic=False, frag_pin=False, dq_convert=False) if c.head_dim == 128 else None,
    "split": lambda c: c.replace(roles=False, dq_convert=False) if c.head_dim == 256 else None,
    "dqf": lambda c: c.replace(dq_first=True),
    "dqf_nodqc": lambda c: c.replace(dq_first=True, dq_convert=False) if c.dq_convert else None,
    "nodqf": lambda c: c.replace(dq_first=False) if c.dq_first else None,
    "lpt": lambda c: c.replace(lpt=True) if c.causal and c.head_dim == 256 else None,
    "dqf_lpt": lambda c: c.replace(lpt=True, dq_first=True) if c.causal and c.head_dim == 256 else None,
    "dqc_nodqf": lambda c: c.replace(dq_convert=True, dq_first=False) if c.dq_first and not c.dq_convert
    and c.head_dim == 128 and not c.causal else None,
    "dyn": lambda c: c.replace(dynamic=True) if not c.dynamic and (c.head_dim in (64, 128) or c.roles) else None,
    "dqf_dyn": lambda c: c.replace(dynamic=True, dq_first=True) if c.roles and not (c.dynamic and c.dq_first) else None,
    "nod256": lambda c: c.replace(dynamic=False) if c.dynamic and c.roles else None,
    "dyn_lpt": lambda c: c.replace(dynamic=True, lpt=True) if c.roles and c.causal else None,
    "nodyn": lambda c: c.replace(dynamic=False, dq_convert=False) if c.dynamic and c.head_dim == 128 else None,
    "w16": lambda c: c.replace(wide_epi=True) if not c.wide_epi else None,
    "now16": lambda c: c.replace(wide_epi=False) if c.wide_epi else None,
    "dqf_w16": lambda c: c.replace(dq_first=True, wide_epi=True) if not (c.dq_first and c.wide_epi) else None,
    "nodyn_w16": lambda c: c.replace(dynamic=False, dq_convert=False, wide_epi=True)
    if c.dynamic and c.head_dim == 128 else None,
    "tab": lambda c: None,   # (variants_for: the --table-dir entry)
}
DEFAULT_VARIANTS = ("heur", "dqc")
# "tab": the tuned entry that selection would take for the case from the table files in --table-dir
# (cuflash.select.lookup over those files only), as for_problem makes it; left out where none applies
TABLE_DIRS: list = []


def problem(s, causal, dtype, hdim, op="bwd"):
    b = max(1, TOKENS // s)
    heads = DIM // hdim if DIM % hdim == 0 else 8 if hdim > 128 else DIM // hdim
    return Problem(op, dtype, b, s, s, heads, heads, hdim, causal)


def variants_for(p, names):
    """{variant: config} for problem p (sm90_bwd_d128_timing.variants_for with VARIANTS here)."""
    out = d128_timing.variants_for(p, [n for n in names if n != "tab"], VARIANTS)
    if "tab" in names and TABLE_DIRS:
        cfg, _ = select.lookup(FAM, p, _gpu.name(), _gpu.arch(), _gpu.max_smem(), TABLE_DIRS)
        if cfg is not None and not FAM.for_problem(cfg, p).problems(_gpu.max_smem()):
            out["tab"] = FAM.for_problem(cfg, p)
    return out


def parse_cells(cells, default_names):
    """([(head_dim, dtype, seqlen, causal)], [variant names per case]) from --cells' strings
    dtype:head_dim:full|causal:seqlen[:variant,...] (heur first in every case)."""
    cases, names = [], []
    for cell in cells:
        parts = cell.split(":")
        if len(parts) not in (4, 5) or parts[0] not in TORCH_DTYPES or parts[2] not in ("full", "causal"):
            raise ValueError(f"--cells: {cell!r} is not dtype:head_dim:full|causal:seqlen[:variant,...]")
        own = parts[4].split(",") if len(parts) == 5 else list(default_names)
        unknown = [n for n in own if n not in VARIANTS]
        if unknown:
            raise ValueError(f"--cells: {cell!r} names unknown variants {unknown} (known: {list(VARIANTS)})")
        cases.append((int(parts[1]), parts[0], int(parts[3]), parts[2] == "causal"))
        names.append(["heur"] + [n for n in own if n != "heur"])
    return cases, names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(TORCH_DTYPES))
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256], choices=(64, 128, 192, 256))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--table-dir", default=None, help="a folder of tuned tables for the variant tab")
    ap.add_argument("--cells", nargs="+", default=None,
                    help="cases dtype:head_dim:full|causal:seqlen[:variant,...] instead of the cross product")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--back-to-back", type=int, default=10, help="calls per sample (the bench's 10)")
    ap.add_argument("--breakdown", nargs="?", type=int, const=-1, default=0, metavar="N",
                    help="GPU time per kernel role of each variant and cuDNN (--breakdown N: the first N cases only)")
    ap.add_argument("--flash", action="store_true", help="SDPA flash too")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    causals = CAUSALS[args.causal]
    if args.table_dir:
        TABLE_DIRS.append(args.table_dir)
    names = ["heur"] + [n for n in args.variants if n != "heur"]
    dev, t0 = torch.cuda.get_device_name(), time.time()
    if args.cells:
        cases, case_names = parse_cells(args.cells, names)
    else:
        cases = [(d, dt, s, c) for d in args.hdims for dt in args.dtypes for s in args.seqlens for c in causals]
        case_names = [names] * len(cases)
    todo = []
    for (d, dtype, s, causal), names in zip(cases, case_names):
        p = problem(s, causal, dtype, d)
        todo += list(variants_for(p, names).values())
        todo.append(select.choose(problem(s, causal, dtype, d, op="fwd"), _gpu.arch(), _gpu.name(),
                                  _gpu.max_smem())[1])
    compile_first(todo, "sm90_bwd short seqlens (backward alone)", t0)
    print(f"{'case':<26} {'variant':<8} {'kernel':<66} {'ms':>7} {'TFLOPs':>6} {'x cuDNN':>7} "
          f"{'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for i, ((d, dtype, s, causal), names) in enumerate(zip(cases, case_names)):
        p = problem(s, causal, dtype, d)
        b, h = p.batch, p.nheads
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=TORCH_DTYPES[dtype]) for _ in range(4))
        configs = variants_for(p, names)
        fns, same, results = candidate_fns(configs, q, k, v, dout, causal, args.flash)
        times = time_rotated(fns, args.reps, args.back_to_back, False)
        case = f"{dtype} d{d} {'causal' if causal else 'full'} b{b} s{s}"
        flops = op_flops(p)
        t_cudnn = times["cudnn"].median_ms
        line = []
        for name in list(configs) + [n for n in fns if n not in configs]:
            src = same.get(name, name)
            t = times[src].median_ms
            label, ddq, dkv, flag = against(name, configs, same, results, "heur")
            if name in configs:
                line.append(f"{name} {t_cudnn / t:.3f}")
            print(f"{case:<26} {name:<8} {label:<66} {t:7.3f} {flops / t / 1e9:6.0f} {t_cudnn / t:7.3f} "
                  f"{ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
            rows.append(dict(dtype=dtype, hdim=d, causal=causal, seqlen=s, batch=b, heads=h, variant=name,
                             kernel=label, ms=t, tflops=flops / t / 1e9, x_cudnn=t_cudnn / t,
                             samples=list(times[src].samples), dq_rel_diff=ddq, dkv_rel_diff=dkv,
                             mismatch=bool(flag)))
        summary.append(f"{case:<26} " + "  ".join(line) + "   (x cuDNN, b2b)")
        if args.breakdown and (args.breakdown < 0 or i < args.breakdown):
            for name in [n for n in ("heur", "dqc", "nodqc", "dqf", "nodqf", "dqf_nodqc", "lpt", "dqf_lpt", "w16",
                                     "now16", "dqf_w16", "dyn", "dqf_dyn", "nod256", "dyn_lpt", "tab")
                         if n in fns] + ["cudnn"]:
                roles = by_role(kernel_times(fns[name], 3))
                print(f"{case:<26} {name:<8} GPU us by role: {roles}", flush=True)
                rows.append(dict(dtype=dtype, hdim=d, causal=causal, seqlen=s, variant=name, breakdown_us=roles))
        del q, k, v, dout, fns, results
        torch.cuda.empty_cache()
    finish(summary, t0, args.out, dev, rows)


if __name__ == "__main__":
    main()
