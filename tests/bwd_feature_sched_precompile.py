"""Compile, in parallel, every kernel of tests/sm90_bwd_features_timing.py (its defaults) and of
tests/test_bwd_feature_sched_gpu.py (the backwards and the forwards its calls select), so that a GPU
round's time goes to running them:

    timeout 80 python tests/bwd_feature_sched_precompile.py [--no-timing] [--no-tests]
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

import sm90_bwd_features_timing as timing  # noqa: E402
import test_bwd_feature_sched_gpu as gpu_test  # noqa: E402
from test_features_gpu import HEADS  # noqa: E402


def test_configs():
    cfgs = list(gpu_test.all_test_configs())
    for dtype, cases in (("bf16", list(gpu_test.CASES)), ("fp16", ["softcap_causal", "alibi_full", "window_full"])):
        for case in cases:
            feature, causal, window, softcap, _ = gpu_test.CASES[case]
            for sq, sk, heads in gpu_test.SHAPES:
                h, hkv = HEADS[heads]
                p = Problem("fwd", dtype, 2, sq, sk, h, hkv, 128, causal, features=(feature,),
                            window=window or (64, 64), softcap=softcap)
                cfgs.append(timing.chosen(p))
                fcfg = gpu_test.forward_config(dtype, causal, feature, sq, sk, heads, softcap)
                if fcfg is not None:
                    cfgs.append(fcfg)
    return cfgs


def main():
    cfgs = []
    if "--no-timing" not in sys.argv:
        cfgs += timing.all_configs((False, True), timing.FEATURES, timing.DEFAULT_VARIANTS)
    if "--no-tests" not in sys.argv:
        cfgs += test_configs()
    cfgs = list(dict.fromkeys(cfgs))
    t = time.time()
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"{len(cfgs)} kernels in {time.time() - t:.0f} s; errors: {failed}")


if __name__ == "__main__":
    main()
