"""Timing of sm90_bwd's head-dim-64 tiles on an H100 (issue 14): the backward alone, every new
2-consumer config (HALVES = BM64 BN128 c2, dQ by 32-column halves; FA3 = BM128 BN128 c2, dQ by
64-row halves; each with red.add, dq_bulk, dq_writer, overlap_sdp + dq_writer, stages 3 +
dq_writer where valid) next to today's sm90 d64 kernel (BM64 BN64 s2 c1 dq_writer, "c1_dqw"),
fa2_bwd's heuristic and SDPA's cuDNN and flash backends, in one process, at the FlashAttention
benchmark's shape (batch x seqlen = 16k, 32 heads, d64):

    timeout 300 python tests/sm90_bwd_d64_timing.py --dtypes bf16 --out d64_bf16.json
    timeout 300 python tests/sm90_bwd_d64_timing.py --dtypes fp16 --out d64_fp16.json
    python tests/sm90_bwd_d64_timing.py --dtypes bf16 --seqlens 16384 --causal no --variants halves_dqw fa3_dqw
    timeout 300 python tests/sm90_bwd_d64_timing.py --hdim 96 --dtypes bf16 --out d96.json   # see below

--hdim 96 (or another head dim; heads = 2048 / hdim): sm90_bwd's heuristic kernel for the call
(at 96 its d128 kernel, zero-filled columns) as the baseline "sm90", next to fa2_bwd and SDPA:
whether rank() should keep head dims 65..96 on fa2_bwd.

All kernels are compiled first in parallel processes (cuflash.compile.precompile). Each case
checks every variant's gradients against c1_dqw's (dq relative max difference <= 1e-2, dk / dv
too: the same math in another order; a larger one prints "MISMATCH"), then times
torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) with CUDA events, 3 warm-up calls,
the samples of all variants interleaved, the median (cuflash.timing.time_interleaved). TFLOPs: the
backward's FA convention (2.5 x 4 b h s^2 d, / 2 causal). Not a test.

Success: every row prints, no NaN / MISMATCH; the last lines rank the variants per case
(x cuDNN: time / cuDNN's time, < 1 is faster), and --out writes the rows and the device as JSON.
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import (CAUSALS, TORCH_DTYPES, compile_first, finish, first_calls,  # noqa: E402
                               grad_diffs, sdpa_fn)

TOKENS, D = 16384, 64
# name: (BM, BN, stages, consumers, flags)
VARIANTS = {
    "c1_dqw": (64, 64, 2, 1, dict(dq_writer=True)),          # today's sm90 d64 kernel (the baseline)
    "halves_red": (64, 128, 2, 2, {}),
    "halves_dqb": (64, 128, 2, 2, dict(dq_bulk=True)),
    "halves_dqw": (64, 128, 2, 2, dict(dq_writer=True)),
    "halves_ovl_dqw": (64, 128, 2, 2, dict(overlap_sdp=True, dq_writer=True)),
    "halves_s3_dqw": (64, 128, 3, 2, dict(dq_writer=True)),
    "fa3_red": (128, 128, 2, 2, {}),
    "fa3_dqb": (128, 128, 2, 2, dict(dq_bulk=True)),
    "fa3_dqw": (128, 128, 2, 2, dict(dq_writer=True)),
    "fa3_ovl_dqw": (128, 128, 2, 2, dict(overlap_sdp=True, dq_writer=True)),
    "fa3_s3_dqw": (128, 128, 3, 2, dict(dq_writer=True)),
}


def config(name, dtype, causal):
    BM, BN, stages, consumers, flags = VARIANTS[name]
    return Sm90BwdConfig(BM, BN, stages, consumers, D, dtype, causal, **flags)


def kernels_for(names, p):
    """{variant: sm90_bwd config} for problem p: the d64 variants `names` (the baseline first),
    or at another head dim the family's heuristic as "sm90"."""
    sm90 = registry.get("sm90_bwd")
    if p.head_dim != D:
        return {"sm90": sm90.for_problem(sm90.heuristic(p, torch.cuda.get_device_capability()), p)}
    return {name: config(name, p.dtype, p.causal) for name in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(TORCH_DTYPES))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hdim", type=int, default=D, help="64: the d64 variants; else the heuristic kernel")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    variants = ["c1_dqw"] + [v for v in args.variants if v != "c1_dqw"]
    causals = CAUSALS[args.causal]
    sm90, fa2 = registry.get("sm90_bwd"), registry.get("fa2_bwd")
    dev = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    t0 = time.time()
    hdim = args.hdim
    heads = 2048 // hdim

    # every backward kernel first, in parallel (the forwards compile on first use)
    todo = []
    for dtype in args.dtypes:
        for causal in causals:
            p = Problem("bwd", dtype, 1, 2048, 2048, heads, heads, hdim, causal)
            for cfg in kernels_for(variants, p).values():
                bad = cfg.problems()
                assert not bad and sm90.for_problem(cfg, p) == cfg, (cfg.name, bad)
                todo.append(cfg)
            todo.append(fa2.for_problem(fa2.heuristic(p, cc), p))
    compile_first(todo, f"sm90_bwd d{hdim} (backward alone)", t0, cudnn=False, verb="compiled")
    print(f"{'case':<28} {'variant':<15} {'kernel':<52} {'ms':>8} {'TFLOPs':>7} {'x c1':>6} "
          f"{'x cuDNN':>7} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for dtype in args.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for s in args.seqlens:
            for causal in causals:
                b = max(1, TOKENS // s)
                p = Problem("bwd", dtype, b, s, s, heads, heads, hdim, causal)
                q, k, v, dout = (torch.randn(b, s, heads, hdim, device="cuda", dtype=tdt) for _ in range(4))
                kernels = kernels_for(variants, p)
                base = next(iter(kernels))
                fns = {name: grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
                    q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout) for name, cfg in kernels.items()}
                fa2_cfg = fa2.for_problem(fa2.heuristic(p, cc), p)
                fns["fa2_bwd"] = grad_fn(lambda q, k, v: cuflash.flash_attn_func(
                    q, k, v, causal=causal, bwd_config=fa2_cfg), q, k, v, dout)
                fns["sdpa_cudnn"] = sdpa_fn(q, k, v, dout, causal, "cudnn")
                fns["sdpa_flash"] = sdpa_fn(q, k, v, dout, causal, "flash")
                results = first_calls(fns)   # (compile / load outside the timing)
                times = time_interleaved(fns, warmup=3, reps=args.reps, back_to_back=1)
                case = f"{dtype} d{hdim} {'causal' if causal else 'full'} b{b} s{s}"
                flops = op_flops(p)
                t_c1, t_cudnn = times[base].median_ms, times["sdpa_cudnn"].median_ms
                ref = results[base]
                ranked = []
                for name in fns:
                    t = times[name].median_ms
                    label = kernels[name].name if name in kernels else fa2_cfg.name if name == "fa2_bwd" else name
                    ddq, dkv = grad_diffs(results[name], ref)
                    flag = "  MISMATCH" if name in kernels and max(ddq, dkv) > 1e-2 else ""
                    print(f"{case:<28} {name:<15} {label:<52} {t:8.3f} {flops / t / 1e9:7.1f} {t / t_c1:6.3f} "
                          f"{t / t_cudnn:7.3f} {ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
                    rows.append(dict(dtype=dtype, hdim=hdim, causal=causal, seqlen=s, batch=b, heads=heads,
                                     variant=name, kernel=label, ms=t, tflops=flops / t / 1e9,
                                     x_c1=t / t_c1, x_cudnn=t / t_cudnn, dq_rel_diff=ddq, dkv_rel_diff=dkv,
                                     mismatch=bool(flag)))
                    ranked.append((t, name))
                ranked.sort()
                summary.append(f"{case:<28} " + "  ".join(f"{n} {t_cudnn / t:.2f}" for t, n in ranked[:5])
                               + "   (x cuDNN speed, fastest first)")
                del q, k, v, dout, fns, results
                torch.cuda.empty_cache()
    finish(summary, t0, args.out, dev, rows)


if __name__ == "__main__":
    main()
