"""Fill CuPy's kernel cache, in parallel worker processes, for session 16's feat4 GPU round (not a
test): tests/test_feat4_gpu.py's kernels, tests/features_overhead_timing.py --quick --mask both
--no-bwd's forwards, and --heuristic-only --mask both --features window,dropout --bwd-pass's kernels
(the window's and dropout's forward + backward and backward alone).

    python tests/feat4_precompile.py
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

import features_overhead_timing as timing  # noqa: E402
import test_feat4_gpu  # noqa: E402
from cuflash.compile import precompile  # noqa: E402


def configs():
    cfgs = test_feat4_gpu.all_test_configs()
    cfgs += timing.all_configs(quick=True, mask="both", bwd=False)
    cfgs += timing.all_configs(mask="both", only_heuristic=True, features=("window", "dropout"), bwd=True)
    return list(dict.fromkeys(cfgs))


if __name__ == "__main__":
    t0 = time.time()
    cfgs = configs()
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
    assert not failed, failed
