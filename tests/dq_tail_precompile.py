"""Compile, in parallel worker processes, the kernels of sm90_bwd's dq_tail rounds (session 31, win5):
tests/window_bwd_kernels_timing.py --variants heuristic,dqt,dqt2 (the window's and the plain call's backward
with and without dq_tail, and their forwards), tests/features_overhead_timing.py --quick --mask both --features
window --fwd-heuristic (its backward candidate bwd_dqt), with --tests tests/test_bwd_dq_tail_gpu.py's, and with
--defaults tests/test_feature_defaults_gpu.py's window cases (not _bwd_s3) as their calls run them.

    timeout 90 python tests/dq_tail_precompile.py [--tests] [--defaults] [--no-timing]
"""
import itertools
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]


def forward_of(bwd_problem):
    """Selection's forward config of a backward Problem's call."""
    from cuflash import _gpu, select

    return select.choose(bwd_problem.replace(op="fwd"), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]


def timing_configs():
    import features_overhead_timing as feat
    import window_bwd_kernels_timing as bwdk

    out = []
    for (mask, key), (causal, window, cfg) in bwdk.configs(("heuristic", "dqt", "dqt2", "dqt0")).items():
        out += [cfg, forward_of(bwdk.problem(causal, window))]
    return out + feat.all_configs(quick=True, mask="both", features=("window",), fwd_heuristic=True)


def test_configs():
    """tests/test_bwd_dq_tail_gpu.py's kernels: each case's backward (the forced config as for_problem
    makes it for the call) and its forward."""
    import test_bwd_dq_tail_gpu as t
    from cuflash import registry
    from cuflash.api import check_features
    from cuflash.problem import Problem

    fam = registry.get("sm90_bwd")
    from test_features_gpu import HEADS as heads
    out = []
    for causal, window, form in itertools.product((False, True), (True, False), (1, 2)):
        cfg = t.dq_tail_config(causal, window, form)
        cases = []
        if window:
            for w in t.WINDOWS:
                if (causal and w[0] < 0) or (not causal and w[1] == 0):
                    continue
                cases += [((w[0], 0) if causal else w, s, 2) for s in t.SHAPES[:3]]
            cases += [((1024, 0) if causal else (1024, 1024), s, 3) for s in t.SHAPES[3:]]
        else:
            cases = [(None, s, 2) for s in t.SHAPES]
        for w, (sq, sk, hk), batch in cases:
            h, hkv = heads[hk]
            # the call's own normalization (a bound past every key dropped: maybe plain causal)
            fa = check_features(None, window_size=w or (-1, -1), causal=causal, seqlens=(sq, sk))
            p = Problem("bwd", "bf16", batch, sq, sk, h, hkv, 128, fa.causal, features=fa.features,
                        window=fa.window_size)
            out += [fam.for_bounds(fam.for_problem(cfg, p), p), forward_of(p)]
    return out


def defaults_configs():
    """tests/test_feature_defaults_gpu.py's window forward + backward cases (whose backward takes dq_tail; not the
    stages-3 candidate), per call (for_problem, for_bounds)."""
    import test_feature_defaults_gpu as d
    from cuflash import registry
    from cuflash.api import check_features
    from cuflash.problem import Problem
    from test_features_gpu import HEADS as heads

    fam = registry.get("sm90_bwd")
    out = []
    for name, feats, causal, window, *_ in d.BACKWARD:
        if feats != ("window",) or name.endswith("_bwd_s3"):   # (the window defaults: dq_tail on; s3: none)
            continue
        bcfg = d.bwd_config(name, feats, causal)
        out.append(d.default_configs(feats, causal))
        for sq, sk, hk in d.GRAD_SHAPES:
            h, hkv = heads[hk]
            fa = check_features(None, window_size=window, causal=causal, seqlens=(sq, sk))
            p = Problem("bwd", "bf16", 2, sq, sk, h, hkv, 128, fa.causal, features=fa.features,
                        window=fa.window_size)
            out.append(fam.for_bounds(fam.for_problem(bcfg, p), p))
    return out


if __name__ == "__main__":
    t0 = time.time()
    from cuflash.compile import precompile

    cfgs = [] if "--no-timing" in sys.argv else timing_configs()
    if "--tests" in sys.argv:
        cfgs += test_configs()
    if "--defaults" in sys.argv:
        cfgs += defaults_configs()
    cfgs = list(dict.fromkeys(cfgs))
    print("\n".join(c.name for c in cfgs), flush=True)
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
