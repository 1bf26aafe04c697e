"""Fill CuPy's kernel cache, in parallel worker processes, with the fused MLP's activation modules
(kernels_cu/dense_act.cu; not a test) that tests/test_fused_dense_gpu.py, dense_act_sanitize.py and
fused_mlp_timing.py use: bf16 and fp16, every activation, 16-byte and one-element accesses.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/dense_act_precompile.py [--processes 12]
"""
import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list:
    import torch

    from cuflash.dense_act import ACTIVATIONS, kernel_names

    return [kernel_names(dt, act, v) for dt in (torch.bfloat16, torch.float16) for act in ACTIVATIONS
            for v in (True, False)]


def compile_one(exprs):
    from cuflash.compile import get_helper_functions

    t0 = time.perf_counter()
    try:
        get_helper_functions("dense_act", exprs, 0)
        return exprs[0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return exprs[0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mods = modules()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.processes, len(mods))) as pool:
        for name, seconds, error in pool.imap_unordered(compile_one, mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(mods)} dense_act modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
