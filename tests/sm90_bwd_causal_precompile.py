"""Compile, in parallel worker processes, every kernel of tests/test_sm90_bwd_causal_gpu.py,
tests/sm90_bwd_causal_timing.py and (through the heuristic) tests/test_sm90_bwd_gpu.py (not a
test; run it first, then they find their kernels in CuPy's disk cache):

    timeout 120 python tests/sm90_bwd_causal_precompile.py
    timeout 150 python tests/sm90_bwd_causal_precompile.py --suite   # sm90_bwd's GPU test files' kernels
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

import sm90_bwd_causal_timing as timing  # noqa: E402
from test_sm90_bwd_causal_gpu import SHAPES  # noqa: E402
from test_sm90_bwd_gpu import HEADS  # noqa: E402


def configs():
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (2048, 4096, 8192, 16384):
                out += list(timing.variants_for(timing.problem(d, s, causal), list(timing.VARIANTS)).values())
                out.append(select.choose(timing.problem(d, s, causal, op="fwd"), arch, name, smem)[1])
    # the GPU tests: the heuristic's causal kernels with lpt (plain and deterministic), their forwards
    for d in (64, 128):
        for det in ((False, True) if d == 128 else (False,)):   # (the deterministic test: d128)
            for sq, sk in SHAPES + [(1000, 1000), (1023, 1100)]:
                for heads in HEADS.values():
                    p = Problem("bwd", "bf16", 2, sq, sk, heads[0], heads[1], d, True, det)
                    out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(lpt=True), p))
                    if not det:   # the dynamic scheduler's tests: both masks
                        for c in (False, True):
                            pc = p.replace(causal=c)
                            dyn = fam.heuristic(pc, arch, smem).replace(dynamic=True, lpt=c)
                            out.append(fam.for_problem(dyn, pc))
                            out.append(fam.for_problem(dyn.replace(ds_double=True), pc))
                    out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    # test_sm90_bwd_gpu.py through the heuristic: bf16 / fp16, both masks, deterministic or not
    # (the dynamic scheduler where HEURISTIC_DYNAMIC puts it), and their forwards
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for causal in (False, True):
                for det in (False, True):
                    p = Problem("bwd", dtype, 2, 1023, 1100, 4, 2, d, causal, det)
                    out.append(fam.for_problem(fam.heuristic(p, arch, smem), p))
                    out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    # their forwards at the test shapes' sizes and real head dims (selection may differ per bucket)
    for dtype in ("bf16", "fp16"):
        for d in (40, 64, 96, 120, 128):
            for causal in (False, True):
                for sq, sk in SHAPES + [(300, 333), (200, 190), (257, 257)]:
                    p = Problem("fwd", dtype, 2, sq, sk, 4, 2, d, causal)
                    try:
                        out.append(select.choose(p, arch, name, smem)[1])
                    except Exception:   # noqa: BLE001 - not run on this GPU: nothing to compile
                        pass
    return list(dict.fromkeys(out))


def suite_configs():
    """--suite: sm90_bwd's kernels for the call classes test_sm90_bwd_features_gpu.py runs through
    the heuristic (bf16 d64 / d128, causal and not, each feature set; deterministic and fp16 with
    all three features; dropout), as the heuristic and for_problem make them with the module
    constants as they are, and the forwards selection picks for them."""
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    every = ("alibi", "softcap", "window")
    classes = [("bf16", d, c, False, f) for d in (64, 128) for c in (False, True)
               for f in ((), ("window",), ("softcap",), ("alibi",), every, ("dropout",))]
    classes += [("bf16", 128, c, True, every) for c in (False, True)] + [("fp16", 128, True, False, every)]
    out = []
    for dtype, d, causal, det, feats in classes:
        p = Problem("bwd", dtype, 2, 1023, 1023, 4, 2, d, causal, det, features=feats,
                    dropout_p=0.1 if "dropout" in feats else 0.0)
        if fam.supports(arch, p):
            continue
        out.append(fam.for_problem(fam.heuristic(p, arch, smem), p))
        try:
            out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
        except Exception:   # noqa: BLE001 - a forward selection cannot make: compiled on first use
            pass
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    t0 = time.time()
    todo = suite_configs() if "--suite" in sys.argv else configs()
    res = precompile(todo)
    bad = [(c.name, e) for c, _, e in res if e]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {bad}")
    sys.exit(1 if bad else 0)
