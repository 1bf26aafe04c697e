"""Timing of sm90_bwd's head-dim-256 tile on an H100 (issue 14): the backward alone, in one process,
for bf16 and fp16, head dims 256 and 192 (192: the d256 kernel with zero-filled columns; fa2_bwd
and SDPA run it natively), 8 heads, batch x seqlen = 16k, seqlens 2k..16k, causal and not:

  * "heuristic": what selection runs for the call (sm90_bwd's heuristic through for_problem), when
    it differs from every candidate below;
  * the candidates, the d256 tile (BM64 BN64 c2, the consumers sharing the keys) with:
    "sm90" red.add (the consumers add dQ_i's parts), "sm90_dqw" dq_writer (dQ_i's part staged in
    the Q/dO ring slot, the writer warp's bulk reduce-adds), "sm90_lpt" / "sm90_dqw_lpt" the same
    in the lpt launch order (causal cases only; measured slower, not by default), "sm90_dqw_cl2" /
    "sm90_cl2" in clusters of 2 CTAs sharing the Q/dO loads by multicast, "sm90_ovl" overlap_sdp
    (not by default), "sm90_rol" / "sm90_rol_cl2" dq_writer with roles (the warpgroups split by
    operand: Sᵀ, Pᵀ, dV on one, dPᵀ, dSᵀ, dK on the other; m64n64 Sᵀ / dPᵀ), without and with
    the cluster, "sm90_rol_lpt" roles in the lpt order (causal cases only);
  * fa2_bwd's heuristic (and its H100 table entry where that differs, "fa2_tuned"), SDPA's cuDNN
    and flash backends.

    timeout 300 python tests/sm90_bwd_d256_timing.py --out d256.json
    python tests/sm90_bwd_d256_timing.py --dtypes bf16 --hdims 256 --seqlens 16384 --causal no --reps 20
    python tests/sm90_bwd_d256_timing.py --precompile-only --with-tests   # fill the kernel cache only

All kernels (the forwards too; --with-tests: tests/test_sm90_bwd_d256_dqw_gpu.py's as well) are
compiled first in parallel processes (cuflash.compile.precompile). Each case checks every cuflash
variant's gradients against fa2_bwd's (SDPA cuDNN's with --no-fa2; relative max difference <= 1e-2,
a larger one prints "MISMATCH"), then times torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True) with CUDA events, warm-up calls, the samples of all variants interleaved, the
median (cuflash.timing.time_interleaved). TFLOPs: the backward's FA convention (2.5 x 4 b h s^2 d,
/ 2 causal, d the real head dim). A backend SDPA refuses prints "skipped". Not a test.

Success: every row prints, no NaN / MISMATCH; the summary gives per case each candidate's speed
over cuDNN's (> 1: faster) and the best one, which decide D256_ABOVE_FA2 / D192_ABOVE_FA2,
HEURISTIC_D256_DQ_WRITER, HEURISTIC_D256_ROLES (per dtype), HEURISTIC_D256_LPT and
HEURISTIC_D256_CLUSTER in cuflash/families/sm90_bwd.py; --out writes the rows and the device as JSON.
The default variants are sm90_dqw and sm90_rol (with the heuristic's row where it differs from both).
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import (CAUSALS, TORCH_DTYPES, compile_first, finish, first_calls,  # noqa: E402
                               grad_diffs, sdpa_fn)

TOKENS, HEADS = 16384, 8
# name: flags of the d256 tile; the "_lpt" ones run causal cases only
VARIANTS = {"sm90": {}, "sm90_dqw": dict(dq_writer=True), "sm90_lpt": dict(lpt=True),
            "sm90_dqw_lpt": dict(dq_writer=True, lpt=True), "sm90_ovl": dict(overlap_sdp=True),
            "sm90_dqw_cl2": dict(dq_writer=True, cluster=True), "sm90_cl2": dict(cluster=True),
            "sm90_rol": dict(dq_writer=True, roles=True), "sm90_rol_cl2": dict(dq_writer=True, roles=True, cluster=True),
            "sm90_rol_lpt": dict(dq_writer=True, roles=True, lpt=True)}
DEFAULT_VARIANTS = ["sm90_dqw", "sm90_rol"]   # (the query split with dq_writer, roles)


def sm90_kernels(names, p):
    """{variant: config} of the d256 tile for problem p (head dim <= 256), as the call runs it; and
    "heuristic", selection's config for the call, where it differs from all of them."""
    fam = registry.get("sm90_bwd")
    out = {}
    for name in names:
        flags = VARIANTS[name]
        if flags.get("lpt") and not p.causal:
            continue
        cfg = Sm90BwdConfig(64, 64, 2, 2, 256, p.dtype, p.causal, **flags)
        assert fam.for_problem(cfg, p) == cfg and not cfg.problems(), (cfg.name, cfg.problems())
        out[name] = cfg
    heur = fam.for_problem(fam.heuristic(p, _gpu.arch(), _gpu.max_smem()), p)
    if heur not in out.values():
        out = {"heuristic": heur, **out}
    return out


