"""Fill CuPy's kernel cache with the kernels of tests/test_drp8_gpu.py (and --also's test modules' all_configs())
in parallel worker processes; not a test:

    timeout 100 python tests/drp8_precompile.py [--also test_drop_early_gpu]
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
    ap.add_argument("--also", nargs="*", default=[], help="more test modules with all_configs() (e.g. test_drop_early_gpu)")
    ap.add_argument("--packed-d128", action="store_true",
                    help="also test_sm90_bwd_drop_packed_gpu.py's bf16 d128 kernels (pytest -k d128_bf16)")
    ap.add_argument("--cross", action="store_true",
                    help="also test_sm90_dropout_gpu.py's cross-family kernels (pytest -k share_the_mask)")
    args = ap.parse_args()
    import importlib

    import test_drp8_gpu

    todo = list(test_drp8_gpu.all_configs())
    for mod in args.also:
        todo += list(importlib.import_module(mod).all_configs())
    if args.packed_d128:
        import test_sm90_bwd_drop_packed_gpu as packed

        for causal in (False, True):
            fcfg, pk, base = packed.configs(128, "bf16", causal)
            todo += [fcfg, base, *pk]
    if args.cross:
        from cuflash import registry
        from cuflash.problem import Problem

        problem = Problem("fwd", "bf16", 2, 300, 417, 4, 2, 128, True, features=("dropout",), dropout_p=0.17)
        for name, p in (("sm90_fwd", problem), ("fa2_fwd", problem), ("sm90_bwd", problem.replace(op="bwd")),
                        ("fa2_bwd", problem.replace(op="bwd"))):
            fam = registry.get(name)
            todo.append(fam.for_problem(fam.heuristic(p), p))
    todo = list(dict.fromkeys(todo))
    t0 = time.time()
    res = precompile(todo, 0, processes=min(16, os.cpu_count() or 1))
    failed = [(c.name, err[:300]) for c, _, err in res if err]
    print(f"compiled {len(todo)} kernels in {time.time() - t0:.0f} s; failed: {failed}")


if __name__ == "__main__":
    main()
