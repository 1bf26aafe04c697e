"""Fill CuPy's kernel cache, in parallel worker processes, for session 16's feat4 GPU round (not a
test): tests/test_feat4_gpu.py's kernels, the d128 dropout mixes' (dropout_mix_configs),
tests/features_overhead_timing.py --quick --mask both
--no-bwd --features window,alibi's forwards, and --heuristic-only --mask both --bwd-pass's kernels
(every feature's forward + backward and backward alone).

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


def dropout_mix_configs():
    """What selection runs for the d128 dropout tests of other files that round B runs (the packed
    keep mask is d128's default): test_dropmix_gpu's window_full_fp16_d128_mqa and
    test_varlen_features_gpu's drop_full_fp16_d128_mqa, forward and backward."""
    from cuflash import _gpu, select
    from cuflash.problem import Problem

    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    probs = [Problem("fwd", "fp16", 1, 17, 1023, 4, 1, 128, False, features=("dropout", "window"),
                     window=(50, 20), dropout_p=0.17),
             Problem("fwd", "fp16", 7, 257, 200, 4, 1, 128, False, features=("dropout", "varlen"),
                     dropout_p=0.17)]
    return [select.choose(pr.replace(op=op), arch, name, smem)[1] for pr in probs for op in ("fwd", "bwd")]


def configs():
    cfgs = test_feat4_gpu.all_test_configs() + dropout_mix_configs()
    cfgs += timing.all_configs(quick=True, mask="both", features=("window", "alibi"), bwd=False)
    cfgs += timing.all_configs(mask="both", only_heuristic=True, bwd=True)
    return list(dict.fromkeys(cfgs))


if __name__ == "__main__":
    t0 = time.time()
    cfgs = configs()
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
    assert not failed, failed
