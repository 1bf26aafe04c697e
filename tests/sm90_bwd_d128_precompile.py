"""Compile, in parallel worker processes, every kernel of tests/test_sm90_bwd_d128_gpu.py and
tests/sm90_bwd_d128_timing.py (not a test; run it first, then they find their kernels in CuPy's
disk cache):

    timeout 150 python tests/sm90_bwd_d128_precompile.py            # the tests' and the timing's
    timeout 100 python tests/sm90_bwd_d128_precompile.py --tests    # the GPU tests' only
    python tests/sm90_bwd_d128_precompile.py --variants heur dqe   # the timing's, those variants
    python tests/sm90_bwd_d128_precompile.py --d64      # and the timing's --hdim 64 kernels
    python tests/sm90_bwd_d128_precompile.py --grid     # and tests/test_sm90_bwd_gpu.py's
    python tests/sm90_bwd_d128_precompile.py --pin --d64   # test_d64_dk_late / frag_pin tests' only
    python tests/sm90_bwd_d128_precompile.py --no-tests --grid --d64 --rot   # the heuristic's grid, the timing's,
                                                  # test_s3_and_d64_rot_odd_seqlens's
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

import sm90_bwd_d128_timing as timing  # noqa: E402


def test_configs(pin_only=False):
    """The GPU tests' kernels (the shapes do not change them: one per flag set, mask, dtype,
    determinism) and their forwards; pin_only: those of test_d64_dk_late_odd_seqlens and the
    frag_pin tests only (--pin)."""
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    cases = [("bf16", c, False, flags) for c in (False, True)
             for flags in (dict(dq_early=True),)]
    cases += [("fp16", True, False, dict(dq_early=True, ds_double=True)), ("bf16", True, True, dict(dq_early=True))]
    cases += [("bf16", False, False, flags) for flags in (dict(q_rotate=True), dict(q_rotate=True, dq_early=True),
                                                          dict(q_rotate=True, dynamic=True))]
    cases += [("bf16", c, False, dict(dynamic=False, lpt=False, ds_double=True, dq_early=True, dk_late=True))
              for c in (False, True)]
    out = []
    for dtype in ("bf16", "fp16"):   # test_d64_dk_late_odd_seqlens
        for causal in (False, True):
            p = Problem("bwd", dtype, 2, 113, 301, 4, 2, 64, causal)
            out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(dq_early=True, dk_late=True), p))
            out.append(select.choose(p.replace(op="fwd"), arch, name, smem)[1])
    for causal in (False, True):   # test_frag_pin_odd_seqlens
        for d, dtype, flags in ((128, "bf16", {}), (64, "fp16", dict(dq_early=True, dk_late=True)),
                                (128, "bf16", dict(dynamic=True))):
            p = Problem("bwd", dtype, 2, 113, 301, 4, 2, d, causal)
            out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(frag_pin=True, **flags), p))
            out.append(select.choose(p.replace(op="fwd"), arch, name, smem)[1])
    out += rot_configs()
    for dtype in ("bf16",):   # test_bm80_odd_seqlens (bf16 only: the fp16 kernel spills)
        p = Problem("bwd", dtype, 2, 113, 301, 4, 2, 128, False)
        out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(BM=80, frag_pin=False), p))
        out.append(select.choose(p.replace(op="fwd"), arch, name, smem)[1])
    p = Problem("bwd", "bf16", 2, 1023, 1100, 4, 2, 128, True, True)   # test_frag_pin_deterministic_bitwise
    out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(frag_pin=True), p))
    out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    if pin_only:
        return list(dict.fromkeys(out))
    for dtype, causal, det, flags in cases:
        for sq, sk, h, hkv in ((113, 301, 4, 2), (4097, 4097, 8, 2)):
            p = Problem("bwd", dtype, 2, sq, sk, h, hkv, 128, causal, det)
            out.append(fam.for_problem(timing.old(fam.heuristic(p, arch, smem)).replace(**flags), p))
            out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    return list(dict.fromkeys(out))


def rot_configs():
    """test_s3_and_d64_rot_odd_seqlens's kernels and their forwards (--rot adds them to --no-tests)."""
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    out = []
    for hdim, flags in ((128, dict(stages=3)), (64, dict(q_rotate=True))):
        p = Problem("bwd", "fp16", 2, 113, 301, 4, 2, hdim, False)
        out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(**flags), p))
        out.append(select.choose(p.replace(op="fwd"), arch, name, smem)[1])
    return out


def grid_configs():
    """--grid: tests/test_sm90_bwd_gpu.py's kernels through the heuristic (dk_late at d128 now):
    bf16 / fp16, both masks, deterministic or not, head dims 64 / 128, and their forwards."""
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    out = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for causal in (False, True):
                for det in (False, True):
                    p = Problem("bwd", dtype, 2, 1023, 1100, 4, 2, d, causal, det)
                    out.append(fam.for_problem(fam.heuristic(p, arch, smem), p))
                    out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    for dtype in ("bf16", "fp16"):   # its forwards at the test shapes' real head dims
        for d in (40, 64, 96, 120, 128):
            for causal in (False, True):
                for sq, sk in ((1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301),
                               (301, 113), (1, 257), (257, 1), (300, 333)):
                    try:
                        out.append(select.choose(Problem("fwd", dtype, 2, sq, sk, 4, 2, d, causal), arch, name,
                                                 smem)[1])
                    except Exception:   # noqa: BLE001 - not run on this GPU: nothing to compile
                        pass
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    t0 = time.time()
    todo = ([] if "--no-tests" in sys.argv else test_configs("--pin" in sys.argv)) \
        + (grid_configs() if "--grid" in sys.argv else []) + (rot_configs() if "--rot" in sys.argv else [])
    names = None
    if "--variants" in sys.argv:
        names = ["heur"] + [n for n in sys.argv[sys.argv.index("--variants") + 1:]
                            if n in timing.VARIANTS or n == "all"]
    if "--tests" not in sys.argv:
        for hdim in (64, 128) if "--d64" in sys.argv else (128,):   # --d64: the timing's --hdim 64 too
            timing.HDIM = hdim
            todo += timing.all_configs(("bf16", "fp16"), (False, True), (2048, 4096, 8192, 16384), names)
        todo = list(dict.fromkeys(todo))
    res = precompile(todo)
    bad = [(c.name, e) for c, _, e in res if e]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {bad}")
    sys.exit(1 if bad else 0)
