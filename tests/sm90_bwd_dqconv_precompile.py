"""Fill CuPy's kernel cache for tests/test_sm90_bwd_dqconv_gpu.py (its backward kernels with and without
dq_convert, and the forwards selection picks at its shapes) in parallel worker processes; with
--timing also tests/sm90_bwd_2k_timing.py's default set. Not a test.

    python tests/sm90_bwd_dqconv_precompile.py [--timing [--d192] [--long]]   (--long: 8k, 16k too)
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}   # test_sm90_bwd_gpu.HEADS
SHAPES = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113)]
CLASSES = [(128, "bf16", False), (128, "fp16", True), (256, "bf16", True), (256, "fp16", False)]


def flag_configs(flag, classes, extra=()):
    """The heuristic's kernels with config field `flag` on at the odd shapes of `classes` ((kernel head dim,
    dtype, causal): SHAPES, MHA / GQA / MQA in turn) and at the problems `extra` ((problem, on) pairs), and
    the forwards selection picks there (tests/test_sm90_bwd_dqconv_gpu.py's, and dq_first's)."""
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    fam = registry.get("sm90_bwd")
    problems = [(Problem("bwd", dtype, 2, sq, sk, *list(HEADS.values())[i % len(HEADS)], d, causal), True)
                for d, dtype, causal in classes for i, (sq, sk) in enumerate(SHAPES)]
    out = []
    for p, on in problems + list(extra):
        out.append(fam.for_problem(fam.heuristic(p, arch, smem).replace(**{flag: on}), p))
        out.append(select.choose(p.replace(op="fwd", deterministic=False), arch, name, smem)[1])
    return list(dict.fromkeys(out))


def test_configs():
    many = [(Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, d, True), on) for d in (128, 256) for on in (True, False)]
    return flag_configs("dq_convert", CLASSES, [(Problem("bwd", "bf16", 2, 1023, 1100, 4, 2, 192, True), True)] + many
                        + [(Problem("bwd", "bf16", 2, 1023, 1100, 4, 2, 128, False, True), True)])


def timing_configs(d192=False, long=False):
    """sm90_bwd_2k_timing.py's kernels at --hdims 128 256 (and with d192: --hdims 192 --variants heur split
    dqc), 2k and 4k."""
    import sm90_bwd_2k_timing as t

    out = []
    for d in (128, 256) + ((192,) if d192 else ()):
        names = ["heur", "split", "dqc"] if d == 192 else list(t.DEFAULT_VARIANTS) + ["nodqc"]
        for dtype in ("bf16", "fp16"):
            for s in (2048, 4096) + ((8192, 16384) if long else ()):
                for causal in (False, True):
                    p = t.problem(s, causal, dtype, d)
                    out += list(t.variants_for(p, names).values())
                    out.append(select.choose(t.problem(s, causal, dtype, d, op="fwd"), _gpu.arch(), _gpu.name(),
                                             _gpu.max_smem())[1])
    return out


if __name__ == "__main__":
    t0 = time.time()
    todo = test_configs() + (timing_configs("--d192" in sys.argv, "--long" in sys.argv)
                             if "--timing" in sys.argv else [])
    todo = list(dict.fromkeys(todo))
    errors = [(c.name, e) for c, _, e in precompile(todo) if e]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {errors}", flush=True)
    sys.exit(1 if errors else 0)
