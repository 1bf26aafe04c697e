"""Fill CuPy's kernel cache, in parallel worker processes, with the fused LayerNorm / RMSNorm
modules (not a test) that tests/test_layer_norm_gpu.py, layer_norm_sanitize.py and
layer_norm_timing.py use: per (x, residual, weight) dtype combination, the CTA sizes of their
row lengths, 16-byte and one-element accesses.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/layer_norm_precompile.py [--processes 15]
"""
import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list:
    import torch

    from cuflash.layer_norm import BWD_CHUNKS, kernel_names

    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    combos = [(bf, bf, bf), (bf, f32, bf), (bf, bf, f32), (fp, fp, fp), (fp, f32, fp), (fp, fp, f32), (f32, f32, f32)]
    shapes = [(32, False), (32, True), (64, True), (128, True), (160, True), (256, True), (384, True), (512, True)]
    # the fused backward's modules at BWD_CHUNKS (its threads at the tests' and the timing's widths)
    bwd = [(32, False), (64, False), (64, True), (128, True), (256, True), (288, True), (512, True)]
    return list(dict.fromkeys([kernel_names(*c, t, v) for c in combos for t, v in shapes]
                              + [kernel_names(*c, t, v, BWD_CHUNKS) for c in combos for t, v in bwd]))


def compile_one(exprs):
    from cuflash.compile import get_helper_functions

    t0 = time.perf_counter()
    try:
        get_helper_functions("layer_norm", exprs, 0)
        return exprs[0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return exprs[0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=4)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mods = modules()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.processes, len(mods))) as pool:
        for name, seconds, error in pool.imap_unordered(compile_one, mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(mods)} layer-norm modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
