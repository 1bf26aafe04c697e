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
    cfgs = list(dict.fromkeys(timing.all_configs(quick=True, mask="both", features=("window",))
                              + gpu_test.all_test_configs()))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
