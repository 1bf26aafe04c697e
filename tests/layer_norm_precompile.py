"""Fill CuPy's kernel cache, in parallel worker processes, with the fused LayerNorm / RMSNorm
modules (not a test) that tests/test_layer_norm_gpu.py, layer_norm_sanitize.py and
layer_norm_timing.py use: per (x, residual, weight) dtype combination, the CTA sizes of their
row lengths, 16-byte and one-element accesses.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/layer_norm_precompile.py [--processes 15]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helper_precompile  # noqa: E402 - tests/ (this script's folder) is on sys.path


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=4)
    args = ap.parse_args()
    sys.exit(helper_precompile.run("layer_norm", modules(), args.processes, "layer-norm"))


if __name__ == "__main__":
    main()
