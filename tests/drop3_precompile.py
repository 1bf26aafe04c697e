"""Fill CuPy's kernel cache with the kernels that test_sm90_dropout_gpu.py,
test_sm90_bwd_features_gpu.py's test_dropout and sm90_dropout_timing.py compile, in parallel
worker processes; not a test. Run it first:

    timeout 150 python tests/drop3_precompile.py

What it compiles (30 kernels, sm_90a): the mask cases' sm90_fwd (and fa2_fwd) dropout
forwards, the reference grid's forward and backward (fp16 d96, bf16 d256), the cross-family
pairs (d128 bf16 causal), the sm90_bwd dropout backwards (d128 causal / not, d64 causal,
d64 deterministic) with their forwards, and the timing's plain and dropout forward and backward at d64 / d128
8k, causal and not.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                   # tests/

from cuflash import _gpu, registry  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.select import choose_on_device  # noqa: E402


def forced(family, problem):
    fam = registry.get(family)
    return fam.for_problem(fam.heuristic(problem, _gpu.arch(0), _gpu.max_smem(0)), problem)


def configs():
    import test_sm90_dropout_gpu as t

    out = []
    p_drop = dict(features=("dropout",), dropout_p=t.P_DROP)
    for b, sq, sk, h, h_kv, causal, persistent in t.MASK_CASES:
        prob = Problem("fwd", "bf16", b, sq, sk, h, h_kv, 64, causal, **p_drop)
        cfg = forced("sm90_fwd", prob)
        out += [cfg.replace(persistent=True) if persistent else cfg, forced("fa2_fwd", prob)]
    out.append(forced("sm90_fwd", Problem("fwd", "bf16", 1, 200, 300, 2, 2, 64, False, **p_drop)))
    for name, d, causal in t.FLAGS:
        for b, sq, sk, h, h_kv in t.SHAPES:
            prob = Problem("fwd", name, b, sq, sk, h, h_kv, d, causal, **p_drop)
            out += [choose_on_device(prob, 0)[1], choose_on_device(prob.replace(op="bwd"), 0)[1]]
    for fwd, bwd in t.CROSS:
        for b, sq, sk, h, h_kv in ((2, 300, 417, 4, 2), (1, 1023, 113, 2, 1)):
            prob = Problem("fwd", "bf16", b, sq, sk, h, h_kv, 128, True, **p_drop)
            out += [forced(fwd, prob), forced(bwd, prob.replace(op="bwd"))]
    bwd = registry.get("sm90_bwd")   # test_sm90_bwd_features_gpu.py's test_dropout
    for d, causal, det in ((128, False, False), (128, True, False), (64, True, False), (64, False, True)):
        plain = Problem("bwd", "bf16", 2, 1023, 1023, 4, 2, d, causal, det)
        cfg = bwd.heuristic(plain, _gpu.arch(0))
        for b, sq, sk, h, h_kv in ((2, 113, 113, 4, 4), (1, 17, 1023, 4, 1), (1, 2049, 1023, 2, 2),
                                   (3, 1, 1, 4, 2), (1, 1023, 2049, 4, 2)):
            prob = Problem("bwd", "bf16", b, sq, sk, h, h_kv, d, causal, det, **p_drop)
            out += [bwd.for_problem(cfg, prob), choose_on_device(prob.replace(op="fwd"), 0)[1]]
    for d in (64, 128):   # sm90_dropout_timing.py's default cases
        for causal in (False, True):
            s, h = 8192, 2048 // d
            for op in ("fwd", "bwd"):
                plain = Problem(op, "bf16", 2, s, s, h, h, d, causal)
                out += [choose_on_device(plain, 0)[1],
                        choose_on_device(plain.replace(features=("dropout",), dropout_p=0.1), 0)[1]]
            from sm90_dropout_timing import fwd_configs
            out += fwd_configs(d, causal, 2, s, h)
    return list(dict.fromkeys(out))


def main():
    todo = configs()
    t0 = time.time()
    errors = [r for r in precompile(todo, 0, processes=min(16, os.cpu_count() or 1)) if r[2]]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {len(errors)}")
    for cfg, _, err in errors:
        print(f"  {cfg.name}: {err[:300]}")


if __name__ == "__main__":
    main()
