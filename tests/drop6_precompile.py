"""Fill CuPy's kernel cache with the kernels of tests/test_sm90_bwd_drop_packed_gpu.py and, with
--timing, tests/sm90_dropout_timing.py's 8k ones (--hdims: head dims, 128 unless given), in parallel
worker processes; not a test:

    timeout 150 python tests/drop6_precompile.py --timing [--hdims 64 128] [--quick]
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the checkout (and the tests' modules)

from cuflash.compile import precompile  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timing", action="store_true", help="also sm90_dropout_timing.py's 8k kernels")
    ap.add_argument("--hdims", type=int, nargs="+", default=[128], help="with --timing: its head dims")
    ap.add_argument("--quick", action="store_true",
                    help="test_sm90_bwd_drop_packed_gpu.py's bf16 d128 kernels only (pytest -k d128_bf16)")
    args = ap.parse_args()
    import test_sm90_bwd_drop_packed_gpu as packed

    todo = [c for flags in packed.FLAGS if not args.quick or flags[:2] == (128, "bf16")
            for c in (lambda f, p, b: [f, b, *p])(*packed.configs(*flags))]
    if args.timing:
        import sm90_dropout_timing as timing

        for d in args.hdims:
            for causal in (False, True):
                todo += timing.case_configs(d, causal, 16384 // 8192, 8192, 2048 // d, forms=())
    todo = list(dict.fromkeys(todo))
    t0 = time.time()
    res = precompile(todo, 0, processes=min(16, os.cpu_count() or 1))
    failed = [(c.name, err[:300]) for c, _, err in res if err]
    print(f"compiled {len(todo)} kernels in {time.time() - t0:.0f} s; failed: {failed}")


if __name__ == "__main__":
    main()
