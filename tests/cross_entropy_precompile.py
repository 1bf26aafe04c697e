"""Fill CuPy's kernel cache, in parallel worker processes, with the cross-entropy modules (not a
test): one per logits dtype (bf16 / fp16 / fp32), as cuflash.cross_entropy's plans name them.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/cross_entropy_precompile.py [--processes 3]
"""
import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list:
    from cuflash.cross_entropy import THREADS, _KERNEL_TYPES

    return [(f"cuflash::cross_entropy_fwd<{e}, {THREADS}>", f"cuflash::cross_entropy_fwd_combine<{e}>",
             f"cuflash::cross_entropy_bwd<{e}, {THREADS}, true>", f"cuflash::cross_entropy_bwd<{e}, {THREADS}, false>")
            for e in _KERNEL_TYPES.values()]


def compile_one(exprs):
    from cuflash.compile import get_helper_kernels

    t0 = time.perf_counter()
    try:
        get_helper_kernels("cross_entropy", exprs, 0)
        return exprs[0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return exprs[0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mods = modules()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.processes, len(mods))) as pool:
        for name, seconds, error in pool.imap_unordered(compile_one, mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(mods)} cross-entropy modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
