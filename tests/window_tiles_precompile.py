"""Compile the kernels of tests/test_window_tiles_gpu.py (edge_half), of features_overhead_timing.py's window rows
(--quick, both masks, QUICK's candidates) and, with --acc, of window_accounting_timing.py's forward rows, in
parallel worker processes (session 24, win6):

    timeout 90 python tests/window_tiles_precompile.py [--acc] [--scheds static_tmao_tov,static]
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

import features_overhead_timing as timing  # noqa: E402
import test_window_tiles_gpu as gpu_test  # noqa: E402
from cuflash.compile import precompile  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--scheds", default=",".join(gpu_test.SCHEDULES))
    args = ap.parse_args()
    t0 = time.time()
    cfgs = timing.all_configs(quick=True, mask="both", features=("window",))
    cfgs += gpu_test.all_test_configs(tuple(s for s in args.scheds.split(",") if s))
    if args.acc:
        import window_accounting_timing as acc

        cfgs += [c for _, c in acc.configs().values()]
    cfgs = list(dict.fromkeys(cfgs))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}", flush=True)
