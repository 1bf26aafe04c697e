"""Timing of sm90_bwd's head-dim-128 candidates on an H100 (issue 14: the backward at >= 1.0x SDPA
cuDNN in every cell seqlen >= 2k, >= 520 TFLOPs non-causal 16k; --hdim 64 for the d64 tile): per
case the heuristic's kernel ("heur": at d128 dq_early + dk_late + ds_double on the plain grid,
HEURISTIC_DK_LATE), the session-14 heuristic's ("old": one dS buffer; dynamic at d64 and d128
causal), the other scheduler ("alt"), and the main-loop flags of issue 14's second direction:

    dqe      dq_early (kDqEarly): the dQ GEMM issued behind dV, dK (no wait, so the tensor cores
             do not drain at the barrier between the consumer warpgroups); one wait for the three
    dkl      dq_early and dk_late (kDkLate, FlashAttention-3's order: dK issued behind the dQ GEMM and
             waited for after the dQ part is staged; at d128 not with the dynamic scheduler: spills)
    sah      s_ahead (kSAhead): the next Q block's Sᵀ issued behind the dQ GEMM (bf16 only: the
             fp16 kernel spills)
    ds2      ds_double (kDsDouble): two dS buffers, no barrier before the dS stores
    rot      q_rotate (kQRotate, non-causal): K/V block n visits the Q blocks from n % n_iters on,
             wrapping (the CTAs of a head add into different dQ rows at a time)
    dqe_rot, rot_dkl, dkl_ds2, dqe_ds2, alt_ds2, alt_dqe_ds2, alt_dkl_ds2, dyn_dqe_ds2: mixes (alt_*:
             the plain grid, dyn_*: the dynamic scheduler; the single flags on "old")

each where it applies (non-causal only: dkl_ds2, rot*, dqe_rot; causal only: *_ds2 but dkl_ds2);
by default DEFAULT_VARIANTS (fp16: FP16_VARIANTS), --variants all for every one,
next to SDPA cuDNN (and flash unless --no-flash), in one process, bf16 and fp16, d128, dim 2048
(16 heads), batch x seqlen = 16k, causal and not. The backward alone: torch.autograd.grad of one
forward's output (retain_graph; SDPA the same way), CUDA events, warm-up, samples of all variants
interleaved, median (cuflash.timing.time_interleaved), by two methods (--methods): "b2b", the
bench's (samples of 10 calls back to back, as cuflash bench --mode fwdbwd times them), and
"flush", single calls each after an L2 flush (the tuner's). --breakdown adds the GPU time of
heur's and cuDNN's kernels by role (preprocess / main / dQ convert / other; torch.profiler, mean
of 3 calls) to find where the whole backward's time goes. Every kernel is compiled first in parallel
processes (cuflash.compile.precompile). Gradients of each variant against heur's: every variant
but q_rotate sums dK_j, dV_j over the Q blocks in the same order, so dk, dv must be equal bit for
bit (q_rotate's: within 1e-2 relative); dq within 1e-2 relative (fp32 additions in another order);
else the row says MISMATCH.

    timeout 120 python tests/sm90_bwd_d128_timing.py --out d128_timing.json
    python tests/sm90_bwd_d128_timing.py --dtypes fp16 --variants heur alt dqe dqe_ds2 alt_dqe_ds2
    python tests/sm90_bwd_d128_timing.py --dtypes bf16 --seqlens 16384 --causal no   # one cell
    timeout 120 python tests/sm90_bwd_d128_timing.py --hdim 64 128 --methods b2b --no-flash --reps 4

Samples rotate the candidates' order (time_rotated). Default variants: heur (session 16: d128 dk_late
with the dynamic scheduler and frag_pin, d64 dk_late), s15 (session 15's heuristic kernel), hrot
(non-causal: q_rotate on the heuristic's kernel; d128 bf16 only); by name pin (frag_pin flipped),
dyn_pin, s3, s3_pin, dkl, dkl_pin, and bm80 (d128 bf16 non-causal: BM 80, the swapped dQ GEMM):
    timeout 60 python tests/sm90_bwd_d128_timing.py --dtypes bf16 --causal no --variants s15 bm80

Success: every row prints, no NaN / MISMATCH; the summary line per case gives each variant's
x cuDNN (cuDNN's time / ours: >= 1.0 is at least as fast). Not a test.
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
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402

from bwd_timing_common import CAUSALS, TORCH_DTYPES, compile_first, finish  # noqa: E402
from sm90_bwd_causal_timing import against, candidate_fns  # noqa: E402
from sm90_bwd_pre_timing import by_role, kernel_times  # noqa: E402

TOKENS, DIM = 16384, 2048
HDIM = 128           # --hdim sets it (64: the BM128 BN128 tile)
FAM = registry.get("sm90_bwd")
# name: the config of a case from the heuristic's (None: not for this case)
def old(c):
    """The heuristic's kernel before dk_late (session 14): dQ by the writer warp, one dS buffer; the
    dynamic scheduler where HEURISTIC_DYNAMIC had it (d64; d128 causal)."""
    return c.replace(dq_early=False, dk_late=False, ds_double=False, s_ahead=False, q_rotate=False,
                     dynamic=c.head_dim == 64 or c.causal, lpt=False)


VARIANTS = {
    "heur": lambda c: c,
    "old": old,
    "alt": lambda c: c.replace(dynamic=not c.dynamic, lpt=False),
    "dqe": lambda c: old(c).replace(dq_early=True),
    # (sah, s_ahead: refused since session 17, its kernels serialized by ptxas)
    "ds2": lambda c: old(c).replace(ds_double=True),
    "dkl": lambda c: old(c).replace(dq_early=True, dk_late=True),
    # non-causal
    "dkl_ds2": lambda c: c.replace(dq_early=True, dk_late=True, ds_double=True, dynamic=False) if not c.causal else None,
    "rot": lambda c: old(c).replace(q_rotate=True) if not c.causal else None,
    "dqe_rot": lambda c: old(c).replace(dq_early=True, q_rotate=True) if not c.causal else None,
    "rot_dkl": lambda c: c.replace(q_rotate=True, dq_early=True, dk_late=True) if not c.causal else None,
    # causal (alt: the plain grid, where the session-14 heuristic ran the dynamic scheduler)
    "dqe_ds2": lambda c: old(c).replace(dq_early=True, ds_double=True) if c.causal else None,
    "alt_ds2": lambda c: old(c).replace(dynamic=False, ds_double=True) if c.causal else None,
    "alt_dqe_ds2": lambda c: old(c).replace(dynamic=False, ds_double=True, dq_early=True) if c.causal else None,
    "alt_dkl_ds2": lambda c: (old(c).replace(dynamic=False, ds_double=True, dq_early=True, dk_late=True)
                              if c.causal else None),
    "dyn_dqe_ds2": lambda c: old(c).replace(dynamic=True, ds_double=True, dq_early=True) if c.causal else None,
    # frag_pin (kFragPin: Pᵀ's fragments pinned at the fence, dV one wgmma group) on the heuristic's
    "pin": lambda c: c.replace(frag_pin=not c.frag_pin),
    # head dim 128: the dynamic scheduler with dk_late (fits with frag_pin only)
    "dyn_pin": lambda c: c.replace(dynamic=True, frag_pin=True) if c.head_dim == 128 else None,
    # head dim 128: 3 Q/dO ring slots (1 dq_writer staging tile then: 227 KB)
    "s3": lambda c: c.replace(stages=3) if c.head_dim == 128 else None,
    # non-causal: q_rotate on the heuristic's (dk_late) kernel (d128: bf16 only, the fp16 kernel spills)
    "hrot": lambda c: c.replace(q_rotate=True) if not c.causal and (c.head_dim == 64 or c.dtype == "bf16") else None,
    # session 15's heuristic: d128 dk_late on the plain grid without frag_pin, d64 without dq_early / dk_late
    "s15": lambda c: (c.replace(dynamic=False, frag_pin=False) if c.head_dim == 128
                      else c.replace(dq_early=False, dk_late=False)),
    # head dim 128: 3 Q/dO ring slots (1 dq_writer staging tile then: 227 KB), with frag_pin
    "s3_pin": lambda c: c.replace(stages=3, frag_pin=True) if c.head_dim == 128 else None,
    # head dim 128 non-causal: FA3's BM 80 tile (the swapped dQ GEMM, dQ_iᵀ = K_jᵀ dSᵀ), the heuristic's flags
    "bm80": lambda c: c.replace(BM=80, frag_pin=False) if c.head_dim == 128 and not c.causal else None,
    # head dim 64: dq_early + dk_late on its dynamic tile (not its default yet), with frag_pin too
    "dkl_pin": lambda c: old(c).replace(dq_early=True, dk_late=True, frag_pin=True) if c.head_dim == 64 else None,
}
# fp16's variants unless --variants names them (fewer compiles: the flags' effect is measured in bf16)
FP16_VARIANTS = ("heur", "s15", "hrot")
# the round's default set (--variants all: every one; bm80 by name: --variants s15 bm80)
DEFAULT_VARIANTS = ("heur", "s15", "hrot")


def names_for(dtype, names):
    """The variants run for dtype: `names`, or for fp16 without an explicit list FP16_VARIANTS (at
    head dim 128 without dkl: the heuristic's kernel is dk_late there already)."""
    if names is None:
        return [n for n in (FP16_VARIANTS if dtype == "fp16" else DEFAULT_VARIANTS) if HDIM == 64 or n != "dkl"]
    return list(VARIANTS) if "all" in names else list(names)


def time_rotated(fns, reps, back_to_back, flush_l2):
    """As cuflash.timing.time_interleaved, but sample r runs the callables in an order rotated by r
    (A B C, B C A, C A B, ...), so that none always runs right after the same one (the H100's clock
    sinks under sustained load: a fixed order hands the drift to the same candidate each time)."""
    import statistics

    import cupy
    from cuflash.timing import Timing, l2_flusher, warm_up

    inner = 1 if flush_l2 else max(1, int(back_to_back))
    flush = l2_flusher() if flush_l2 else None
    for fn in fns.values():
        warm_up(fn, 2)
    names = list(fns)
    events = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            if flush is not None:
                flush()
            a.record()
            for _ in range(inner):
                fns[name]()
            b.record()
            events[name].append((a, b))
    cupy.cuda.get_current_stream().synchronize()
    out = {}
    for name, evs in events.items():
        samples = tuple(cupy.cuda.get_elapsed_time(a, b) / inner for a, b in evs)
        out[name] = Timing(statistics.median(samples), samples, inner, flush is not None)
    return out


def problem(s, causal, dtype="bf16", op="bwd"):
    b = max(1, TOKENS // s)
    return Problem(op, dtype, b, s, s, DIM // HDIM, DIM // HDIM, HDIM, causal)


def variants_for(p, names, variants=None):
    """{variant: config} for problem p (the ones that apply, as for_problem makes them; a variant
    whose flags for_problem drops is left out); `variants`: {name: heuristic config -> config or
    None}, VARIANTS by default."""
    variants = VARIANTS if variants is None else variants
    heur = FAM.for_problem(FAM.heuristic(p, _gpu.arch(), _gpu.max_smem()), p)
    out = {}
    for name in names:
        want = variants[name](heur)
        if want is None:
            continue
        cfg = FAM.for_problem(want, p)
        if cfg != want or cfg.problems(_gpu.max_smem()):
            continue
        out[name] = cfg
    return out


def all_configs(dtypes, causals, seqlens, names=None):
    out = []
    for dtype in dtypes:
        for causal in causals:
            for s in seqlens:
                out += list(variants_for(problem(s, causal, dtype), names_for(dtype, names)).values())
                out.append(select.choose(problem(s, causal, dtype, op="fwd"), _gpu.arch(), _gpu.name(),
                                         _gpu.max_smem())[1])
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(TORCH_DTYPES))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS) + ["all"],
                    help="default: DEFAULT_VARIANTS (fp16: FP16_VARIANTS); all: every one")
    ap.add_argument("--hdim", type=int, nargs="+", default=[128], choices=(64, 128),
                    help="head dims, one process (e.g. --hdim 64 128)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=["b2b", "flush"], choices=["b2b", "flush"])
    ap.add_argument("--back-to-back", type=int, default=10, help="calls per b2b sample (the bench's 10)")
    ap.add_argument("--breakdown", action="store_true", help="heur's and cuDNN's kernels by role")
    ap.add_argument("--no-flash", action="store_true", help="skip SDPA flash")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    global HDIM
    causals = CAUSALS[args.causal]
    names = None if args.variants is None else ["heur"] + [n for n in args.variants if n != "heur"]
    dev, t0 = torch.cuda.get_device_name(), time.time()
    todo = []
    for HDIM in args.hdim:
        todo += all_configs(args.dtypes, causals, args.seqlens, names)
    compile_first(todo, "sm90_bwd d128 candidates (backward alone)", t0)
    cols = "".join(f" {m + ' ms':>9} {'TFLOPs':>6} {'x cuDNN':>7}" for m in args.methods)
    print(f"{'case':<26} {'variant':<11} {'kernel':<62}{cols} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for HDIM, dtype in ((h, dt) for h in args.hdim for dt in args.dtypes):
        for s in args.seqlens:
            for causal in causals:
                p = problem(s, causal, dtype)
                b, h = p.batch, p.nheads
                q, k, v, dout = (torch.randn(b, s, h, HDIM, device="cuda", dtype=TORCH_DTYPES[dtype])
                                 for _ in range(4))
                configs = variants_for(p, ["heur"] + [n for n in names_for(dtype, names) if n != "heur"])
                fns, same, results = candidate_fns(configs, q, k, v, dout, causal, not args.no_flash)
                times = {m: time_rotated(fns, args.reps, args.back_to_back, m == "flush") for m in args.methods}
                case = f"{dtype} d{HDIM} {'causal' if causal else 'full'} b{b} s{s}"
                flops = op_flops(p)
                t_cudnn = {m: times[m]["cudnn"].median_ms for m in args.methods}
                line = []
                for name in list(configs) + [n for n in fns if n not in configs]:
                    src = same.get(name, name)
                    t = {m: times[m][src].median_ms for m in args.methods}
                    # (q_rotate sums dK_j, dV_j over the Q blocks in another order: within 1e-2 too)
                    rot = name in configs and configs[name].q_rotate != configs["heur"].q_rotate
                    label, ddq, dkv, flag = against(name, configs, same, results, "heur", 1e-2 if rot else 0.0)
                    vals = "".join(f" {t[m]:9.3f} {flops / t[m] / 1e9:6.0f} {t_cudnn[m] / t[m]:7.3f}"
                                   for m in args.methods)
                    print(f"{case:<26} {name:<11} {label:<62}{vals} {ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
                    rows.append(dict(dtype=dtype, hdim=HDIM, causal=causal, seqlen=s, batch=b, heads=h,
                                     variant=name, kernel=label, dq_rel_diff=ddq, dkv_rel_diff=dkv,
                                     mismatch=bool(flag),
                                     **{f"{m}_ms": t[m] for m in args.methods},
                                     **{f"{m}_tflops": flops / t[m] / 1e9 for m in args.methods},
                                     **{f"{m}_x_cudnn": t_cudnn[m] / t[m] for m in args.methods}))
                    if name in configs:
                        line.append(f"{name} " + "/".join(f"{t_cudnn[m] / t[m]:.3f}" for m in args.methods))
                summary.append(f"{case:<26} " + "  ".join(line) + f"   (x cuDNN: {' / '.join(args.methods)})")
                if args.breakdown:
                    for name in ("heur", "cudnn"):
                        roles = by_role(kernel_times(fns[name], 3))
                        print(f"{case:<26} {name:<11} GPU us by role: {roles}", flush=True)
                        rows.append(dict(dtype=dtype, hdim=HDIM, causal=causal, seqlen=s, variant=name,
                                         breakdown_us=roles))
                del q, k, v, dout, fns, results
                torch.cuda.empty_cache()
    finish(summary, t0, args.out, dev, rows)


if __name__ == "__main__":
    main()
