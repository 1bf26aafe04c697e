"""Timing of sm90_bwd's launch-order and scheduler candidates on an H100 (issue 14: the backward
at >= 1.0x SDPA cuDNN for seqlens >= 2k, d64 and d128, causal and not): per case the heuristic's
kernel as the module constants choose it today ("heur"), the same kernel in the plain launch order
("plain"), in the longest-first order ("lpt", kLpt; causal only), with the dynamic persistent
scheduler ("dyn", kDynamic: a CTA per SM claiming K/V blocks), with both ("dyn_lpt"), and at d128
that with two dS buffers ("dyn_ds2", kDsDouble: one barrier fewer per Q block), next to SDPA
cuDNN and SDPA flash, in one process, bf16, at the FlashAttention benchmark's shape
(batch x seqlen = 16k, heads = 2048 / d):

    timeout 120 python tests/sm90_bwd_causal_timing.py --out causal_timing.json   # d64, d128; 2k-16k
    python tests/sm90_bwd_causal_timing.py --hdims 128 --seqlens 2048 --causal yes   # one cell

Every cuflash kernel (the backward variants and the forwards selection picks) is compiled first in
parallel processes (cuflash.compile.precompile). A variant equal to another's config is not run
twice (its row says "= other"). Per case: each variant's gradients against plain's (the same math,
fp32 dQ additions in another order: dq relative max difference <= 1e-2, dk / dv exactly equal;
else "MISMATCH"); the whole backward (torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
CUDA events, samples of all variants interleaved, median: cuflash.timing.time_interleaved), and
the main kernel's GPU time alone (torch.profiler: sm90_bwd's / cuDNN's flash_bprop / flash's
dq_dk_dv kernel, mean of 3 calls). TFLOPs: the backward's FA convention (2.5 x 4 b h s^2 d, / 2
causal) over the whole backward. Not a test; < 60 s with a warm compile cache on an H100.

Success: every row prints, no NaN / MISMATCH; the summary gives per case main-kernel and whole
ratios to cuDNN (x cuDNN = cuDNN's time / ours: >= 1.0 is at least as fast) of every variant;
--out writes the rows and the device as JSON.
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import CAUSALS, compile_first, finish, first_calls, grad_diffs, sdpa_fn  # noqa: E402
from sm90_bwd_pre_timing import by_role, kernel_times  # noqa: E402

TOKENS, DIM = 16384, 2048
FAM = registry.get("sm90_bwd")
# name: the config of a case from the heuristic's (None: not for this case)
VARIANTS = {
    "heur": lambda c: c,
    "plain": lambda c: c.replace(lpt=False, dynamic=False),
    "lpt": lambda c: c.replace(lpt=True, dynamic=False) if c.causal else None,
    "dyn": lambda c: c.replace(lpt=False, dynamic=True),
    "dyn_lpt": lambda c: c.replace(lpt=True, dynamic=True) if c.causal else None,
    "dyn_ds2": lambda c: c.replace(lpt=c.causal, dynamic=True, ds_double=True) if c.head_dim == 128 else None,
}


def problem(d, s, causal, dtype="bf16", op="bwd"):
    b = max(1, TOKENS // s)
    return Problem(op, dtype, b, s, s, DIM // d, DIM // d, d, causal)


def variants_for(p, names):
    """{variant: config} for problem p (the ones that apply; run as for_problem makes them)."""
    heur = FAM.for_problem(FAM.heuristic(p, _gpu.arch(), _gpu.max_smem()), p)
    out = {}
    for name in names:
        cfg = VARIANTS[name](heur)
        if cfg is None:
            continue
        cfg = FAM.for_problem(cfg, p)
        assert not cfg.problems(_gpu.max_smem()), (cfg.name, cfg.problems())
        out[name] = cfg
    return out


def candidate_fns(configs: dict, q, k, v, dout, causal: bool, flash: bool) -> tuple:
    """(fns, same, results) for timing the backward of each named config next to SDPA cuDNN (and
    flash): fns {name: gradient callable}, one per distinct config, plus "cudnn" / "flash"; same
    {name: the earlier name with an equal config}; results {name: the gradients of one call}, run
    here, outside the timing, so loads happen and a NaN fails loudly."""
    same, fns = {}, {}
    for name, cfg in configs.items():
        first = next(n for n, c in configs.items() if c == cfg)
        if first != name:
            same[name] = first
            continue
        fns[name] = grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
            q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout)
    fns["cudnn"] = sdpa_fn(q, k, v, dout, causal, "cudnn")
    if flash:
        fns["flash"] = sdpa_fn(q, k, v, dout, causal, "flash")
    return fns, same, first_calls(fns)


def against(name, configs, same, results, base, dkv_tol=0.0):
    """(label, dq diff, dk/dv diff, flag) of row `name` next to variant `base`: the config's name (or
    "sdpa <name>", or "(= <earlier>)"), the relative differences of its gradients from base's (0 for
    SDPA's rows) and "  MISMATCH" past 1e-2 (dq) / dkv_tol (dk, dv)."""
    src = same.get(name, name)
    label = f"(= {src})" if name in same else configs[name].name if name in configs else f"sdpa {name}"
    if name not in configs:
        return label, 0.0, 0.0, ""
    ddq, dkv = grad_diffs(results[src], results[base])
    return label, ddq, dkv, "  MISMATCH" if ddq > 1e-2 or dkv > dkv_tol else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-flash", action="store_true", help="skip SDPA flash")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    causals = CAUSALS[args.causal]
    names = ["plain"] + [n for n in args.variants if n != "plain"]
    dev, t0 = torch.cuda.get_device_name(), time.time()

    todo = []
    for d in args.hdims:
        for causal in causals:
            for s in args.seqlens:
                todo += list(variants_for(problem(d, s, causal), names).values())
                fwd = problem(d, s, causal, op="fwd")
                todo.append(select.choose(fwd, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1])
    compile_first(todo, "sm90_bwd launch order / scheduler (bf16, backward)", t0)
    print(f"{'case':<24} {'variant':<8} {'kernel':<58} {'bwd ms':>7} {'TFLOPs':>6} {'main us':>8} "
          f"{'x cuDNN':>7} {'main x':>6} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for d in args.hdims:
        for s in args.seqlens:
            for causal in causals:
                p = problem(d, s, causal)
                b, h = p.batch, p.nheads
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                configs = variants_for(p, names)
                fns, same, results = candidate_fns(configs, q, k, v, dout, causal, not args.no_flash)
                times = time_interleaved(fns, warmup=2, reps=args.reps, back_to_back=2)
                mains = {name: by_role(kernel_times(fn, 3)).get("main", float("nan")) for name, fn in fns.items()}
                case = f"d{d} {'causal' if causal else 'full'} b{b} s{s}"
                flops = op_flops(p)
                t_cudnn, m_cudnn = times["cudnn"].median_ms, mains["cudnn"]
                line = []
                for name in list(configs) + [n for n in fns if n not in configs]:
                    src = same.get(name, name)
                    t, m = times[src].median_ms, mains[src]
                    label, ddq, dkv, flag = against(name, configs, same, results, "plain")
                    print(f"{case:<24} {name:<8} {label:<58} {t:7.3f} {flops / t / 1e9:6.0f} {m:8.1f} "
                          f"{t_cudnn / t:7.3f} {m_cudnn / m:6.3f} {ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
                    rows.append(dict(hdim=d, causal=causal, seqlen=s, batch=b, heads=h, variant=name,
                                     kernel=label, bwd_ms=t, tflops=flops / t / 1e9, main_us=m,
                                     x_cudnn=t_cudnn / t, main_x_cudnn=m_cudnn / m,
                                     dq_rel_diff=ddq, dkv_rel_diff=dkv, mismatch=bool(flag)))
                    if name in configs:
                        line.append(f"{name} {m_cudnn / m:.3f}/{t_cudnn / t:.3f}")
                summary.append(f"{case:<24} " + "  ".join(line) + "   (x cuDNN: main / whole)")
                del q, k, v, dout, fns, results
                torch.cuda.empty_cache()
    finish(summary, t0, args.out, dev, rows)


if __name__ == "__main__":
    main()
