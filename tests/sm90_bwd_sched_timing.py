"""Timing of sm90_bwd's schedule flags on an H100 (issue 14): the backward alone for the
heuristic's kernel (plain) and the same kernel with overlap_sdp, with dq_writer, and with both,
next to SDPA cuDNN's backward in the same process, bf16, at the FlashAttention benchmark's shape
(batch x seqlen = 16k, heads = 2048 / head dim):

    timeout 300 python tests/sm90_bwd_sched_timing.py --out sched.json      # d64 / d128, 4k-16k, causal and not
    python tests/sm90_bwd_sched_timing.py --hdims 128 --seqlens 16384 --causal no   # the target cell

Each case first checks every flagged kernel's gradients against plain's (the same math: the max
difference of dq relative to max |dq| should be within a bf16 ulp, <= 4e-3, as the fp32
additions come in another order; dk / dv exactly 0 without overlap_sdp, within an ulp with it),
then times torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) with the samples
interleaved (cuflash.timing.time_interleaved). A variant whose flags the call drops (for_problem)
repeats another's kernel and is marked "(= ...)". TFLOPs: the backward's FA convention (2.5x the forward's). Not a test.
Success: every row prints, no NaN / assertion; the JSON (--out) holds the rows and the device.
"""
import argparse
import json
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import CAUSALS, first_calls, grad_diffs, sdpa_fn  # noqa: E402

VARIANTS = {"plain": {}, "overlap_sdp": dict(overlap_sdp=True), "dq_writer": dict(dq_writer=True),
            "both": dict(overlap_sdp=True, dq_writer=True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    fam = registry.get("sm90_bwd")
    causals = CAUSALS[args.causal]
    dev = torch.cuda.get_device_name()
    print(f"{dev}  sm90_bwd schedule flags (bf16, backward alone), torch {torch.__version__}", flush=True)
    print(f"{'case':<26} {'variant':<12} {'kernel':<56} {'ms':>8} {'TFLOPs':>7} {'x plain':>7} "
          f"{'x cuDNN':>7} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, t0 = [], time.time()
    for d in args.hdims:
        for s in args.seqlens:
            for causal in causals:
                h, b = 2048 // d, max(1, 16384 // s)
                p = Problem("bwd", "bf16", b, s, s, h, h, d, causal)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                base = fam.for_problem(fam.heuristic(p), p)
                configs = {name: fam.for_problem(base.replace(**flags), p) for name, flags in VARIANTS.items()}
                kernels = {}
                for cfg in configs.values():
                    kernels.setdefault(cfg.name, cfg)
                fns = {name: grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
                    q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout) for name, cfg in kernels.items()}
                fns["cudnn"] = sdpa_fn(q, k, v, dout, causal, "cudnn")
                results = first_calls(fns)   # (compile outside the timing)
                times = time_interleaved(fns, reps=args.reps, back_to_back=3)
                case = f"d{d} {'causal' if causal else 'full'} b{b} s{s} h{h}"
                flops = op_flops(p)
                t_plain, t_cudnn = times[base.name].median_ms, times["cudnn"].median_ms
                print(f"{case:<26} {'cuDNN':<12} {'sdpa cudnn':<56} {t_cudnn:8.3f} "
                      f"{flops / t_cudnn / 1e9:7.1f} {t_cudnn / t_plain:7.3f} {1.0:7.3f}", flush=True)
                rows.append(dict(hdim=d, causal=causal, seqlen=s, batch=b, heads=h, variant="cudnn",
                                 kernel="sdpa_cudnn", ms=t_cudnn, tflops=flops / t_cudnn / 1e9))
                for name, cfg in configs.items():
                    t = times[cfg.name].median_ms
                    ddq, dkv = grad_diffs(results[cfg.name], results[base.name])
                    same = next((n for n, c in configs.items() if c == cfg), name)
                    label = cfg.name if same == name else f"(= {same})"
                    print(f"{case:<26} {name:<12} {label:<56} {t:8.3f} {flops / t / 1e9:7.1f} "
                          f"{t / t_plain:7.3f} {t / t_cudnn:7.3f} {ddq:8.1e} {dkv:8.1e}", flush=True)
                    rows.append(dict(hdim=d, causal=causal, seqlen=s, batch=b, heads=h, variant=name,
                                     kernel=cfg.name, ms=t, tflops=flops / t / 1e9, x_plain=t / t_plain,
                                     x_cudnn=t / t_cudnn, dq_rel_diff=ddq, dkv_rel_diff=dkv))
                del q, k, v, dout, fns, results
                torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, dtype="bf16",
                           convention="FA: bwd FLOPs = 2.5 x 4 b h s^2 d (/2 causal)", rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
