"""Compile, in parallel worker processes, every kernel of tests/test_sm90_psmem_gpu.py, the d64
kernels of tests/test_sm90_sched_gpu.py (-k d64: their heuristic tiles follow HEURISTIC_D64) and
tests/sm90_fwd_d64_timing.py into CuPy's disk cache (not a test; run it first, on the GPU machine):

    python tests/sm90_fwd_d64_precompile.py [--tests-only] [--dtype bf16,fp16] [--rows heur,heur_tree]

--tests-only: only the GPU tests' kernels; --dtype / --rows: the timing's dtypes (default both) and
rows (default all; the timing script's --rows); --bf16-only: --dtype bf16.
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the tests; cuflash from the checkout

from cuflash.compile import precompile  # noqa: E402

import sm90_fwd_d64_timing  # noqa: E402
import test_sm90_psmem_gpu  # noqa: E402


def sched_d64_configs():
    """test_sm90_sched_gpu.py's d64 kernels (``-k d64``) at every shape its tests give them (the
    heuristic's tile depends on the seqlen bucket)."""
    from types import SimpleNamespace

    import test_sm90_sched_gpu as sched

    out = []
    for k in sched.KERNELS:
        if k[1] != 64 or k[4]:
            continue
        for sq, sk in sched.SEQLENS + [(2049, 2049), (3000, 700)]:
            q, kk = SimpleNamespace(shape=(2, sq, 16, 64)), SimpleNamespace(shape=(2, sk, 4, 64))
            out.append(sched.config_for(k, q, kk))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests-only", action="store_true")
    ap.add_argument("--bf16-only", action="store_true")
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--rows", default=",".join(sm90_fwd_d64_timing.CANDIDATES))
    args = ap.parse_args()
    configs = test_sm90_psmem_gpu.configs() + sched_d64_configs()
    if not args.tests_only:
        for dtype in ("bf16",) if args.bf16_only else args.dtype.split(","):
            configs += sm90_fwd_d64_timing.all_configs(dtype, rows_wanted=tuple(args.rows.split(",")))
    configs = list(dict.fromkeys(configs))
    t0 = time.time()
    results = precompile(configs)
    bad = [(c.name, e) for c, _, e in results if e]
    for c, secs, e in results:
        print(f"{secs:6.1f} s  {c.name}{'  FAILED' if e else ''}")
    print(f"{len(configs)} kernels in {time.time() - t0:.0f} s")
    if bad:
        for name, e in bad:
            print(name, e[-2000:])
        sys.exit(1)


if __name__ == "__main__":
    main()
