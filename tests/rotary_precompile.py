"""Fill CuPy's kernel cache, in parallel worker processes, with every rotary module (not a test):
x in bf16 / fp16 / fp32, cos / sin in x's dtype or fp32, both pair orders, as cuflash.rotary's
plans name them (one module per (types, order): the one-element and the 16-byte-group kernels).

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/rotary_precompile.py [--processes 12]
"""
import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list:
    from cuflash.rotary import _KERNEL_TYPES

    out = []
    for x in _KERNEL_TYPES.values():
        for trig in dict.fromkeys((x, "float")):
            for order in ("false", "true"):
                types = f"{x}, {trig}, {order}"
                out.append((f"cuflash::rotary<{types}, false>", f"cuflash::rotary<{types}, true>"))
    return out


def compile_one(exprs):
    from cuflash.compile import get_helper_kernels

    t0 = time.perf_counter()
    try:
        get_helper_kernels("rotary", exprs, 0)
        return exprs[0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return exprs[0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mods = modules()
    with multiprocessing.get_context("spawn").Pool(min(args.processes, len(mods))) as pool:
        for name, seconds, error in pool.imap_unordered(compile_one, mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
    print(f"{len(mods)} rotary modules in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
