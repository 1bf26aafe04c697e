"""Fill CuPy's kernel cache for tests/test_sm90_bwd_dqfirst_gpu.py (its backward kernels with and without
dq_first, and the forwards selection picks at its shapes) in parallel worker processes; with --timing also
tests/sm90_bwd_2k_timing.py's kernels of the given cases. Not a test.

    python tests/sm90_bwd_dqfirst_precompile.py [--no-tests] [--timing --hdims 128 256 --dtypes bf16 fp16
        --seqlens 2048 4096 --variants heur dqf]
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

from cuflash import _gpu, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

# (tests/test_sm90_bwd_dqfirst_gpu.py's classes)
CLASSES = [(128, "bf16", False), (128, "fp16", True), (256, "bf16", True), (256, "fp16", False), (64, "bf16", True),
           (128, "fp16", False), (256, "fp16", True), (64, "fp16", False)]


def test_configs():
    from sm90_bwd_dqconv_precompile import flag_configs

    many = [(Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, d, False), on) for d in (64, 128, 256) for on in (True, False)]
    return flag_configs("dq_first", CLASSES, many + [(Problem("bwd", "bf16", 2, 257, 257, 4, 2, 128, True), True)])


def timing_configs(hdims, dtypes, seqlens, variants, causals=(False, True)):
    import sm90_bwd_2k_timing as t

    out = []
    for d in hdims:
        for dtype in dtypes:
            for s in seqlens:
                for causal in causals:
                    p = t.problem(s, causal, dtype, d)
                    out += list(t.variants_for(p, ["heur"] + list(variants)).values())
                    out.append(select.choose(t.problem(s, causal, dtype, d, op="fwd"), _gpu.arch(), _gpu.name(),
                                             _gpu.max_smem())[1])
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--hdims", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--variants", nargs="+", default=["dqf"])
    args = ap.parse_args()
    t0 = time.time()
    todo = ([] if args.no_tests else test_configs()) + (
        timing_configs(args.hdims, args.dtypes, args.seqlens, args.variants) if args.timing else [])
    todo = list(dict.fromkeys(todo))
    errors = [(c.name, e) for c, _, e in precompile(todo) if e]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {errors}", flush=True)
    sys.exit(1 if errors else 0)