def test_kernels():
    """tests/test_sm90_bwd_d256_dqw_gpu.py's and test_sm90_bwd_d256_roles_gpu.py's kernels (backwards,
    and the forwards their calls pick)."""
    import test_sm90_bwd_d256_dqw_gpu as t
    import test_sm90_bwd_d256_roles_gpu as r

    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    return t.suite_configs() + r.suite_configs() + [choose(fp, arch, name, smem)[1] for fp in t.forward_problems()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(TORCH_DTYPES))
    ap.add_argument("--hdims", type=int, nargs="+", default=[256, 192])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--sdpa", nargs="*", default=["cudnn", "flash"], choices=["cudnn", "flash"])
    ap.add_argument("--no-fa2", action="store_true", help="leave fa2_bwd out (the reference: SDPA cuDNN)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precompile-only", action="store_true", help="compile the kernels, time nothing")
    ap.add_argument("--with-tests", action="store_true",
                    help="compile tests/test_sm90_bwd_d256_dqw_gpu.py's and _roles_gpu.py's kernels in the same pool")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    causals = CAUSALS[args.causal]
    fa2 = registry.get("fa2_bwd")
    dev = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    t0 = time.time()

    # every kernel first, in parallel: the backwards, and the forwards selection picks per case
    todo = test_kernels() if args.with_tests else []
    for dtype in args.dtypes:
        for d in args.hdims:
            for causal in causals:
                for s in args.seqlens:
                    bwd = Problem("bwd", dtype, max(1, TOKENS // s), s, s, HEADS, HEADS, d, causal)
                    todo += list(sm90_kernels(args.variants, bwd).values())
                    if not args.no_fa2:
                        todo.append(fa2.for_problem(fa2.heuristic(bwd, cc), bwd))
                        todo.append(choose(bwd, cc, _gpu.name(), _gpu.max_smem(), family=fa2)[1])
                    todo.append(choose(bwd.replace(op="fwd"), cc, _gpu.name(), _gpu.max_smem())[1])
    compile_first(todo, "sm90_bwd d256 tile (backward alone)", t0, cudnn=False, verb="compiled")
    if args.precompile_only:
        return
    print(f"{'case':<28} {'variant':<12} {'kernel':<52} {'ms':>8} {'TFLOPs':>7} {'x fa2':>6} "
          f"{'x cuDNN':>7} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for dtype in args.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for d in args.hdims:
            for s in args.seqlens:
                for causal in causals:
                    b = max(1, TOKENS // s)
                    p = Problem("bwd", dtype, b, s, s, HEADS, HEADS, d, causal)
                    q, k, v, dout = (torch.randn(b, s, HEADS, d, device="cuda", dtype=tdt) for _ in range(4))
                    kernels = sm90_kernels(args.variants, p)
                    ours = list(kernels)
                    if not args.no_fa2:
                        fa2_cfg = fa2.for_problem(fa2.heuristic(p, cc), p)
                        kernels["fa2_bwd"] = fa2_cfg
                        tuned = choose(p, cc, _gpu.name(), _gpu.max_smem(), family=fa2)[1]
                        if tuned != fa2_cfg:   # the H100 table's fa2_bwd entry (what selection runs there)
                            kernels["fa2_tuned"] = tuned
                    fns = {name: grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
                        q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout) for name, cfg in kernels.items()}
                    for backend in args.sdpa:
                        try:   # (the forward runs here)
                            fns[f"sdpa_{backend}"] = sdpa_fn(q, k, v, dout, causal, backend)
                        except RuntimeError as e:
                            print(f"sdpa_{backend}: skipped ({str(e).splitlines()[0][:120]})", flush=True)
                    # (compile / load outside the timing; an SDPA backend that fails is left out)
                    results = first_calls(fns, optional=[n for n in fns if n.startswith("sdpa")])
                    times = time_interleaved(fns, warmup=args.warmup, reps=args.reps, back_to_back=1)
                    case = f"{dtype} d{d} {'causal' if causal else 'full'} b{b} s{s}"
                    flops = op_flops(p)
                    t_fa2 = times["fa2_bwd"].median_ms if "fa2_bwd" in times else float("nan")
                    t_cudnn = times["sdpa_cudnn"].median_ms if "sdpa_cudnn" in times else float("nan")
                    ref_name = "fa2_bwd" if "fa2_bwd" in results else "sdpa_cudnn"
                    ref = results[ref_name]
                    for name in fns:
                        t = times[name].median_ms
                        label = kernels[name].name if name in kernels else name
                        ddq, dkv = grad_diffs(results[name], ref)
                        flag = "  MISMATCH" if name in ours and max(ddq, dkv) > 1e-2 else ""
                        print(f"{case:<28} {name:<12} {label:<52} {t:8.3f} {flops / t / 1e9:7.1f} "
                              f"{t / t_fa2:6.3f} {t / t_cudnn:7.3f} {ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
                        rows.append(dict(dtype=dtype, hdim=d, causal=causal, seqlen=s, batch=b, heads=HEADS,
                                         variant=name, kernel=label, ms=t, tflops=flops / t / 1e9,
                                         x_fa2=t / t_fa2, x_cudnn=t / t_cudnn, dq_rel_diff=ddq,
                                         dkv_rel_diff=dkv, reference=ref_name, mismatch=bool(flag)))
                    best = min(ours, key=lambda n: times[n].median_ms)
                    t_best = times[best].median_ms
                    fa2s = [times[n].median_ms for n in ("fa2_bwd", "fa2_tuned") if n in times]
                    vs = "  ".join(f"{n} {t_cudnn / times[n].median_ms:4.2f}" for n in ours)
                    summary.append(f"{case:<28} best {best:<12} {flops / t_best / 1e9:6.1f} TFLOPs "
                                   f"{(min(fa2s) / t_best) if fa2s else float('nan'):5.2f}x fa2_bwd  "
                                   f"x cuDNN (speed): {vs}")
                    del q, k, v, dout, fns, results
                    torch.cuda.empty_cache()
    finish(summary, t0, args.out, dev, rows)


if __name__ == "__main__":
    main()
