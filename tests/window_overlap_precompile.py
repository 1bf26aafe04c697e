"""Compile the kernels of tests/test_window_overlap_gpu.py and of features_overhead_timing.py's window rows
(--quick, both masks, QUICK's candidates) in parallel worker processes (session 21, win3):

    timeout 90 python tests/window_overlap_precompile.py
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

import features_overhead_timing as timing  # noqa: E402
import test_window_overlap_gpu as gpu_test  # noqa: E402
from cuflash.compile import precompile  # noqa: E402

if __name__ == "__main__":
    t0 = time.time()
    from cuflash import registry
    from cuflash.problem import Problem

    bwd = registry.get("sm90_bwd")
    # tests/test_sm90_bwd_features_gpu.py's window kernels: the plain class's heuristic with the window's flags
    feat = [bwd.for_problem(bwd.heuristic(p.replace(features=())), p)
            for causal in (False, True)
            for p in [Problem("bwd", "bf16", 2, 1023, 1023, 4, 2, 128, causal, features=("window",), window=(64, 64))]]
    import test_feature_defaults_gpu as defaults_test

    # and the defaults' window kernels (tests/test_feature_defaults_gpu.py's window-only cases)
    feat += [c for c in defaults_test.all_test_configs() if c.window and not (c.softcap or c.alibi)]
    cfgs = list(dict.fromkeys(timing.all_configs(quick=True, mask="both", features=("window",))
                              + gpu_test.all_test_configs() + feat))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
