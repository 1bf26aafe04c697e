"""Fill CuPy's kernel cache, in parallel worker processes, with the cross-entropy modules (not a
test): one per logits dtype (bf16 / fp16 / fp32), as cuflash.cross_entropy's plans name them, and
bf16 modules of other (threads, unroll) choices for the timing script's --variants.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/cross_entropy_precompile.py [--processes 3] [--variants 512x2]
"""
import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules(variants=()) -> list:
    """The default module of each dtype, then bf16 modules of (threads, unroll) variants."""
    import torch

    from cuflash.cross_entropy import _KERNEL_TYPES, kernel_names

    out = [kernel_names(dt) for dt in _KERNEL_TYPES]
    out += [kernel_names(torch.bfloat16, v, v) for v in variants]
    return list(dict.fromkeys(out))


def parse_variants(text: str) -> list:
    """'256x4,512x2' -> [(256, 4), (512, 2)]"""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


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
    ap.add_argument("--variants", default="", help="bf16 (threads x unroll) variants too, e.g. 128x4,512x2")
    args = ap.parse_args()
    t0 = time.perf_counter()
    mods = modules(parse_variants(args.variants))
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.processes, len(mods))) as pool:
        for name, seconds, error in pool.imap_unordered(compile_one, mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(mods)} cross-entropy modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
