"""Quick timing of sm90_bwd's dq_bulk on an H100 (issue 14): the backward alone with dQ added by
red.global.add from registers (dq_bulk False, the heuristic's) against the shared-memory staging
tile + cp.reduce.async.bulk (dq_bulk True), one line per kernel, at the FlashAttention
benchmark's shape (batch x seqlen = 16k, 16 heads at d128, bf16):

    timeout 300 python tests/sm90_bwd_dqbulk_timing.py                 # d128, 8k and 16k, causal and not
    python tests/sm90_bwd_dqbulk_timing.py --hdims 64 128 --stages 2 3  # more kernels

Each case first checks dq_bulk's gradients against red.add's (same kernel otherwise: the max
difference of dq relative to max |dq| should be at most a bf16 ulp, <= 4e-3, as the fp32
additions come in another order; of dk / dv exactly 0),
then times torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) with the samples
interleaved (cuflash.timing.time_interleaved). TFLOPs: the backward's FA convention
(2.5x the forward's). Not a test.
"""
import argparse
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from bwd_timing_common import CAUSALS, first_calls, grad_diffs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    fam = registry.get("sm90_bwd")
    causals = CAUSALS[args.causal]
    print(f"{torch.cuda.get_device_name()}  sm90_bwd dq_bulk timing (bf16, backward alone)")
    print(f"{'case':<28} {'kernel':<52} {'ms':>8} {'TFLOPs':>7} {'x red':>6} {'dq diff':>8} {'dkv diff':>8}")
    for d in args.hdims:
        for s in args.seqlens:
            for causal in causals:
                h, b = 2048 // d, max(1, 16384 // s)
                p = Problem("bwd", "bf16", b, s, s, h, h, d, causal)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                base = fam.for_problem(fam.heuristic(p), p)
                configs = []
                for st in args.stages:
                    for bulk in (False, True):
                        cfg = base.replace(stages=st, dq_bulk=bulk)
                        if not cfg.problems(227 * 1024):
                            configs.append(cfg)
                fns = {cfg.name: grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
                    q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout) for cfg in configs}
                results = first_calls(fns)   # (compile outside the timing)
                times = time_interleaved(fns, reps=args.reps, back_to_back=3)
                case = f"d{d} {'causal' if causal else 'full'} b{b} s{s} h{h}"
                for cfg in configs:
                    red = cfg.replace(dq_bulk=False).name
                    t, t_red = times[cfg.name].median_ms, times[red].median_ms
                    ddq, dkv = grad_diffs(results[cfg.name], results[red])
                    tflops = op_flops(p) / t / 1e9
                    print(f"{case:<28} {cfg.name:<52} {t:8.3f} {tflops:7.1f} {t / t_red:6.3f} {ddq:8.1e} {dkv:8.1e}")


if __name__ == "__main__":
    main()
