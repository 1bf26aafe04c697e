"""Fill CuPy's kernel cache with the kernels of tests/test_drop_early_gpu.py (and, with
--timing, tests/sm90_dropout_timing.py's d128 ones), in parallel worker processes; not a test:

    timeout 120 python tests/drop4_precompile.py --timing --quick   # (--masks: test_sm90_dropout_gpu's too)
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
    ap.add_argument("--timing", action="store_true", help="also sm90_dropout_timing.py's d128 kernels")
    ap.add_argument("--quick", action="store_true", help="with --timing: sm90_dropout_timing.py --quick's")
    ap.add_argument("--rounds-cost", action="store_true", help="with --timing: its --rounds-cost form too")
    ap.add_argument("--masks", action="store_true",
                    help="also test_sm90_dropout_gpu.py's mask and cross-family tests' kernels")
    args = ap.parse_args()
    import test_drop_early_gpu

    todo = test_drop_early_gpu.all_configs()
    if args.masks:
        import test_sm90_dropout_gpu as t
        from cuflash.problem import Problem

        for b, sq, sk, h, h_kv, causal, persistent in t.MASK_CASES:
            p = Problem("fwd", "bf16", b, sq, sk, h, h_kv, 64, causal, features=("dropout",), dropout_p=t.P_DROP)
            cfg = t.forced("sm90_fwd", p)
            todo.append(cfg.replace(persistent=True) if persistent else cfg)
            if not persistent:
                todo.append(t.forced("fa2_fwd", p))
        for fwd, bwd in t.CROSS:
            p = Problem("fwd", "bf16", 2, 300, 417, 4, 2, 128, True, features=("dropout",), dropout_p=t.P_DROP)
            todo += [t.forced(fwd, p), t.forced(bwd, p.replace(op="bwd"))]
    if args.timing:
        import sm90_dropout_timing as timing

        for causal in (False, True):
            todo += timing.case_configs(128, causal, 2, 8192, 16, quick=args.quick, rounds_cost=args.rounds_cost)
    todo = list(dict.fromkeys(todo))
    t0 = time.time()
    res = precompile(todo, 0, processes=min(16, os.cpu_count() or 1))
    failed = [f"{c.name}: {err}" for c, _, err in res if err]
    print(f"compiled {len(todo)} kernels in {time.time() - t0:.0f} s; failed: {failed}")


if __name__ == "__main__":
    main()
